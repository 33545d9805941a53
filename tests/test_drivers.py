"""The training drivers: a trial's value from its best or last epoch, the pruner asked after
each epoch but the last, K folds with one batch search, a compiler failure trained eagerly.
Real training of tiny models through `hpo run`."""

import optuna
import pytest
from conftest import run_in_process as run
from conftest import trials_of as trials
from optuna.trial import TrialState


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


def test_the_last_epoch_is_never_pruned(tiny_study, storage, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    assert run(tiny_study, storage, 1, "--set", "training.epochs=1") == 0
    (trial,) = trials(storage)
    assert trial.state == TrialState.COMPLETE and list(trial.intermediate_values) == [1]


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


def test_cross_validation_scores_each_fold_and_searches_the_batch_once(
        one_model_study, storage, monkeypatch):
    import hpo.planning

    searches = []
    original = hpo.planning._find_batch
    monkeypatch.setattr(hpo.planning, "_find_batch",
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
