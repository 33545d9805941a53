"""The training drivers of a planned trial: one model (`train_trial`), or one per fold of
`data.cv_folds` (`train_folds`), reporting to the pruner as they go. A driver returns what it
trained (`Trained`); whether the model is kept is the executor's to decide.

`fit` is the one wiring of a model's training, for a trial and for `hpo final`'s runs alike:
built, prepared for the device, trained, scored on the validation split after each epoch
(`scorer`) and, where asked, put back to the weights of the epoch the study's rule chooses
(`BestEpoch`).

A driver writes to the trial through its context (`TrialContext.write`): a trial reaped
while it ran goes on as its retry copy.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import optuna
import torch

from hpo.config import TrainingConfig
from hpo.data.batching import Encoded
from hpo.search import artifacts
from hpo.training import adapters, memory, metrics
from hpo.training.models import ModelStore
from hpo.training.train import Plan, Progress, as_epochs, loss_pos_weight, predict, prepare, train
from hpo.trial import records
from hpo.trial.context import TrialContext
from hpo.trial.planning import PlannedTrial
from hpo.trial.resources import Resources


@dataclass(frozen=True)
class Trained:
    """What a driver trained: the trial's value and, for a single model, the model holding
    the weights of `epoch` (1-based, `as_epochs`): the value's evaluation where `BestEpoch`
    kept it, else the last."""

    value: float
    model: torch.nn.Module | None = None
    epoch: float = 0  # in epochs: 1.5 is the middle of the second under evaluations_per_epoch


def scorer(resources: Resources, plan: Plan, data: Encoded, gold: torch.Tensor, pad_id: int,
           into: list[metrics.Scores]) -> Callable[[torch.nn.Module], float]:
    """Scores a model on `data` as the search scores its trials (in the plan's precision,
    threshold 0.5), appends the scores to `into` and returns the study's objective."""
    names = resources.label_names
    objective = resources.config.study.objective

    def evaluate(model: torch.nn.Module) -> float:
        probabilities = predict(model, data, plan.eval_batch, resources.device, plan.precision,
                                pad_id)
        grid = metrics.as_grid(probabilities > 0.5, len(names))
        into.append(metrics.f1_scores(grid, gold, names))
        return into[-1].get(objective)

    return evaluate


class BestEpoch:
    """The weights of the evaluation a run's value comes from (`study.objective_epoch`),
    copied to the host after each evaluation that is the chosen one so far, unless it is the
    last (the last one's weights are the model's own when training ends) or its score does
    not beat `floor`: a trial of that value could not rank among the models the study keeps,
    and a base model's copy costs a fifth of a second on a host."""

    def __init__(self, model: torch.nn.Module, rule: str, evaluations: int,
                 floor: float = -math.inf) -> None:
        self._model, self._rule, self._evaluations = model, rule, evaluations
        self._floor = floor
        self._state: dict[str, torch.Tensor] = {}
        self._held: int | None = None  # the evaluation (1-based) whose weights _state holds

    def after_evaluation(self, index: int, values: list[float]) -> None:
        if (self._rule == "best" and index < self._evaluations
                and metrics.chosen_epoch(values, self._rule) == index - 1
                and values[index - 1] > self._floor):
            self._state = {k: v.detach().to("cpu", copy=True)
                           for k, v in self._model.state_dict().items()}
            self._held = index

    def restore(self, values: list[float]) -> int | None:
        """Put the chosen evaluation's weights back into the model; returns its index, or
        None where they were not copied (its score did not beat the floor)."""
        chosen = metrics.chosen_epoch(values, self._rule)
        if chosen == len(values) - 1:
            return chosen
        if self._held != chosen + 1:
            return None
        self._model.load_state_dict(self._state)
        return chosen


@dataclass(frozen=True)
class FitJob:
    """What `fit` trains: a fresh `model_name` from `models`, with its settings and plan, on
    `data`; `evaluate` scores a model at each evaluation and appends its scores to `scores`.
    With a `snapshot` floor the model ends on the weights of the evaluation the study's rule
    chooses (`BestEpoch`), else on the last."""

    models: ModelStore
    model_name: str
    training: TrainingConfig
    plan: Plan
    data: Encoded
    pad_id: int
    evaluate: Callable[[torch.nn.Module], float]
    scores: list[metrics.Scores]
    snapshot: float | None = None


