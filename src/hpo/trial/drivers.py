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


def fit(models: ModelStore, model_name: str, training: TrainingConfig, plan: Plan,
        resources: Resources, data: Encoded, pad_id: int,
        evaluate: Callable[[torch.nn.Module], float], scores: list[metrics.Scores], *,
        snapshot: float | None, on_evaluation: Callable[[int, float], None],
        on_step: Callable[[Progress], None],
        on_built: Callable[[torch.nn.Module, torch.nn.Module, float], None] | None = None,
        ) -> tuple[torch.nn.Module | None, int]:
    """Train a fresh `model_name` from `models` on `data`, calling `evaluate` (which appends
    to `scores`) at each evaluation (each epoch's end, more under evaluations_per_epoch).
    `on_built` hears the built model, the one prepared for the device (compiled, perhaps)
    and the seconds both took. Returns the built model and the evaluation (1-based) whose
    weights it holds: with a `snapshot` floor, the one the study's rule (`study.objective_
    epoch`) chooses by `scores` (the model None where that one's score did not beat the
    floor: `BestEpoch`), else (None) the last."""
    began = time.perf_counter()
    base = adapters.build(models, model_name, data.labels.shape[1], training, plan.precision)
    model = prepare(base, plan, resources.device)
    if on_built is not None:
        on_built(base, model, time.perf_counter() - began)
    objective = resources.config.study.objective
    best = (BestEpoch(base, resources.config.study.objective_epoch, plan.evaluations,
                      snapshot) if snapshot is not None else None)

    def evaluated(index: int, score: float) -> None:
        if best is not None:
            best.after_evaluation(index, [s.get(objective) for s in scores])
        on_evaluation(index, score)

    train(model, data, plan, resources.device, pad_id=pad_id, evaluate=evaluate,
          on_evaluation=evaluated, on_step=on_step,
          pos_weight=loss_pos_weight(training.pos_weight, data.labels))
    del model
    if best is None:
        return base, plan.evaluations
    values = [s.get(objective) for s in scores]
    held = best.restore(values)
    if held is None:
        return None, metrics.chosen_epoch(values, resources.config.study.objective_epoch) + 1
    return base, held + 1


def train_trial(context: TrialContext, planned: PlannedTrial, resources: Resources) -> Trained:
    """Train the planned trial, reporting each epoch's value for pruning; its value is the
    best or the last epoch's score (`study.objective_epoch`). The pruner sees the same rule
    applied to the epochs so far, so it compares what the trial's value would be. Where the
    study keeps its best models, the model returned holds the value epoch's weights."""
    plan, reporter = planned.plan, context.reporter
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    scores: list[metrics.Scores] = []
    # Read once: the bar only rises as other trials finish, so a stale one copies more
    # weights than needed, never fewer.
    floor = (artifacts.floor(context.study, resources.keeper.best)
             if resources.keeper is not None else None)
    evaluate = scorer(resources, plan, planned.validation_data, resources.gold(),
                      planned.pad_id, scores)
    prepared: list[torch.nn.Module] = []  # for the compiler's failure, once built
    progress: Progress | None = None
    warned: str | None = None

    def value() -> float:
        values = [s.get(objective) for s in scores]
        return values[metrics.chosen_epoch(values, rule)]

    def on_built(base: torch.nn.Module, model: torch.nn.Module, seconds: float) -> None:
        nonlocal warned
        # Recorded first: a trial reaped while it was built fails here, before any record of
        # its progress would carry it over to a retry copy it then leaves unfinished.
        records.record_model(context.trial, base, resources.device.type, seconds)
        prepared.append(model)
        warned = records.warn_eager(context.trial.number, model, reporter, None)

    def on_evaluation(index: int, score: float) -> None:
        epoch = as_epochs(index, plan.evaluations_per_epoch)
        reporter.epoch(context.trial.number, epoch, plan.epochs, score)
        context.write(lambda trial: trial.report(value(), index))
        # After the last evaluation the compute is spent: the result is kept, not pruned.
        if index < plan.evaluations and context.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def on_step(latest: Progress) -> None:
        nonlocal progress
        progress = latest
        reporter.step(context.trial.number, latest, plan.epochs)

    try:
        model, epoch = fit(resources.models, planned.params.model_name, planned.training,
                           plan, resources, planned.train_data, planned.pad_id, evaluate,
                           scores, snapshot=floor,
                           on_evaluation=on_evaluation, on_step=on_step, on_built=on_built)
    finally:
        if prepared:
            records.warn_eager(context.trial.number, prepared[0], reporter, warned)
            context.write(lambda trial: records.record_progress(
                trial, progress, scores, objective, rule, prepared[0],
                per_epoch=plan.evaluations_per_epoch))
    return Trained(value(), model, as_epochs(epoch, plan.evaluations_per_epoch))


def _report(trial: optuna.Trial, value: float, step: int) -> None:
    trial.report(value, step)


def train_folds(context: TrialContext, planned: PlannedTrial, resources: Resources) -> Trained:
    """Train the planned trial once per fold of `data.cv_folds` (one batch search for all,
    done in planning); its value is the mean of the folds' scores, each its best or last
    epoch's (`study.objective_epoch`). The mean so far is reported after each fold, so the
    pruner can stop a poor configuration after its first folds. No model is returned: none
    of the folds' is the trial's."""
    plan, device, reporter = planned.plan, resources.device, context.reporter
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    k = resources.config.data.cv_folds
    assert k is not None  # the executor runs this driver only with folds
    fold_scores: list[float] = []
    fold_epochs: list[int] = []
    progress: Progress | None = None
    seconds = 0.0
    compile_failure: str | None = None

    def on_step(latest: Progress) -> None:
        nonlocal progress
        progress = latest
        reporter.step(context.trial.number, latest, plan.epochs)

    try:
        for index, fold in enumerate(resources.folds(planned.params.model_name), 1):
            scores: list[metrics.Scores] = []
            built: list[torch.nn.Module] = []

            def on_built(base: torch.nn.Module, model: torch.nn.Module, took: float,
                         first: bool = index == 1, built: list = built) -> None:
                if first:  # the first fold's, as every fold builds the same model
                    records.record_model(context.trial, base, device.type, took)
                built.append(model)

            fit(resources.models, planned.params.model_name, planned.training, plan, resources,
                fold.train, planned.pad_id,
                scorer(resources, plan, fold.validation, fold.gold, planned.pad_id, scores),
                scores, snapshot=None,
                on_evaluation=lambda epoch, score: reporter.epoch(context.trial.number, epoch,
                                                                  plan.epochs, score),
                on_step=on_step, on_built=on_built)
            compile_failure = compile_failure or records.warn_eager(
                context.trial.number, built[0], reporter, compile_failure)
            seconds += progress.train_seconds if progress is not None else 0.0
            built.clear()  # the fold's model, let go before the next is built
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
        context.write(lambda trial: records.record_folds(
            trial, fold_scores, fold_epochs, seconds, progress, compile_failure, plan.compile))
    return Trained(sum(fold_scores) / len(fold_scores))
