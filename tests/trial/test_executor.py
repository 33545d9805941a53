"""One trial from parameters to result, and the one place where exceptions become trial
states: out of memory, a non-finite loss and the pruner prune; anything else fails the trial
alone. Real training of tiny models; OOMs injected (HPO_FAULT_*)."""

import math

import optuna
import pytest
from conftest import run_in_process as run
from conftest import trials_of as trials
from optuna.trial import TrialState


def test_oom_in_training_prunes_the_trial_and_lowers_the_cached_batch(
    tiny_study, storage, monkeypatch
):
    monkeypatch.setenv("HPO_FAULT_OOM_AT_STEP", "2")
    assert run(tiny_study, storage, 2) == 0
    ended = trials(storage)
    assert len(ended) == 2
    for trial in ended:
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "oom"
        assert "out of memory" in trial.user_attrs["error"]
        lowered = trial.user_attrs["batch_limit_after_oom"]
        assert lowered["smallest_fail"] <= trial.user_attrs["physical_batch_size"]
    study = optuna.load_study(study_name="tiny", storage=storage)
    limits = [v for k, v in study.user_attrs.items() if k.startswith("batch_limit:")]
    assert limits and all(v["smallest_fail"] is not None for v in limits)


def test_nan_loss_prunes_the_trial(tiny_study, storage, monkeypatch):
    import hpo.training.train

    original = hpo.training.train.micro_batch_loss
    monkeypatch.setattr(hpo.training.train, "micro_batch_loss",
                        lambda *a, **k: original(*a, **k) * math.nan)
    # Past the check, which would find every combination unusable and stop the worker.
    assert run(tiny_study, storage, 2, "--skip-check") == 0
    for trial in trials(storage):
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "nan_loss"
        assert trial.user_attrs["error"].startswith("loss nan at epoch 1, step 1")