class Listener(Protocol):
    """What hears a fit as it goes: the model built (and the one prepared for the device, and
    the seconds both took), each evaluation's score, each step's progress."""

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None: ...
    def evaluated(self, index: int, score: float) -> None: ...
    def stepped(self, progress: Progress) -> None: ...


def fit(job: FitJob, resources: Resources, listener: Listener
        ) -> tuple[torch.nn.Module | None, int]:
    """Train `job`, telling `listener`. Returns the built model and the evaluation (1-based)
    whose weights it holds: with a `snapshot` floor, the one the study's rule (`study.
    objective_epoch`) chooses by the scores (the model None where that one's score did not
    beat the floor: `BestEpoch`), else (None) the last."""
    plan, study = job.plan, resources.config.study
    began = time.perf_counter()
    base = adapters.build(job.models, job.model_name, job.data.labels.shape[1], job.training,
                          plan.precision)
    model = prepare(base, plan, resources.device)
    listener.built(base, model, time.perf_counter() - began)
    best = (BestEpoch(base, study.objective_epoch, plan.evaluations, job.snapshot)
            if job.snapshot is not None else None)

    def evaluated(index: int, score: float) -> None:
        if best is not None:
            best.after_evaluation(index, [s.get(study.objective) for s in job.scores])
        listener.evaluated(index, score)

    train(model, job.data, plan, resources.device, pad_id=job.pad_id, evaluate=job.evaluate,
          on_evaluation=evaluated, on_step=listener.stepped,
          pos_weight=loss_pos_weight(job.training.pos_weight, job.data.labels))
    del model
    if best is None:
        return base, plan.evaluations
    values = [s.get(study.objective) for s in job.scores]
    held = best.restore(values)
    if held is None:
        return None, metrics.chosen_epoch(values, study.objective_epoch) + 1
    return base, held + 1


@dataclass
class _TrialListener:
    """A single-model trial's fit heard: each epoch reported to the pruner (the study's rule
    applied to the epochs so far, so it compares what the trial's value would be) and shown,
    the model's records written once it is built, the last progress kept for the records."""

    context: TrialContext
    plan: Plan
    device_type: str
    scores: list[metrics.Scores]
    objective: str
    rule: str
    prepared: torch.nn.Module | None = None  # for the compiler's failure, once built
    progress: Progress | None = None
    warned: str | None = None

    def value(self) -> float:
        values = [s.get(self.objective) for s in self.scores]
        return values[metrics.chosen_epoch(values, self.rule)]

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None:
        # Recorded first: a trial reaped while it was built fails here, before any record of
        # its progress would carry it over to a retry copy it then leaves unfinished.
        records.record_model(self.context.trial, base, self.device_type, seconds)
        self.prepared = model
        self.warned = records.warn_eager(self.context.trial.number, model,
                                         self.context.reporter, None)

    def evaluated(self, index: int, score: float) -> None:
        context, plan = self.context, self.plan
        epoch = as_epochs(index, plan.evaluations_per_epoch)
        context.reporter.epoch(context.trial.number, epoch, plan.epochs, score)
        value = self.value()
        context.write(lambda trial: trial.report(value, index))
        # After the last evaluation the compute is spent: the result is kept, not pruned.
        if index < plan.evaluations and context.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def stepped(self, progress: Progress) -> None:
        self.progress = progress
        self.context.reporter.step(self.context.trial.number, progress, self.plan.epochs)

    def finished(self) -> None:
        """The records of the training's end, once the model was built: also after a
        pruning or a failure."""
        if self.prepared is None:
            return
        prepared, progress, scores = self.prepared, self.progress, self.scores
        records.warn_eager(self.context.trial.number, prepared, self.context.reporter,
                           self.warned)
        self.context.write(lambda trial: records.record_progress(
            trial, progress, scores, self.objective, self.rule, prepared,
            per_epoch=self.plan.evaluations_per_epoch))


