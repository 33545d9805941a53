"""The worker loop: the study-wide total, the circuit breaker, and a dead worker's trial
failed and retried by a live one. Real storages, real processes."""

import gc
import signal
import time
from collections import Counter

import optuna
import pytest
from conftest import Quiet, freeze_counts, start_worker, trial_states
from optuna.trial import TrialState

from hpo.app import console, worker
from hpo.app.console import below_baseline_warning
from hpo.app.worker import Limits, WorkerStopped, run_worker
from hpo.cli import main
from hpo.errors import Terminated
from hpo.outcome import Outcome
from hpo.search.storage import open_storage
from hpo.search.study import make_sampler
from hpo.study_files import load

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def ending_in(state: TrialState):
    """A trial runner that ends every trial in `state` at once, with no training."""

    def run(context):
        trial = context.trial
        trial.suggest_float("x", 0.0, 1.0)
        value = 0.5 if state == TrialState.COMPLETE else None
        return Outcome(state, value=value, error="broken"), context.study.tell(trial, value,
                                                                               state=state)

    return run


@pytest.fixture
def bare_study(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}")
    return optuna.create_study(study_name="w", storage=storage), storage


def test_a_worker_stops_at_the_study_total(bare_study):
    study, storage = bare_study
    result = run_worker(study, storage, ending_in(TrialState.COMPLETE), Quiet(), Limits(3))
    assert (result.ran, result.finished) == (3, 3)
    again = run_worker(study, storage, ending_in(TrialState.COMPLETE), Quiet(), Limits(3))
    assert (again.ran, again.finished) == (0, 3)


def pruned_after(steps: int):
    """A trial runner that reports `steps` steps and prunes every trial there."""

    def run(context):
        trial = context.trial
        trial.suggest_float("x", 0.0, 1.0)
        for step in range(1, steps + 1):
            trial.report(0.1 * step, step)
        return Outcome(TrialState.PRUNED), context.study.tell(trial, state=TrialState.PRUNED)

    return run


def test_a_budget_of_trainings_runs_trials_until_no_whole_training_fits(bare_study):
    # --n-trials 3 of 4 steps each: 12 steps. Each trial stops after 1, so trials start
    # while 4 are left: 9 of them, where a budget of trials would run 3.
    study, storage = bare_study
    limits = Limits(3, trainings=worker.budget.Trainings(3, 4))
    result = run_worker(study, storage, pruned_after(1), Quiet(), limits)
    assert (result.ran, result.finished) == (9, 9)
    assert sum(max(t.intermediate_values) for t in study.trials) == 9
    again = run_worker(study, storage, pruned_after(1), Quiet(), limits)
    assert (again.ran, again.finished) == (0, 9)
    assert worker.budget_left(study, storage, limits) is False
    assert worker.budget_left(study, storage, Limits(4, trainings=worker.budget.Trainings(
        4, 4))) is True


def test_the_budget_words_say_what_n_trials_bought():
    pruned = console.Spent(20, 11.25, counted=False)
    assert pruned.words(20) == (
        "the study has 20 of 20 finished: 11.2 full trainings' worth of epochs; "
        "study.budget: trainings makes --n-trials count full trainings")
    assert console.Spent(20, 20.0, counted=False).words(20) == (
        "the study has 20 of 20 finished: 20.0 full trainings' worth of epochs")
    assert console.Spent(20, 19.5, counted=True).words(37) == (
        "the study has 37 finished: 19.5 of 20 full trainings' worth of epochs "
        "(study.budget: trainings)")


def test_failed_trials_free_their_slot_and_three_in_a_row_stop_the_worker(bare_study):
    study, storage = bare_study
    with pytest.raises(WorkerStopped, match="3 trials in a row failed; last error: broken"):
        run_worker(study, storage, ending_in(TrialState.FAIL), Quiet(), Limits(2))
    assert Counter(t.state for t in study.trials) == {TrialState.FAIL: 3}


def test_a_timeout_stops_claiming(bare_study):
    study, storage = bare_study
    display = Quiet()
    result = run_worker(study, storage, ending_in(TrialState.COMPLETE), display,
                        Limits(float("inf"), timeout=1e-9))
    assert result.ran == 0 and "timeout of 1e-09s reached" in display.messages


@pytest.mark.parametrize(("stop", "why"), [(Terminated, "SIGTERM"),
                                           (KeyboardInterrupt, "Ctrl-C")])
