"""The training drivers: a trial's value from its best or last epoch, the pruner asked after
each epoch but the last, K folds with one batch search, a compiler failure trained eagerly
(real training of tiny models through `hpo run`); the best epoch's weights, the scorer and a
pause kept as a checkpoint (in milliseconds, on fakes)."""

import optuna
import pytest
from conftest import Quiet
from conftest import run_in_process as run
from conftest import trials_of as trials
from optuna.trial import TrialState

from hpo.training.train import PauseHere, Progress, TrainState


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


def test_a_trials_value_and_its_records_come_from_its_best_epoch(tiny_study, storage):
    """The whole path once (the rule and the pruner's view: the unit tests below)."""
    assert run(tiny_study, storage, 1, "--set", "training.epochs=3", "--set",
               "study.pruner.name=none", "--set", "study.objective_epoch=best") == 0
    (trial,) = trials(storage)
    scores = trial.user_attrs["epoch_scores"]
    chosen = scores.index(max(scores))
    assert len(scores) == 3 and trial.user_attrs["value_epoch"] == chosen + 1
    assert trial.value == pytest.approx(scores[chosen], abs=1e-4)
    assert trial.user_attrs["macro_f1"] == pytest.approx(scores[chosen], abs=1e-4)
    assert trial.intermediate_values[3] == pytest.approx(max(scores), abs=1e-4)


def test_cross_validation_scores_each_fold_and_searches_the_batch_once(
        one_model_study, storage, monkeypatch):
    import hpo.trial.batch_limit

    searches = []
    original = hpo.trial.batch_limit._find_batch
    monkeypatch.setattr(hpo.trial.batch_limit, "_find_batch",
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


def _linear(weight: float):
    import torch

    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(weight)
    return model


def test_best_epoch_puts_the_best_epochs_weights_back():
    from hpo.trial.drivers import BestEpoch

    model = _linear(1.0)
    best = BestEpoch(model, "best", evaluations=3)
    best.after_evaluation(1, [0.5])  # the best so far: copied
    model.weight.data.fill_(2.0)
    best.after_evaluation(2, [0.5, 0.4])  # worse: not copied
    model.weight.data.fill_(3.0)
    best.after_evaluation(3, [0.5, 0.4, 0.3])  # the last: the model's own, never copied
    assert best.restore([0.5, 0.4, 0.3]) == 0
    assert model.weight.item() == 1.0


def test_best_epoch_keeps_the_last_epochs_weights_when_they_are_the_value():
    from hpo.trial.drivers import BestEpoch

    for rule, values in (("best", [0.3, 0.5]), ("last", [0.5, 0.3])):
        model = _linear(1.0)
        best = BestEpoch(model, rule, evaluations=2)
        best.after_evaluation(1, values[:1])
        model.weight.data.fill_(2.0)
        best.after_evaluation(2, values)
        assert best.restore(values) == 1 and model.weight.item() == 2.0


def test_weights_that_could_not_rank_among_the_kept_models_are_not_copied(monkeypatch):
    import torch

    from hpo.trial.drivers import BestEpoch

    copies = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(1) or
                        real(self, *a, **k))
    model = _linear(1.0)
    best = BestEpoch(model, "best", evaluations=3, floor=0.6)
    best.after_evaluation(1, [0.5])  # the best so far, yet below the floor: not copied
    model.weight.data.fill_(2.0)
    best.after_evaluation(2, [0.5, 0.7])  # above it: copied
    model.weight.data.fill_(3.0)
    best.after_evaluation(3, [0.5, 0.7, 0.4])
    assert len(copies) == 1
    assert best.restore([0.5, 0.7, 0.4]) == 1 and model.weight.item() == 2.0
    # A run whose chosen evaluation stayed under the floor holds no weights of it: None.
    model = _linear(1.0)
    best = BestEpoch(model, "best", evaluations=2, floor=0.6)
    best.after_evaluation(1, [0.5])
    best.after_evaluation(2, [0.5, 0.4])
    assert best.restore([0.5, 0.4]) is None


def test_the_floor_is_the_kth_best_completed_value_ties_to_the_earlier():
    import math

    from optuna.trial import TrialState

    from hpo.search.artifacts import floor

    study = optuna.create_study(direction="maximize")
    assert floor(study, 1) == -math.inf
    for value in (0.3, 0.5, 0.4):
        study.tell(study.ask(), value)
    study.tell(study.ask(), state=TrialState.PRUNED)
    assert floor(study, 1) == 0.5 and floor(study, 2) == 0.4 and floor(study, 3) == 0.3
    assert floor(study, 4) == -math.inf


def test_the_scorer_scores_at_threshold_one_half_and_returns_the_objective(monkeypatch):
    from types import SimpleNamespace

    import torch

    from hpo.trial import drivers

    probabilities = torch.tensor([[0.9, 0.1], [0.6, 0.7], [0.2, 0.4]])
    monkeypatch.setattr(drivers, "predict", lambda *_args: probabilities)
    resources = SimpleNamespace(label_names=("a", "b"), device=None,
                                config=SimpleNamespace(study=SimpleNamespace(
                                    objective="micro_f1")))
    plan = SimpleNamespace(eval_batch=4, precision="none")
    gold = torch.tensor([[1, 0], [1, 0], [0, 1]])
    into: list = []
    evaluate = drivers.scorer(resources, plan, None, gold, 0, into)
    value = evaluate(torch.nn.Identity())
    # Predicted a; a and b; nothing, for a, a, b: a's F1 is 1, b's 0 (a false positive, a miss)
    assert len(into) == 1 and into[0].per_label == {"a": 1.0, "b": 0.0}
    assert value == into[0].micro_f1 == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))