def train_trial(context: TrialContext, planned: PlannedTrial, resources: Resources) -> Trained:
    """Train the planned trial, reporting each epoch's value for pruning; its value is the
    best or the last epoch's score (`study.objective_epoch`). Where the study keeps its best
    models, the model returned holds the value epoch's weights."""
    plan, study = planned.plan, resources.config.study
    scores: list[metrics.Scores] = []
    # Read once: the bar only rises as other trials finish, so a stale one copies more
    # weights than needed, never fewer.
    floor = (artifacts.floor(context.study, resources.keeper.best)
             if resources.keeper is not None else None)
    job = FitJob(resources.models, planned.params.model_name, planned.training, plan,
                 planned.train_data, planned.pad_id,
                 scorer(resources, plan, planned.validation_data, resources.gold(),
                        planned.pad_id, scores), scores, snapshot=floor)
    heard = _TrialListener(context, plan, resources.device.type, scores, study.objective,
                           study.objective_epoch)
    try:
        model, epoch = fit(job, resources, heard)
    finally:
        heard.finished()
    return Trained(heard.value(), model, as_epochs(epoch, plan.evaluations_per_epoch))


def _report(trial: optuna.Trial, value: float, step: int) -> None:
    trial.report(value, step)


@dataclass
class _FoldsListener:
    """A cross-validated trial's folds heard: each fold's epochs and steps shown, the first
    fold's model recorded (every fold builds the same), each fold's prepared model held until
    the fold ends, the last progress kept for the records."""

    context: TrialContext
    plan: Plan
    device_type: str
    fold: int = 0
    prepared: torch.nn.Module | None = None
    progress: Progress | None = None

    def built(self, base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None:
        if self.fold == 1:
            records.record_model(self.context.trial, base, self.device_type, seconds)
        self.prepared = model

    def evaluated(self, index: int, score: float) -> None:
        self.context.reporter.epoch(self.context.trial.number, index, self.plan.epochs, score)

    def stepped(self, progress: Progress) -> None:
        self.progress = progress
        self.context.reporter.step(self.context.trial.number, progress, self.plan.epochs)


def train_folds(context: TrialContext, planned: PlannedTrial, resources: Resources) -> Trained:
    """Train the planned trial once per fold of `data.cv_folds` (one batch search for all,
    done in planning); its value is the mean of the folds' scores, each its best or last
    epoch's (`study.objective_epoch`). The mean so far is reported after each fold, so the
    pruner can stop a poor configuration after its first folds. No model is returned: none
    of the folds' is the trial's."""
    plan, reporter = planned.plan, context.reporter
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    k = resources.config.data.cv_folds
    assert k is not None  # the executor runs this driver only with folds
    fold_scores: list[float] = []
    fold_epochs: list[int] = []
    seconds = 0.0
    compile_failure: str | None = None
    heard = _FoldsListener(context, plan, resources.device.type)
    try:
        for index, fold in enumerate(resources.folds(planned.params.model_name), 1):
            scores: list[metrics.Scores] = []
            heard.fold = index
            fit(FitJob(resources.models, planned.params.model_name, planned.training, plan,
                       fold.train, planned.pad_id,
                       scorer(resources, plan, fold.validation, fold.gold, planned.pad_id,
                              scores), scores), resources, heard)
            assert heard.prepared is not None  # fit tells the listener what it built
            compile_failure = compile_failure or records.warn_eager(
                context.trial.number, heard.prepared, reporter, compile_failure)
            seconds += heard.progress.train_seconds if heard.progress is not None else 0.0
            heard.prepared = None  # the fold's model, let go before the next is built
            memory.release_memory()
            values = [s.get(objective) for s in scores]
            fold_epochs.append(metrics.chosen_epoch(values, rule) + 1)
            fold_scores.append(values[fold_epochs[-1] - 1])
            mean = sum(fold_scores) / len(fold_scores)
            reporter.message(f"  trial {context.trial.number} fold {index}/{k}: score "
                             f"{fold_scores[-1]:.4f} (mean so far {mean:.4f})")
            context.write(functools.partial(_report, value=mean, step=index))
            # After the last fold the compute is spent: the result is kept, not pruned.
            if index < k and context.trial.should_prune():
                raise optuna.TrialPruned(f"pruned after fold {index}")
    finally:
        progress = heard.progress
        context.write(lambda trial: records.record_folds(
            trial, fold_scores, fold_epochs, seconds, progress, compile_failure, plan.compile))
    return Trained(sum(fold_scores) / len(fold_scores))
