"""What a worker shows on a terminal."""

import io

from rich.console import Console

from hpo.app.console import ConsoleDisplay
from hpo.space import Params
from hpo.training.train import Plan
from hpo.training.train import Progress as TrainProgress

HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def test_an_interrupted_trial_clears_its_progress_bar_and_shows_the_cursor_again():
    screen = io.StringIO()
    display = ConsoleDisplay(Console(file=screen, force_terminal=True, width=120,
                                       highlight=False))
    params = Params("tiny-bert", "bf16", 32, 3e-5)
    plan = Plan("bf16", 32, 16, 64, 3e-5, 0.01, 0.1, 1.0, epochs=3, seed=0)
    display.trial_started(4, params, plan, probes=0)
    display.step(4, TrainProgress(epoch=1, step=3, steps_per_epoch=10), epochs=3)
    display.interrupted("trial 4 failed (interrupted by Ctrl-C) and re-queued")
    shown = screen.getvalue()
    assert HIDE_CURSOR in shown  # the bar hid it while it ran
    assert shown.rindex(SHOW_CURSOR) > shown.rindex(HIDE_CURSOR)
    # The message is the last thing drawn: no bar redrawn after it.
    assert shown.rstrip().endswith("trial 4 failed (interrupted by Ctrl-C) and re-queued")
    display.interrupted("nothing running")  # no bar: just the line
    assert screen.getvalue().rstrip().endswith("nothing running")


def test_a_paused_trial_shows_the_seconds_its_epochs_took():
    import optuna
    from optuna.trial import TrialState

    from hpo.outcome import Outcome

    screen = io.StringIO()
    display = ConsoleDisplay(Console(file=screen, width=300, highlight=False))
    trial = optuna.trial.create_trial(
        state=TrialState.RUNNING, params={"learning_rate": 3e-5},
        distributions={"learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-3)},
        user_attrs={"epoch_seconds": [12.25, 0.5], "physical_batch_size": 8,
                    "grad_accum_steps": 1})
    display.trial_finished(trial, Outcome(TrialState.RUNNING, paused_at=2))
    assert "paused at step 2" in screen.getvalue()
    assert screen.getvalue().rstrip().endswith("batch 8x1 12.8s")
