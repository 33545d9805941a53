"""The training drivers of a planned trial: one model (`train_trial`), or one per fold of
`data.cv_folds` (`train_folds`), reporting to the pruner as they go. Both score the
validation split with `scorer`; `train_trial` and `hpo final` keep the weights of the epoch
the trial's value comes from with `BestEpoch`.

A driver writes to the trial through `liveness.write_kept`, and so through a `LiveTrial`:
a trial reaped while it ran goes on as its retry copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import optuna
import torch

from hpo import adapters, memory, metrics, records
from hpo.data.batching import Encoded
from hpo.liveness import LiveTrial, Lock, write_kept
from hpo.planning import TrialPlan
from hpo.resources import Resources
from hpo.train import Plan, Progress, loss_pos_weight, predict, prepare, train


class Reporter(Protocol):
    def step(self, number: int, progress: Progress, epochs: int) -> None: ...
    def epoch(self, number: int, epoch: int, epochs: int, score: float) -> None: ...
    def warning(self, text: str) -> None: ...
    def message(self, text: str) -> None: ...


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
    """The weights of the epoch a run's value comes from (`study.objective_epoch`), copied
    to the host after each epoch that is the chosen one so far, unless it is the last: the
    last epoch's weights are the model's own when training ends."""

    def __init__(self, model: torch.nn.Module, rule: str, epochs: int) -> None:
        self._model, self._rule, self._epochs = model, rule, epochs
        self._state: dict[str, torch.Tensor] = {}

    def after_epoch(self, epoch: int, values: list[float]) -> None:
        if (self._rule == "best" and epoch < self._epochs
                and metrics.chosen_epoch(values, self._rule) == epoch - 1):
            self._state = {k: v.detach().to("cpu", copy=True)
                           for k, v in self._model.state_dict().items()}

    def restore(self, values: list[float]) -> int:
        """Put the chosen epoch's weights back into the model; returns its index."""
        chosen = metrics.chosen_epoch(values, self._rule)
        if chosen < len(values) - 1:
            self._model.load_state_dict(self._state)
        return chosen


def train_trial(live: LiveTrial, planned: TrialPlan, resources: Resources, reporter: Reporter,
                lock: Lock = contextlib.nullcontext) -> float:
    """Train the planned trial, reporting each epoch's value for pruning; returns its value:
    the best or the last epoch's score (`study.objective_epoch`). The pruner sees the same
    rule applied to the epochs so far, so it compares what the trial's value would be. The
    model of the value's epoch is kept if it ranks in the study's best (`study.keep_best`)."""
    plan, device = planned.plan, resources.device
    began = time.perf_counter()
    base = adapters.build(resources.models, planned.params.model_name,
                          planned.train_data.labels.shape[1], planned.training, plan.precision)
    model = prepare(base, plan, device)
    records.record_model(live.trial, base, device.type, time.perf_counter() - began)
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    scores: list[metrics.Scores] = []
    evaluate = scorer(resources, plan, planned.validation_data, resources.gold(),
                      planned.pad_id, scores)
    keeper = resources.keeper
    best = BestEpoch(base, rule, plan.epochs) if keeper is not None else None
    progress: Progress | None = None

    def values() -> list[float]:
        return [s.get(objective) for s in scores]

    def value() -> float:
        return values()[metrics.chosen_epoch(values(), rule)]

    def on_epoch(epoch: int, score: float) -> None:
        reporter.epoch(live.trial.number, epoch, plan.epochs, score)
        if best is not None:
            best.after_epoch(epoch, values())
        write_kept(live, lambda trial: trial.report(value(), epoch), lock)
        # After the last epoch the compute is spent: the result is kept, not pruned.
        if epoch < plan.epochs and live.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def on_step(latest: Progress) -> None:
        nonlocal progress
        progress = latest
        reporter.step(live.trial.number, latest, plan.epochs)

    warned = records.warn_eager(live.trial.number, model, reporter, None)
    try:
        train(model, planned.train_data, plan, device, pad_id=planned.pad_id,
              evaluate=evaluate, on_epoch=on_epoch, on_step=on_step,
              pos_weight=loss_pos_weight(planned.training.pos_weight,
                                         planned.train_data.labels))
    finally:
        records.warn_eager(live.trial.number, model, reporter, warned)
        write_kept(live, lambda trial: records.record_progress(trial, progress, scores,
                                                               objective, rule, model), lock)
    if best is not None and keeper is not None:
        chosen = best.restore(values())
        records.keep(live.trial, planned, resources, keeper, base, value(), chosen + 1,
                     reporter, lock)
    return value()


