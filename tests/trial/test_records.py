"""What a trial records beside its value, written in one module: its plan, how it ended,
an interruption, a cross-validated trial's folds. On an in-memory study, in milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
from optuna.trial import TrialState

from hpo.outcome import Outcome
from hpo.training.memory import DeviceMemory
from hpo.trial import records
from hpo.trial.batch_limit import BatchLimit


def _trial() -> tuple[optuna.Study, optuna.Trial]:
    study = optuna.create_study()
    return study, study.ask()


def test_how_a_trial_ended_is_recorded_beside_its_state():
    study, trial = _trial()
    outcome = Outcome(TrialState.PRUNED, prune_reason="oom", error="CUDA out of memory")
    records.record_end(trial, outcome, lowered=BatchLimit(4, 8), failed_at="Traceback ...",
                       device_memory=DeviceMemory(100.0, 2048.04, None), started=0.0)
    attrs = study.trials[0].user_attrs
    assert attrs["prune_reason"] == "oom" and attrs["error"] == "CUDA out of memory"
    assert attrs["batch_limit_after_oom"] == BatchLimit(4, 8).to_json()
    assert attrs["traceback"] == "Traceback ..."
    assert (attrs["memory_before_mib"], attrs["peak_memory_mib"]) == (100.0, 2048.0)
    assert "memory_after_mib" not in attrs
    assert attrs["trial_seconds"] > 0 and attrs["worker_rss_mb"] > 0


def test_a_completed_trial_records_no_reason_and_no_error():
    study, trial = _trial()
    records.record_end(trial, Outcome(TrialState.COMPLETE, value=0.5))
    assert study.trials[0].user_attrs == {}


def test_an_interrupted_trial_is_told_apart_from_a_given_back_one():
    study, trial = _trial()
    records.record_stopped(trial, "interrupted by SIGTERM", interrupted=True)
    given_back = study.ask()
    records.record_stopped(given_back, "claimed while the study lock was lost",
                           interrupted=False)
    first, second = (t.user_attrs for t in study.trials)
    assert first == {"error": "interrupted by SIGTERM", "interrupted": True}
    assert second == {"error": "claimed while the study lock was lost"}


def test_a_cross_validated_trials_folds_so_far():
    study, trial = _trial()
    folds = records.FoldsSoFar([0.51234, 0.6], [2, 1], 12.34567)
    records.record_folds(trial, folds, compiled=True)
    attrs = study.trials[0].user_attrs
    assert attrs == {"fold_scores": [0.5123, 0.6], "fold_value_epochs": [2, 1],
                     "train_seconds": 12.346, "compiled": True}


def test_a_plans_batches_and_set_up_seconds():
    study, trial = _trial()
    plan = SimpleNamespace(physical_batch=4, grad_accum_steps=4, effective_batch=16,
                           eval_batch=5)
    planned = SimpleNamespace(
        plan=plan, probes=3, train_data=[None] * 40, tokenization="the tokenizer",
        tokenization_seconds=0.12345, batch_search_seconds=1.5, shared_bytes=0,
        training=SimpleNamespace(model_dump=lambda mode: {"epochs": 1}))
    records.record_plan(trial, planned)  # type: ignore[arg-type]
    attrs = study.trials[0].user_attrs
    assert attrs["physical_batch_size"] == 4 and attrs["grad_accum_steps"] == 4
    assert attrs["batch_probes"] == 3 and attrs["samples_dropped_per_epoch"] == 40 % 16
    assert (attrs["tokenization"], attrs["tokenization_seconds"],
            attrs["batch_search_seconds"]) == ("the tokenizer", 0.123, 1.5)
    assert attrs["training"] == {"epochs": 1}
    assert "device_shared_gib" not in attrs  # a device the worker had to itself
    shared, trial = _trial()
    records.record_plan(trial, SimpleNamespace(**{  # type: ignore[arg-type]
        **vars(planned), "shared_bytes": 3 * 2**29}))
    assert shared.trials[0].user_attrs["device_shared_gib"] == 1.5


def test_a_retry_names_the_trial_it_re_runs():
    study, trial = _trial()
    records.record_retry(trial, 3)
    assert study.trials[0].user_attrs == {"retry_of": 3}


def test_a_trials_scores_come_from_the_epoch_its_rule_chooses():
    from hpo.training.metrics import Scores

    scores = [Scores(0.3, 0.4, {"a": 0.3}), Scores(0.6, 0.5, {"a": 0.6}),
              Scores(0.5, 0.7, {"a": 0.5})]
    for rule, epoch in (("best", 2), ("last", 3)):
        study, trial = _trial()
        study_settings = SimpleNamespace(objective="macro_f1", objective_epoch=rule)
        records.record_progress(trial, None, scores, study_settings, None)
        attrs = study.trials[0].user_attrs
        assert attrs["value_epoch"] == epoch and attrs["epoch_scores"] == [0.3, 0.6, 0.5]
        chosen = scores[epoch - 1]
        assert (attrs["macro_f1"], attrs["micro_f1"], attrs["f1_per_symptom"]) == (
            chosen.macro_f1, chosen.micro_f1, chosen.per_label)