def test_an_interrupted_trial_is_failed_with_the_reason_and_requeued_at_once(tmp_path, stop,
                                                                             why):
    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}", heartbeat_interval=30,
                           grace_period=120)
    study = optuna.create_study(study_name="w", storage=storage)

    def interrupted(context):
        context.trial.suggest_float("x", 0.0, 1.0)
        raise stop()

    display = Quiet()
    with pytest.raises(stop):
        run_worker(study, storage, interrupted, display, Limits(1))
    (failed,) = study.get_trials(states=(TrialState.FAIL,))
    assert failed.user_attrs["error"] == f"interrupted by {why}"
    assert display.messages[-1] == (
        f"trial 0 failed (interrupted by {why}) and re-queued for the next worker")
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    assert waiting.params == failed.params and "error" not in waiting.user_attrs
    # The next worker takes the re-queued trial first, with the same parameters.
    run_worker(study, storage, ending_in(TrialState.COMPLETE), Quiet(), Limits(1))
    (done,) = study.get_trials(states=(TrialState.COMPLETE,))
    assert done.params == failed.params and done.user_attrs["retry_of"] == 0


def test_an_interrupted_trial_whose_retries_are_used_up_stays_failed(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'w.db'}", heartbeat_interval=30,
                           grace_period=120, max_retry=0)
    study = optuna.create_study(study_name="w", storage=storage)

    def interrupted(context):
        raise KeyboardInterrupt

    display = Quiet()
    with pytest.raises(KeyboardInterrupt):
        run_worker(study, storage, interrupted, display, Limits(1))
    assert display.messages[-1] == (
        "trial 0 failed (interrupted by Ctrl-C); its retries are used up")
    assert [t.state for t in study.trials] == [TrialState.FAIL]


def test_sigterm_stops_a_worker_at_once_and_frees_its_trial(tiny_study, tmp_path):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    worker = start_worker(tiny_study, storage, 1, "--set", "training.epochs=1000")
    try:
        # Lines come as the worker prints them: wait for its trial to start training.
        wait_for(lambda: "start:" in worker.stdout.readline() or worker.poll() is not None)
        time.sleep(1)
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 143, err
    assert err.strip().splitlines()[-1] == "hpo: terminated (SIGTERM)"
    assert "trial 0 failed (interrupted by SIGTERM) and re-queued for the next worker" in out
    study = optuna.load_study(study_name="tiny", storage=storage)
    failed, waiting = study.trials
    assert failed.state == TrialState.FAIL and waiting.state == TrialState.WAITING
    assert failed.user_attrs["error"] == "interrupted by SIGTERM"
    assert waiting.params == failed.params


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_seeded_study_draws_new_parameters_after_a_restart(tiny_study, tmp_path, sampler):
    config = load(tiny_study, [f"study.sampler.name={sampler}", "study.sampler.seed=7"])

    def search(path: str, budgets: tuple[int, ...]) -> list[float]:
        storage = open_storage(f"sqlite:///{tmp_path / path}")
        for n_trials in budgets:  # each budget is a worker process started anew
            study = optuna.create_study(study_name="w", storage=storage, load_if_exists=True,
                                        sampler=make_sampler(config))
            run_worker(study, storage, ending_in(TrialState.COMPLETE), Quiet(),
                       Limits(n_trials))
        return [t.params["x"] for t in study.trials]

    restarted = search("restarted.db", (3, 6))
    assert len(set(restarted)) == 6  # trials 3-5 are not trials 0-2 again
    # Still reproducible: the same values as one worker that never stopped.
    assert search("uninterrupted.db", (6,)) == restarted


def test_run_on_each_backend(tiny_study, any_storage, monkeypatch):
    frozen_at_trials = freeze_counts(monkeypatch, worker, "execute")
    assert main(["run", "--config", str(tiny_study), "--storage", any_storage,
                 "--n-trials", "2"]) == 0
    assert trial_states(any_storage)[TrialState.COMPLETE] == 2
    # What the worker held before its trials was out of the collector's sight while they ran,
    # and is back in it once the worker is done.
    assert len(frozen_at_trials) == 2 and all(n > 0 for n in frozen_at_trials)
    assert gc.get_freeze_count() == 0


def test_tiny_validation_data_and_a_best_below_the_baseline_are_warned_of(tiny_study, tmp_path,
                                                                          capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "1"]) == 0
    err = capsys.readouterr().err
    study = optuna.load_study(study_name="tiny", storage=storage)
    assert "hpo: warning: the validation split has only 20 posts" in err  # 80 x 0.25
    below = study.best_value < study.user_attrs["baseline"]["macro_f1"]
    assert ("is below the trivial baseline" in err) == below


