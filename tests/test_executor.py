"""One trial from parameters to result, and the one place where exceptions become trial
states: out of memory, a non-finite loss and the pruner prune; anything else fails the trial
alone. Real training of tiny models; OOMs injected (HPO_FAULT_*)."""

import math
from collections import defaultdict

import optuna
import pytest
from optuna.trial import TrialState

from hpo.cli import main


def run(study_file, storage, n, *extra) -> int:
    return main(["run", "--config", str(study_file), "--storage", storage,
                 "--n-trials", str(n), *extra])


def trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name="tiny", storage=storage)
    return sorted(study.trials, key=lambda t: t.number)


@pytest.fixture
def storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'hpo.db'}"


def test_oom_above_batch_gives_physical_batch_four_and_a_cached_search(
    tiny_study, storage, monkeypatch
):
    monkeypatch.setenv("HPO_FAULT_OOM_ABOVE_BATCH", "5")
    assert run(tiny_study, storage, 6) == 0
    probes = defaultdict(list)
    for trial in trials(storage):
        assert trial.state == TrialState.COMPLETE
        assert trial.user_attrs["physical_batch_size"] == 4
        assert trial.user_attrs["effective_batch_size"] == (
            trial.params["target_effective_batch_size"])
        assert trial.user_attrs["grad_accum_steps"] == math.ceil(
            trial.params["target_effective_batch_size"] / 4)
        probes[trial.params["model_name"]].append(trial.user_attrs["batch_probes"])
    assert probes, "no trial ran"
    for model_probes in probes.values():
        assert 1 <= model_probes[0] <= 9
        assert all(p == 0 for p in model_probes[1:])


def test_oom_in_training_prunes_the_trial_and_lowers_the_cached_batch(
    tiny_study, storage, monkeypatch
):
    monkeypatch.setenv("HPO_FAULT_OOM_AT_STEP", "2")
    assert run(tiny_study, storage, 4) == 0
    ended = trials(storage)
    assert len(ended) == 4
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
    import hpo.train

    original = hpo.train.micro_batch_loss
    monkeypatch.setattr(hpo.train, "micro_batch_loss",
                        lambda *a, **k: original(*a, **k) * math.nan)
    # Past the check, which would find every combination unusable and stop the worker.
    assert run(tiny_study, storage, 2, "--skip-check") == 0
    for trial in trials(storage):
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "nan_loss"
        assert trial.user_attrs["error"].startswith("loss nan at epoch 1, step 1")


def test_a_compile_failure_trains_the_trial_eagerly_with_a_warning(
        one_model_study, storage, monkeypatch, capsys):
    monkeypatch.setenv("HPO_FAULT_COMPILE", "backward")
    assert run(one_model_study, storage, 1, "--set", "training.compile=true") == 0
    (trial,) = trials(storage)
    assert trial.state == TrialState.COMPLETE
    assert trial.user_attrs["compiled"] is False
    assert "HPO_FAULT_COMPILE=backward" in trial.user_attrs["compile_error"]
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if "torch.compile failed" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "hpo: warning: trial 0: torch.compile failed, so the trial trains without it")


def test_pruner_verdict_prunes_with_reason(tiny_study, storage, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    assert run(tiny_study, storage, 2, "--set", "training.epochs=3") == 0
    for trial in trials(storage):
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "pruner"
        assert list(trial.intermediate_values) == [1]


def test_the_last_epoch_is_never_pruned(tiny_study, storage, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    assert run(tiny_study, storage, 1, "--set", "training.epochs=1") == 0
    (trial,) = trials(storage)
    assert trial.state == TrialState.COMPLETE and list(trial.intermediate_values) == [1]


def test_other_errors_fail_the_trial_with_the_error_recorded(tiny_study, storage, monkeypatch,
                                                             capsys):
    import hpo.executor

    def broken(*args, **kwargs):
        raise ValueError("broken collate")

    monkeypatch.setattr(hpo.executor, "train", broken)
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


@pytest.mark.parametrize("rule", ["best", "last"])
def test_a_trials_value_is_its_best_or_last_epoch_and_the_pruner_sees_the_same(
    tiny_study, storage, rule
):
    assert run(tiny_study, storage, 3, "--set", "training.epochs=4", "--set",
               "study.pruner.name=none", "--set", f"study.objective_epoch={rule}") == 0
    for trial in trials(storage):
        scores = trial.user_attrs["epoch_scores"]
        assert len(scores) == 4
        reported = [trial.intermediate_values[epoch] for epoch in range(1, 5)]
        if rule == "best":
            chosen = scores.index(max(scores))
            assert reported == pytest.approx([max(scores[:i]) for i in range(1, 5)], abs=1e-4)
        else:
            chosen = 3
            assert reported == pytest.approx(scores, abs=1e-4)
        assert trial.user_attrs["value_epoch"] == chosen + 1
        assert trial.value == pytest.approx(scores[chosen], abs=1e-4)
        assert trial.user_attrs["macro_f1"] == pytest.approx(scores[chosen], abs=1e-4)


def test_every_trial_releases_memory_after_it_ends(tiny_study, storage, monkeypatch):
    import sys

    from hpo import executor

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
    it and queues its retry copy, as worker.reap does with a trial whose heartbeats stopped;
    with `claimed_by_another`, that worker then also claims and finishes the copy."""
    from hpo import report
    from hpo.storage import open_storage

    epoch = report.ConsoleReporter.epoch
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

    monkeypatch.setattr(report.ConsoleReporter, "epoch", reaped_meanwhile)


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


def test_cross_validation_scores_each_fold_and_searches_the_batch_once(
        one_model_study, storage, monkeypatch):
    import hpo.executor

    searches = []
    original = hpo.executor._find_batch
    monkeypatch.setattr(hpo.executor, "_find_batch",
                        lambda *a, **k: searches.append(1) or original(*a, **k))
    assert run(one_model_study, storage, 2, "--set", "data.cv_folds=3") == 0
    ended = trials(storage)
    assert len(searches) == len(ended) == 2  # once per trial, not once per fold
    for trial in ended:
        assert trial.state == TrialState.COMPLETE
        folds = trial.user_attrs["fold_scores"]
        assert len(folds) == 3
        assert trial.value == pytest.approx(sum(folds) / 3, abs=1e-4)
        assert list(trial.intermediate_values) == [1, 2, 3]
        assert trial.intermediate_values[3] == pytest.approx(trial.value)
        assert len(trial.user_attrs["fold_value_epochs"]) == 3


def test_a_cross_validated_trial_is_pruned_after_its_first_fold(one_model_study, storage,
                                                                monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    assert run(one_model_study, storage, 1, "--set", "data.cv_folds=3") == 0
    (trial,) = trials(storage)
    assert trial.state == TrialState.PRUNED and trial.user_attrs["prune_reason"] == "pruner"
    assert list(trial.intermediate_values) == [1]
    assert len(trial.user_attrs["fold_scores"]) == 1