def _fake_fit(values: list[float]):
    """A `drivers.fit` whose epochs score `values`, with no model trained."""
    from hpo.training import metrics

    def fit(job, _resources, listener):
        from hpo.trial.drivers import Checkpoint, FitPaused

        for epoch, value in enumerate(values, 1):
            job.scores.append(metrics.Scores(value, value, {}))
            try:
                listener.evaluated(epoch, value)
            except PauseHere:  # as `fit` answers a pause: with where the run stands
                raise FitPaused(Checkpoint(TrainState(epoch, epoch, epoch + 1, 0, 8, {}, {},
                                                      {}, {}, {}, Progress()),
                                           list(job.scores), {}, None)) from None
        return None, len(values)

    return fit


def _trial_run(monkeypatch, values: list[float], rule: str, pause: bool = False,
               checkpoints=None, study=None):
    """train_trial over fake epochs scoring `values`, on an in-memory study (a new one, or
    `study`'s first trial again); with `pause`, a study that pauses trials, their checkpoints
    in the store `checkpoints`."""
    from types import SimpleNamespace

    import torch

    from hpo.search.liveness import LiveTrial
    from hpo.trial import drivers
    from hpo.trial.batch_limit import StudyBatchCache
    from hpo.trial.context import TrialContext
    from hpo.trial.run import TrialRun

    monkeypatch.setattr(drivers, "fit", _fake_fit(values))
    trial = None if study is None else optuna.trial.Trial(study, study.trials[0]._trial_id)
    study = study or optuna.create_study(direction="maximize")
    said = Quiet()
    context = TrialContext(study, LiveTrial(trial or study.ask()), StudyBatchCache(study),
                           said)
    resources = SimpleNamespace(
        config=SimpleNamespace(study=SimpleNamespace(
            objective="macro_f1", objective_epoch=rule, pruner=SimpleNamespace(pause=pause))),
        keeper=None, checkpoints=checkpoints, models=None,
        device=SimpleNamespace(type="cpu", torch_device=torch.device("cpu")),
        label_names=("a",),
        gold=lambda: torch.zeros((1, 1), dtype=torch.bool))
    planned = SimpleNamespace(plan=SimpleNamespace(epochs=len(values), evaluations=len(values),
                                                  evaluations_per_epoch=1), pad_id=0,
                              params=SimpleNamespace(model_name="m"), training=None,
                              train_data=None, validation_data=None)
    try:
        trained = drivers.train_trial(TrialRun(context, planned, resources))
    except drivers.TrialPaused:
        return None, study, said
    return trained, study, said


@pytest.mark.parametrize(("rule", "seen", "value"), [
    ("best", [0.3, 0.6, 0.6, 0.6], 0.6),
    ("last", [0.3, 0.6, 0.5, 0.4], 0.4),
])
def test_the_pruner_sees_each_epoch_what_the_trials_value_would_be(monkeypatch, rule, seen,
                                                                    value):
    trained, study, said = _trial_run(monkeypatch, [0.3, 0.6, 0.5, 0.4], rule)
    assert trained.value == value
    (trial,) = study.get_trials(deepcopy=False)
    assert [trial.intermediate_values[e] for e in (1, 2, 3, 4)] == seen
    assert [score for _, _, score in said.epochs] == [0.3, 0.6, 0.5, 0.4]


def test_the_pruner_stops_a_trial_after_any_epoch_but_its_last(monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    with pytest.raises(optuna.TrialPruned, match="pruned at epoch 1"):
        _trial_run(monkeypatch, [0.3, 0.6], "best")
    trained, study, _ = _trial_run(monkeypatch, [0.3], "best")  # its last epoch: kept
    assert trained.value == 0.3


def test_a_pausing_study_keeps_the_checkpoint_where_the_pruner_would_stop(monkeypatch,
                                                                          tmp_path):
    from hpo.search import pausing

    store = optuna.artifacts.FileSystemArtifactStore(str(tmp_path))
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    trained, study, _ = _trial_run(monkeypatch, [0.3, 0.6], "best", pause=True,
                                   checkpoints=store)
    assert trained is None  # paused, not pruned: the trial is not told
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == optuna.trial.TrialState.RUNNING
    checkpoint = trial.user_attrs[pausing.CHECKPOINT]
    assert checkpoint["step"] == 1 and trial.user_attrs[pausing.PAUSES] == [1]
    assert not pausing.is_paused(trial)  # marked paused by the worker, its heartbeat stopped
    kept = pausing.load(store, checkpoint["id"], "cpu")
    assert [s.macro_f1 for s in kept.scores] == [0.3] and kept.train.epoch == 2


def test_a_resumed_run_that_lost_its_claim_writes_nothing_more(monkeypatch, tmp_path):
    from hpo.outcome import Reaped
    from hpo.search import pausing

    store = optuna.artifacts.FileSystemArtifactStore(str(tmp_path))
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    _, study, _ = _trial_run(monkeypatch, [0.3, 0.6], "best", pause=True, checkpoints=store)
    (paused,) = study.get_trials(deepcopy=False)
    # Resumed under a claim that a reaper's repause and another worker's claim replaced.
    study._storage.set_trial_user_attr(paused._trial_id, pausing.CLAIM, "another worker's")
    monkeypatch.setattr(drivers_module(), "resumed", lambda run: (
        pausing.load(store, paused.user_attrs[pausing.CHECKPOINT]["id"], "cpu"), "mine", 0))
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: False)
    with pytest.raises(Reaped, match="trial 0 was put back to paused while this run resumed"):
        _trial_run(monkeypatch, [0.3, 0.6], "best", pause=True, checkpoints=store,
                   study=study)
    assert study.get_trials(deepcopy=False)[0].intermediate_values == {1: 0.3}


def drivers_module():
    from hpo.trial import drivers

    return drivers