def train_folds(live: LiveTrial, planned: TrialPlan, resources: Resources, reporter: Reporter,
                lock: Lock = contextlib.nullcontext) -> float:
    """Train the planned trial once per fold of `data.cv_folds` (one batch search for all,
    done in planning); returns the mean of the folds' scores, each its best or last epoch's
    (`study.objective_epoch`). The mean so far is reported after each fold, so the pruner
    can stop a poor configuration after its first folds."""
    plan, device = planned.plan, resources.device
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    k = resources.config.data.cv_folds
    fold_scores: list[float] = []
    fold_epochs: list[int] = []
    progress: Progress | None = None
    seconds = 0.0
    compile_failure: str | None = None

    def on_step(latest: Progress) -> None:
        nonlocal progress
        progress = latest
        reporter.step(live.trial.number, latest, plan.epochs)

    def record(trial: optuna.Trial) -> None:
        trial.set_user_attr("fold_scores", [round(v, 4) for v in fold_scores])
        trial.set_user_attr("fold_value_epochs", fold_epochs)
        trial.set_user_attr("train_seconds", round(seconds, 3))
        if progress is not None:  # of the last fold
            records.record_speed(trial, progress)
        if plan.compile:
            records.record_compiled(trial, compile_failure)

    try:
        for index, fold in enumerate(resources.folds(planned.params.model_name), 1):
            began = time.perf_counter()
            base = adapters.build(resources.models, planned.params.model_name,
                                  fold.train.labels.shape[1], planned.training, plan.precision)
            model = prepare(base, plan, device)
            if index == 1:  # the first fold's, as every fold builds the same model
                records.record_model(live.trial, base, device.type,
                                     time.perf_counter() - began)
            scores: list[metrics.Scores] = []
            train(model, fold.train, plan, device, pad_id=planned.pad_id,
                  evaluate=scorer(resources, plan, fold.validation, fold.gold, planned.pad_id,
                                  scores),
                  on_epoch=lambda epoch, score: reporter.epoch(live.trial.number, epoch,
                                                               plan.epochs, score),
                  on_step=on_step,
                  pos_weight=loss_pos_weight(planned.training.pos_weight, fold.train.labels))
            compile_failure = compile_failure or records.warn_eager(
                live.trial.number, model, reporter, compile_failure)
            seconds += progress.train_seconds if progress is not None else 0.0
            del model, base
            memory.release_memory()
            values = [s.get(objective) for s in scores]
            fold_epochs.append(metrics.chosen_epoch(values, rule) + 1)
            fold_scores.append(values[fold_epochs[-1] - 1])
            mean = sum(fold_scores) / len(fold_scores)
            reporter.message(f"  trial {live.trial.number} fold {index}/{k}: score "
                             f"{fold_scores[-1]:.4f} (mean so far {mean:.4f})")
            write_kept(live, lambda trial, mean=mean, step=index: trial.report(mean, step),
                       lock)
            # After the last fold the compute is spent: the result is kept, not pruned.
            if index < k and live.trial.should_prune():
                raise optuna.TrialPruned(f"pruned after fold {index}")
    finally:
        write_kept(live, record, lock)
    return sum(fold_scores) / len(fold_scores)