def test_pruner_verdict_prunes_with_reason(tiny_study, storage, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    assert run(tiny_study, storage, 1, "--set", "training.epochs=3") == 0
    for trial in trials(storage):
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "pruner"
        assert list(trial.intermediate_values) == [1]


def test_other_errors_fail_the_trial_with_the_error_recorded(tiny_study, storage, monkeypatch,
                                                             capsys):
    import hpo.trial.drivers

    def broken(*args, **kwargs):
        raise ValueError("broken collate")

    monkeypatch.setattr(hpo.trial.drivers, "train", broken)
    assert run(tiny_study, storage, 5) == 1
    ended = trials(storage)
    assert len(ended) == 3  # then the worker's circuit breaker stops it
    for trial in ended:
        assert trial.state == TrialState.FAIL
        assert trial.user_attrs["error"] == "ValueError: broken collate"
        assert "raise ValueError(\"broken collate\")" in trial.user_attrs["traceback"]
        assert trial.user_attrs["physical_batch_size"] >= 1  # planned before it failed
    assert "3 trials in a row failed; last error: ValueError: broken collate" in (
        capsys.readouterr().err)


def test_every_trial_releases_memory_after_it_ends(tiny_study, storage, monkeypatch):
    import sys

    from hpo.trial import executor

    callers = []
    release = executor.memory.release_memory

    def spy() -> None:
        callers.append(sys._getframe(1).f_code.co_name)
        release()

    monkeypatch.setattr(executor.memory, "release_memory", spy)
    assert run(tiny_study, storage, 2) == 0
    assert callers.count("execute") == len(trials(storage)) == 2


def _reap_during_first_epoch(monkeypatch, storage_url: str, claimed_by_another: bool):
    """Make the reaper strike while trial 0 trains: on its first epoch, another worker fails
    it and queues its retry copy, as liveness.reap does with a trial whose heartbeats stopped;
    with `claimed_by_another`, that worker then also claims and finishes the copy."""
    from hpo.app import console
    from hpo.search.storage import open_storage

    epoch = console.ConsoleDisplay.epoch
    struck = []

    def reaped_meanwhile(self, number, *args):
        if not struck:
            struck.append(number)
            other = open_storage(storage_url, heartbeat_interval=30, grace_period=120)
            study = optuna.load_study(study_name="tiny", storage=other)
            (running,) = study.get_trials(states=(TrialState.RUNNING,))
            assert other.set_trial_state_values(running._trial_id, state=TrialState.FAIL)
            other.get_heartbeat_stale_trial_callback()(study, other.get_trial(running._trial_id))
            if claimed_by_another:
                copy = study.ask()
                assert copy.params == running.params  # the retry copy, claimed
                study.tell(copy, 0.5)
            other.engine.dispose()
        epoch(self, number, *args)

    monkeypatch.setattr(console.ConsoleDisplay, "epoch", reaped_meanwhile)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_trial_reaped_while_it_ran_keeps_its_result_in_its_retry_copy(
        tiny_study, storage, monkeypatch, capsys):
    _reap_during_first_epoch(monkeypatch, storage, claimed_by_another=False)
    assert run(tiny_study, storage, 2, "--set", "training.epochs=2") == 0
    reaped, kept, after = trials(storage)
    assert [t.state for t in (reaped, kept, after)] == [TrialState.FAIL, TrialState.COMPLETE,
                                                       TrialState.COMPLETE]
    assert kept.params == reaped.params
    assert kept.user_attrs["result_of"] == 0
    assert sorted(kept.intermediate_values) == [1, 2]  # epoch 1 carried over, epoch 2 written
    assert kept.user_attrs["epochs_completed"] == 2
    out = capsys.readouterr().out
    assert f"trial 1 value {kept.value:.4f}" in out
    assert "(the run of trial 0, reaped while it ran)" in out, out


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used")
def test_a_trial_reaped_while_it_ran_whose_retry_was_taken_is_dropped_with_a_warning(
        tiny_study, storage, monkeypatch, capsys):
    _reap_during_first_epoch(monkeypatch, storage, claimed_by_another=True)
    assert run(tiny_study, storage, 2, "--set", "training.epochs=2") == 0
    states = [t.state for t in trials(storage)]
    assert states == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    captured = capsys.readouterr()
    assert ("hpo: warning: trial 0 was reaped while it ran (its heartbeats were lost) and its "
            "retry was already claimed by another worker: this run's result is dropped"
            ) in captured.err
    assert "trial 0 value" not in captured.out


def test_every_end_of_a_trial_is_mapped_to_its_state_in_one_function():
    """executor.outcome_of: each way a trial can end, and the state it is told with."""
    import signal

    import torch

    from hpo.errors import Terminated
    from hpo.outcome import ChildDied, GivenBack, Reaped
    from hpo.training.train import NonFiniteLoss
    from hpo.trial.executor import outcome_of
    from hpo.trial.step_check import Unusable

    cases = [
        (None, TrialState.COMPLETE, None, None),
        (optuna.TrialPruned("pruned at epoch 1"), TrialState.PRUNED, "pruner", None),
        (Unusable("m fp16: loss nan"), TrialState.PRUNED, "unusable", "m fp16: loss nan"),
        (NonFiniteLoss("loss nan at epoch 1"), TrialState.PRUNED, "nan_loss",
         "loss nan at epoch 1"),
        (torch.OutOfMemoryError("CUDA out of memory"), TrialState.PRUNED, "oom",
         "OutOfMemoryError: CUDA out of memory"),
        (ChildDied(-signal.SIGKILL, ("k", 8)), TrialState.PRUNED, "oom",
         "trial process killed by SIGKILL (as the OOM killer does) at micro-batch 8"),
        (ChildDied(-signal.SIGKILL, None), TrialState.PRUNED, "oom",
         "trial process killed by SIGKILL (as the OOM killer does) before it tried a batch"),
        (ChildDied(-signal.SIGABRT, ("k", 8)), TrialState.FAIL, None,
         "trial process killed by SIGABRT"),
        (KeyboardInterrupt(), TrialState.FAIL, None, "interrupted by Ctrl-C"),
        (Terminated("SIGTERM"), TrialState.FAIL, None, "interrupted by SIGTERM"),
        (GivenBack("given back"), TrialState.FAIL, None, "given back"),
        (ValueError("broken collate"), TrialState.FAIL, None, "ValueError: broken collate"),
    ]
    for ended, state, reason, error in cases:
        outcome = outcome_of(3, ended, 0.5 if ended is None else None)
        assert (outcome.state, outcome.prune_reason, outcome.error) == (state, reason, error), \
            ended
        assert outcome.dropped is None
    assert outcome_of(3, None, 0.5).value == 0.5
    for lost in (Reaped("trial 3 was reaped while it ran"),
                 optuna.exceptions.UpdateFinishedTrialError("finished")):
        outcome = outcome_of(3, lost)
        assert outcome.state == TrialState.FAIL and outcome.dropped.startswith("trial 3 was ")


def _context(study: optuna.Study | None = None):
    from hpo.search.liveness import LiveTrial
    from hpo.trial.batch_limit import StudyBatchCache
    from hpo.trial.context import TrialContext

    study = study or optuna.create_study()
    return TrialContext(study, LiveTrial(study.ask()), StudyBatchCache(study), display=None)


def test_tell_prunes_an_oom_and_lowers_the_studys_batch_limit_for_what_it_tried():
    from hpo.outcome import Outcome
    from hpo.trial.batch_limit import BatchLimit
    from hpo.trial.executor import tell

    context = _context()
    context.cache.update("m|bf16", BatchLimit(8))
    outcome = Outcome(TrialState.PRUNED, prune_reason="oom", error="out of memory")
    told, frozen = tell(context, outcome, tried=("m|bf16", 12))
    assert told == outcome and frozen.state == TrialState.PRUNED
    assert context.cache.get("m|bf16") == BatchLimit(8, 12)
    assert frozen.user_attrs["batch_limit_after_oom"] == BatchLimit(8, 12).to_json()
    assert frozen.user_attrs["prune_reason"] == "oom"


def test_tell_leaves_the_batch_limit_alone_when_a_trial_fails_otherwise():
    from hpo.outcome import Outcome
    from hpo.trial.batch_limit import BatchLimit
    from hpo.trial.executor import tell

    context = _context()
    outcome = Outcome(TrialState.FAIL, error="ValueError: broken")
    told, frozen = tell(context, outcome, tried=("m|bf16", 12), failed_at="Traceback ...")
    assert frozen.state == TrialState.FAIL and told.dropped is None
    assert context.cache.get("m|bf16") == BatchLimit()
    assert frozen.user_attrs["traceback"] == "Traceback ..."


def test_tell_drops_the_result_of_a_trial_reaped_with_no_copy_to_carry_it():
    from hpo.outcome import Outcome
    from hpo.trial.executor import tell

    context = _context()
    context.study.tell(context.trial, state=TrialState.FAIL)  # as the reaper does
    told, frozen = tell(context, Outcome(TrialState.COMPLETE, value=0.5))
    assert told.dropped and "was reaped while it ran" in told.dropped
    assert frozen.state == TrialState.FAIL and frozen.value is None