def test_below_baseline_warning():
    study = optuna.create_study(direction="maximize")
    assert below_baseline_warning(study, "macro_f1", 0.2) is None  # nothing finished yet
    study.add_trial(optuna.trial.create_trial(value=0.15))
    assert below_baseline_warning(study, "macro_f1", 0.2).startswith(
        "the best trial (macro_f1 0.1500) is below the trivial baseline (0.2000, ")
    study.add_trial(optuna.trial.create_trial(value=0.25))
    assert below_baseline_warning(study, "macro_f1", 0.2) is None


def test_run_continues_and_stops_at_the_study_total(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--config", str(tiny_study), "--storage", storage, "--n-trials"]
    assert main([*run, "2"]) == 0
    assert main([*run, "2"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert sum(trial_states(storage).values()) == 2
    assert main([*run, "3"]) == 0
    assert sum(trial_states(storage).values()) == 3


def test_a_run_says_the_study_first_and_what_to_run_next(tiny_study, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The default budget (study.budget: trainings) counts full trainings.
    assert lines[0].startswith(f"study 'tiny' on {storage}: 0 trials finished, a budget of 2 "
                               f"full trainings; device cpu")
    assert "precisions: fp32" in lines[1]  # as users name it, not fp_precision's "none"
    out = "\n".join(lines)
    assert "none" not in out.replace("peft=none", "")
    assert "  1 trial finished, 1.0/2 trainings trained, about " in out and " left" in out
    assert "  2 trials finished, 2.0/2 trainings trained" in out
    assert ("this worker ran 2 trials; the study has 2 finished: 2.0 of 2 full trainings' "
            "worth of epochs (study.budget: trainings)") in out
    assert f"the study is in {storage}" in out
    assert lines[-1].startswith(f"next: hpo final --config {tiny_study}")


def test_the_pace_of_a_study_gives_the_time_left():
    pace = worker.Pace(since=time.monotonic() - 60, first=2)
    assert pace.progress(2, 20) == "  2/20 trials finished"  # nothing finished since: no guess
    assert pace.progress(5, 20) == "  5/20 trials finished, about 5 min left"
    assert pace.progress(20, 20) == "  20/20 trials finished"
    assert pace.progress(7, float("inf")) == "  7 trials finished"
    trained = worker.Pace(since=time.monotonic() - 60, first=2.0)
    assert trained.progress(9, 20, spent=5.0) == (
        "  9 trials finished, 5.0/20 trainings trained, about 5 min left")
    assert [worker.duration(s) for s in (42, 600, 7200)] == ["42 s", "10 min", "2.0 h"]
    assert [console.plural(n, "trial") for n in (0, 1, 2)] == ["0 trials", "1 trial", "2 trials"]


def test_the_precision_decision_names_fp32_and_keeps_the_rule_for_verbose():
    from hpo.space import PinnedSpace

    pinned = PinnedSpace({"fp_precision": "auto"}, ("bf16",), {
        "by": "cost", "tolerance": 0.1,
        "dropped": {"none": "its step took 1.18x bf16's, summed over 2 model(s)"}})
    assert console.describe_decision(pinned) == (
        "precisions searched: bf16; fp32 left out (its step took 1.18x bf16's, summed over "
        "2 model(s))")
    assert "study.precision_tolerance 0.1" in console.describe_decision(pinned, verbose=True)
    # A decision the timed rounds' spread leaves unsettled says so, with why.
    why = ("its step took 1.12x bf16's, within the timed rounds' spread (+/-6%) of the "
           "tolerance's 1.10x: another run may keep it")
    unsettled = PinnedSpace(pinned.declared, pinned.fp_precision,
                            {**pinned.decided, "unsettled": {"none": why}})
    assert console.describe_decision(unsettled).endswith(f"; unsettled: fp32 {why}")


def wait_for(condition, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


@pytest.mark.slow
def test_killed_worker_trial_is_failed_and_retried_by_a_waiting_worker(tiny_study, pg_url):
    env = {"HPO_HEARTBEAT_INTERVAL": "1", "HPO_GRACE_PERIOD": "4"}
    # One storage (one small connection pool) for all the polling below.
    storage = optuna.storages.RDBStorage(pg_url)

    def claimed() -> int:
        try:
            study = optuna.load_study(study_name="tiny", storage=storage)
        except KeyError:
            return 0
        return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING, *FINISHED)))

    # Training settings are the worker's own (only the search space is pinned): the victim's
    # trial never ends by itself, the survivor's trials are quick. The survivor's first trial
    # may start and end between two polls, so the wait is for its claim, not for it running.
    # Trials counted: under a budget of trainings the victim's endless trial would hold it.
    counted = ("--set", "study.budget=trials")
    victim = start_worker(tiny_study, pg_url, 2, "--set", "training.epochs=100000", *counted,
                          env=env)
    survivor = None
    try:
        wait_for(lambda: claimed() == 1 or victim.poll() is not None)
        assert victim.poll() is None, victim.stderr.read()[-2000:]
        survivor = start_worker(tiny_study, pg_url, 2, "--set", "training.epochs=5", *counted,
                                env=env)
        wait_for(lambda: claimed() == 2 or survivor.poll() is not None)
        assert victim.poll() is None, victim.stderr.read()[-2000:]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # The survivor finishes its own trial, then has nothing to claim (1 finished + 1
        # running = 2): only its reaping while it waits can fail the dead worker's trial.
        assert survivor.wait(timeout=600) == 0, survivor.stderr.read()[-2000:]
    finally:
        for process in (victim, survivor):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    study = optuna.load_study(study_name="tiny", storage=storage)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(failed) == 1
    killed = failed[0]
    retries = [t for t in study.trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(retries) == 1 and retries[0].state in FINISHED
    assert retries[0].params == killed.params
    counts = Counter(t.state for t in study.trials)
    assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 2
    assert counts[TrialState.RUNNING] == counts[TrialState.WAITING] == 0
    storage.engine.dispose()


def test_a_claim_made_while_the_lock_was_lost_is_given_back_if_the_budget_overshoots(
        bare_study, monkeypatch):
    from hpo.search import budget

    study, storage = bare_study

    def lost(connection) -> bool:
        # Meanwhile another worker, which got the lock, claimed and finished the last slot.
        other = study.ask()
        study.tell(other, 0.7)
        return False

    monkeypatch.setattr(budget, "lock_held", lost)
    display = Quiet()
    result = run_worker(study, storage, ending_in(TrialState.COMPLETE), display, Limits(1))
    assert result.ran == 0
    given_back, other = study.trials
    assert (given_back.state, other.state) == (TrialState.FAIL, TrialState.COMPLETE)
    assert "given back to keep the budget exact" in given_back.user_attrs["error"]
    assert "trial 0 given back" in display.messages[0]


def test_a_worker_whose_lock_an_outage_cuts_while_it_counts_takes_the_lock_again(
        pg_url, monkeypatch):
    """An outage (a restart, a failover) that ends the study lock's session between taking
    the lock and counting the study costs the worker that round, not its life."""
    import sqlalchemy
    from postgres import _execute

    from hpo.search import budget

    storage = open_storage(pg_url)
    study = optuna.create_study(study_name="w", storage=storage)
    counted, cut = budget.count_in_database, []

    def count_cut_once(connection, study_id):
        if not cut:
            cut.append(connection.execute(sqlalchemy.text("select pg_backend_pid()")).scalar())
            _execute(pg_url, f"select pg_terminate_backend({cut[0]})")
        return counted(connection, study_id)

    monkeypatch.setattr(budget, "count_in_database", count_cut_once)
    try:
        result = run_worker(study, storage, ending_in(TrialState.COMPLETE), Quiet(), Limits(3))
        assert cut and (result.ran, result.finished) == (3, 3)
    finally:
        storage.engine.dispose()


def test_no_trial_reads_the_test_split(tmp_path, tiny_model, small_data, monkeypatch):
    """Every text the tokenizers of a search see is a training or validation post: the test
    split is left for `hpo final`. The check, the batch probes and the trials all run."""
    import yaml
    from conftest import study_dict
    from transformers import PreTrainedTokenizerBase

    from hpo.data.redsm5 import read_redsm5
    from hpo.data.splits import split_posts

    seen: set[str] = set()
    original = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        seen.update([text] if isinstance(text, str) else list(text or ()))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    config = study_dict([tiny_model], small_data)
    config["data"]["test_fraction"] = 0.2
    study_file = tmp_path / "tiny.yaml"
    study_file.write_text(yaml.safe_dump(config))
    assert main(["run", "--config", str(study_file), "--storage",
                 f"sqlite:///{tmp_path / 'hpo.db'}", "--n-trials", "2"]) == 0

    data = load(study_file).data
    splits = split_posts(read_redsm5(small_data), validation=data.validation_fraction,
                         test=data.test_fraction, seed=data.split_seed)
    assert {p.text for p in splits.train + splits.validation} <= seen  # the spy saw them
    assert not {p.text for p in splits.test} & seen
