"""One trial: parameters -> batch search -> training -> metrics, and what becomes of it.

A trial is planned (its parameters, the physical batch that fits, the derived `Plan`), then
trained. `execute` is the one place where an exception turns into a trial state: a pruner's
verdict, an out-of-memory error or a non-finite loss prune the trial (with `prune_reason`);
anything else fails that trial alone, with the error recorded on it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, TypeVar

import optuna
import psutil
import torch
from optuna.trial import FrozenTrial, TrialState

from hpo import adapters, artifacts, check, export, faults, memory, metrics
from hpo.config import TrainingConfig
from hpo.data.batching import Encoded
from hpo.errors import one_line
from hpo.hardware import Device, fused_adamw, library_versions
from hpo.resources import Resources
from hpo.space import Params, suggest
from hpo.study import StudyBatchCache, carry_over
from hpo.train import (
    CompiledOrEager,
    NonFiniteLoss,
    Plan,
    Progress,
    balanced_pos_weight,
    predict,
    prepare,
    probe_step,
    train,
)

T = TypeVar("T")


class Reporter(Protocol):
    def trial_started(self, number: int, params: Params, plan: Plan, probes: int) -> None: ...
    def step(self, number: int, progress: Progress, epochs: int) -> None: ...
    def epoch(self, number: int, epoch: int, epochs: int, score: float) -> None: ...
    def warning(self, text: str) -> None: ...
    def message(self, text: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    state: TrialState
    value: float | None = None
    prune_reason: str | None = None
    error: str | None = None
    # The trial was reaped while it ran: its result went to its retry copy, which was told
    # in its place (`kept_from` is the reaped trial's number), or, with no copy left to
    # claim, nowhere (`dropped` says why).
    kept_from: int | None = None
    dropped: str | None = None


class Reaped(Exception):
    """The trial was reaped while it ran and no waiting copy was left to carry its result."""


Lock = Callable[[], AbstractContextManager[object]]


def write_kept(trial: optuna.Trial, write: Callable[[], T],
               lock: Lock = contextlib.nullcontext) -> T:
    """Run `write` on the trial; if the trial was reaped while it ran, carry it over to its
    waiting copy (`study.carry_over`, under the study `lock`) and write there, else raise
    Reaped. The copy can be reaped in turn (a long outage again): a few times over."""
    number = trial.number
    for _ in range(3):
        try:
            return write()
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
            # ValueError: study.tell's "Cannot tell a FAIL trial"; the state says which.
            if not trial.storage.get_trial(trial._trial_id).state.is_finished():
                raise
        if carry_over(trial.study, trial, lock) is None:
            break
    raise Reaped(f"trial {number} was reaped while it ran (its heartbeats were lost) and its "
                 f"retry was already claimed by another worker: this run's result is dropped")


@dataclass(frozen=True)
class TrialPlan:
    """A trial before training: its parameters, their training settings, the runtime plan
    and the data it trains on."""

    params: Params
    training: TrainingConfig
    plan: Plan
    batch_key: str  # the batch-size cache entry the physical batch came from
    probes: int
    train_data: Encoded
    validation_data: Encoded
    pad_id: int


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def cache_key(params: Params, training: TrainingConfig, max_length: int, device: Device) -> str:
    return (f"{params.model_name}|{params.fp_precision}|{max_length}|{device.cache_key}"
            f"{adapters.cache_suffix(training, params.fp_precision)}")


# Called with the batch cache key and the micro-batch before each step that may run out of
# memory (each probe, then training): a process killed by the OOM killer cannot say it itself.
Watch = Callable[[str, int], None]


def _unwatched(_key: str, _batch: int) -> None:
    return None


def execute(
    study: optuna.Study, trial: optuna.Trial, resources: Resources, reporter: Reporter,
    cache: StudyBatchCache, watch: Watch = _unwatched,
) -> tuple[Outcome, FrozenTrial]:
    """Run one trial to its end and tell the study how it ended; `cache` is the study's
    batch cache, `watch` hears what the trial is about to try."""
    started = time.perf_counter()
    number = trial.number  # `trial` may be carried over to its retry copy on the way
    planned: TrialPlan | None = None
    failed_at: str | None = None
    try:
        trial.set_user_attr("worker", worker_name())
        trial.set_user_attr("device", resources.device.describe())
        trial.set_user_attr("versions", library_versions())
        planned = plan_trial(trial, resources, cache, watch)
        reporter.trial_started(trial.number, planned.params, planned.plan, planned.probes)
        watch(planned.batch_key, planned.plan.physical_batch)
        run = train_folds if resources.config.data.cv_folds else train_trial
        outcome = Outcome(TrialState.COMPLETE, value=run(trial, planned, resources, reporter,
                                                         cache.lock))
    except optuna.TrialPruned:
        outcome = Outcome(TrialState.PRUNED, prune_reason="pruner")
    except check.Unusable as exc:
        outcome = Outcome(TrialState.PRUNED, prune_reason="unusable", error=str(exc))
    except NonFiniteLoss as exc:
        outcome = Outcome(TrialState.PRUNED, prune_reason="nan_loss", error=str(exc))
    except Reaped as exc:
        outcome = Outcome(TrialState.FAIL, dropped=str(exc))
    except optuna.exceptions.UpdateFinishedTrialError:
        # Reaped before it had a result: its waiting copy is the next worker's to run.
        outcome = Outcome(TrialState.FAIL, dropped=f"trial {number} was reaped while "
                                                   f"it was being set up; its retry is left "
                                                   f"to the next worker")
    except Exception as exc:
        if memory.is_oom(exc):
            outcome = Outcome(TrialState.PRUNED, prune_reason="oom", error=one_line(exc))
        else:
            outcome = Outcome(TrialState.FAIL, error=one_line(exc))
            failed_at = traceback.format_exc()[-4000:]
    # Outside the except block: the traceback no longer holds the failed step's tensors.
    memory.release_memory()
    if outcome.dropped:
        return outcome, trial.storage.get_trial(trial._trial_id)

    def finish() -> FrozenTrial:
        if outcome.prune_reason == "oom" and planned is not None:
            lowered = cache.lower(planned.batch_key, planned.plan.physical_batch)
            trial.set_user_attr("batch_limit_after_oom", lowered.to_json())
        if outcome.prune_reason:
            trial.set_user_attr("prune_reason", outcome.prune_reason)
        if outcome.error:
            trial.set_user_attr("error", outcome.error)
        if failed_at:
            trial.set_user_attr("traceback", failed_at)
        trial.set_user_attr("worker_rss_mb",
                            round(psutil.Process().memory_info().rss / 2**20, 1))
        trial.set_user_attr("trial_seconds", round(time.perf_counter() - started, 3))
        faults.kill_at("tell")
        return study.tell(trial, outcome.value, state=outcome.state)

    try:
        finished = write_kept(trial, finish, cache.lock)
    except Reaped as exc:
        return replace(outcome, dropped=str(exc)), trial.storage.get_trial(trial._trial_id)
    if trial.number != number:
        outcome = replace(outcome, kept_from=number)
    return outcome, finished


def plan_trial(trial: optuna.Trial, resources: Resources, cache: StudyBatchCache,
               watch: Watch = _unwatched) -> TrialPlan:
    """Sample the parameters, find the physical batch that fits and derive the plan; the
    settings are recorded on the trial."""
    config, device = resources.config, resources.device
    params = suggest(trial, resources.pinned)
    training = config.training.model_copy(update=params.extras)
    why = check.unusable(trial.study, device, params.model_name, params.fp_precision,
                         training.peft)
    if why is not None:
        adapter = "" if training.peft == "none" else f" {training.peft}"
        raise check.Unusable(f"{params.model_name} {params.fp_precision}{adapter}: {why} "
                             f"(hpo check)")
    began = time.perf_counter()
    train_data, validation_data, source = resources.encoded(params.model_name)
    trial.set_user_attr("tokenization", source)
    trial.set_user_attr("tokenization_seconds", round(time.perf_counter() - began, 3))
    tokenizer = resources.models.tokenizer(params.model_name)
    plan, key, probes = fit_batch(base_plan(params, training), params, training,
                                  train_data.labels.shape[1], resources, cache, watch)
    trial.set_user_attr("physical_batch_size", plan.physical_batch)
    trial.set_user_attr("grad_accum_steps", plan.grad_accum_steps)
    trial.set_user_attr("effective_batch_size", plan.effective_batch)
    trial.set_user_attr("eval_batch_size", plan.eval_batch)
    trial.set_user_attr("batch_probes", probes)
    trial.set_user_attr("samples_dropped_per_epoch", len(train_data) % plan.effective_batch)
    # The resolved settings beside the result, enough to repeat the run.
    trial.set_user_attr("training", training.model_dump(mode="json"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return TrialPlan(params, training, plan, key, probes, train_data, validation_data, pad_id)


def base_plan(params: Params, training: TrainingConfig) -> Plan:
    """The plan of a configuration, its batches not yet fitted to the device."""
    return Plan(
        precision=params.fp_precision,
        effective_batch=params.target_effective_batch_size,
        physical_batch=1,
        eval_batch=1,
        learning_rate=params.learning_rate,
        weight_decay=training.weight_decay,
        warmup_ratio=training.warmup_ratio,
        max_grad_norm=training.max_grad_norm,
        epochs=training.epochs,
        seed=training.seed,
        gradient_checkpointing=training.gradient_checkpointing,
        compile=training.compile,
    )


def fit_batch(base: Plan, params: Params, training: TrainingConfig, num_labels: int,
              resources: Resources, cache: StudyBatchCache, watch: Watch = _unwatched,
              ) -> tuple[Plan, str, int]:
    """`base` with the physical and evaluation batches that fit this device: the study's
    cached limit for the model and precision, searched (probes > 0) where there is none.
    Returns the plan, the cache key and the number of probes."""
    config, device = resources.config, resources.device
    tokenizer = resources.models.tokenizer(params.model_name)
    key = cache_key(params, training, config.data.max_length, device)
    bound = min(params.target_effective_batch_size, training.max_physical_batch_size)
    build = functools.partial(adapters.build, resources.models, params.model_name, num_labels,
                              training, params.fp_precision)
    probe_length = min(config.data.max_length, tokenizer.model_max_length)
    limit, probes = _find_batch(build, base, device, key, bound, cache, probe_length, watch)
    physical = memory.physical_batch(limit, bound, training.safety_margin)
    plan = replace(
        base, physical_batch=physical, eval_batch=memory.eval_batch(limit, physical, bound)
    )
    return plan, key, probes


def train_trial(
    trial: optuna.Trial, planned: TrialPlan, resources: Resources, reporter: Reporter,
    lock: Lock = contextlib.nullcontext,
) -> float:
    """Train the planned trial, reporting each epoch's value for pruning; returns its value:
    the best or the last epoch's score (`study.objective_epoch`). The pruner sees the same
    rule applied to the epochs so far, so it compares what the trial's value would be."""
    plan, device = planned.plan, resources.device
    base = adapters.build(resources.models, planned.params.model_name,
                          planned.train_data.labels.shape[1], planned.training, plan.precision)
    # What the model and optimizer got, which the family and the device decide: transformers
    # keeps the attention in a private config field (models.py reads it too); the family
    # tests fail if it moves.
    trial.set_user_attr("attention_implementation", base.config._attn_implementation)
    trial.set_user_attr("fused_adamw", fused_adamw(device.type))
    _record_trainable(trial, base)
    model = prepare(base, plan, device)
    gold = resources.gold()
    objective = resources.config.study.objective
    rule = resources.config.study.objective_epoch
    scores: list[metrics.Scores] = []
    progress: Progress | None = None

    def evaluate(m: torch.nn.Module) -> float:
        probabilities = predict(m, planned.validation_data, plan.eval_batch, device,
                                plan.precision, planned.pad_id)
        grid = metrics.as_grid(probabilities > 0.5, len(resources.label_names))
        scores.append(metrics.f1_scores(grid, gold, resources.label_names))
        return scores[-1].get(objective)

    def value() -> float:
        values = [s.get(objective) for s in scores]
        return values[metrics.chosen_epoch(values, rule)]

    keeper = resources.keeper
    # The weights of the value's epoch, if an earlier one than the last, for the keeper.
    value_weights: dict[str, torch.Tensor] = {}

    def on_epoch(epoch: int, score: float) -> None:
        reporter.epoch(trial.number, epoch, plan.epochs, score)
        if keeper is not None and rule == "best" and epoch < plan.epochs and (
                metrics.chosen_epoch([s.get(objective) for s in scores], rule) == epoch - 1):
            value_weights.clear()
            value_weights.update({k: v.detach().to("cpu", copy=True)
                                  for k, v in base.state_dict().items()})
        write_kept(trial, lambda: trial.report(value(), epoch), lock)
        # After the last epoch the compute is spent: the result is kept, not pruned.
        if epoch < plan.epochs and trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def on_step(latest: Progress) -> None:
        nonlocal progress
        progress = latest
        reporter.step(trial.number, latest, plan.epochs)

    pos_weight = (balanced_pos_weight(planned.train_data.labels)
                  if planned.training.pos_weight == "balanced" else None)
    warned = _warn_eager(trial, model, reporter, None)
    try:
        train(model, planned.train_data, plan, device, pad_id=planned.pad_id,
              evaluate=evaluate, on_epoch=on_epoch, on_step=on_step, pos_weight=pos_weight)
    finally:
        _warn_eager(trial, model, reporter, warned)
        write_kept(trial, lambda: _record_progress(trial, progress, scores, objective, rule,
                                                   model), lock)
    if keeper is not None:
        values = [s.get(objective) for s in scores]
        chosen = metrics.chosen_epoch(values, rule)
        if chosen < len(values) - 1:
            base.load_state_dict(value_weights)
        _keep(trial, planned, resources, keeper, base, value(), chosen + 1, reporter, lock)
    return value()


def train_folds(
    trial: optuna.Trial, planned: TrialPlan, resources: Resources, reporter: Reporter,
    lock: Lock = contextlib.nullcontext,
) -> float:
    """Train the planned trial once per fold of `data.cv_folds` (one batch search for all,
    done in planning); returns the mean of the folds' scores, each its best or last epoch's
    (`study.objective_epoch`). The mean so far is reported after each fold, so the pruner
    can stop a poor configuration after its first folds."""
    plan, device = planned.plan, resources.device
    names = resources.label_names
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
        reporter.step(trial.number, latest, plan.epochs)

    def record() -> None:
        trial.set_user_attr("fold_scores", [round(v, 4) for v in fold_scores])
        trial.set_user_attr("fold_value_epochs", fold_epochs)
        trial.set_user_attr("train_seconds", round(seconds, 3))
        if progress is not None:  # of the last fold
            trial.set_user_attr("samples_per_second", round(progress.samples_per_second, 2))
            trial.set_user_attr("padding_efficiency", round(progress.padding_efficiency, 4))
        if plan.compile:
            _record_compiled(trial, compile_failure)

    try:
        for index, fold in enumerate(resources.folds(planned.params.model_name), 1):
            scores: list[float] = []
            base = adapters.build(resources.models, planned.params.model_name,
                                  fold.train.labels.shape[1], planned.training, plan.precision)
            if index == 1:  # private config field: see train_trial
                trial.set_user_attr("attention_implementation",
                                    base.config._attn_implementation)
                trial.set_user_attr("fused_adamw", fused_adamw(device.type))
                _record_trainable(trial, base)
            model = prepare(base, plan, device)

            def evaluate(m: torch.nn.Module, fold=fold, scores=scores) -> float:
                probabilities = predict(m, fold.validation, plan.eval_batch, device,
                                        plan.precision, planned.pad_id)
                grid = metrics.as_grid(probabilities > 0.5, len(names))
                scores.append(metrics.f1_scores(grid, fold.gold, names).get(objective))
                return scores[-1]

            pos_weight = (balanced_pos_weight(fold.train.labels)
                          if planned.training.pos_weight == "balanced" else None)
            train(model, fold.train, plan, device, pad_id=planned.pad_id, evaluate=evaluate,
                  on_epoch=lambda epoch, score: reporter.epoch(trial.number, epoch,
                                                               plan.epochs, score),
                  on_step=on_step, pos_weight=pos_weight)
            compile_failure = compile_failure or _warn_eager(trial, model, reporter,
                                                             compile_failure)
            seconds += progress.train_seconds if progress is not None else 0.0
            del model, base
            memory.release_memory()
            fold_epochs.append(metrics.chosen_epoch(scores, rule) + 1)
            fold_scores.append(scores[fold_epochs[-1] - 1])
            mean = sum(fold_scores) / len(fold_scores)
            reporter.message(f"  trial {trial.number} fold {index}/{k}: score "
                             f"{fold_scores[-1]:.4f} (mean so far {mean:.4f})")
            write_kept(trial, lambda mean=mean, step=index: trial.report(mean, step), lock)
            # After the last fold the compute is spent: the result is kept, not pruned.
            if index < k and trial.should_prune():
                raise optuna.TrialPruned(f"pruned after fold {index}")
    finally:
        write_kept(trial, record, lock)
    return sum(fold_scores) / len(fold_scores)


def _keep(trial: optuna.Trial, planned: TrialPlan, resources: Resources,
          keeper: artifacts.Keeper, model: torch.nn.Module, value: float, epoch: int,
          reporter: Reporter, lock: Lock) -> None:
    """Keep the trial's model if it ranks in the study's best; a failure to keep it is a
    warning and an attribute, never the trial's failure."""
    data = resources.config.data

    def save(directory: Path) -> None:
        export.save_model(directory, model, planned.params.model_name, resources.label_names,
                          task=data.task, max_length=data.max_length,
                          thresholds=dict.fromkeys(resources.label_names, 0.5))
        (directory / "hpo-trial.json").write_text(artifacts.settings(
            trial, value, epoch, planned.training.model_dump(mode="json")))

    try:
        artifacts.keep(trial, value, keeper, save, lock)
    except Exception as exc:
        reporter.warning(f"trial {trial.number}: its model could not be kept in "
                         f"{keeper.where}: {one_line(exc)}")
        with contextlib.suppress(Exception):
            trial.set_user_attr("checkpoint_error", one_line(exc))


def _record_trainable(trial: optuna.Trial, model: torch.nn.Module) -> None:
    trainable, total = adapters.trainable_parameters(model)
    trial.set_user_attr("trainable_parameters", trainable)
    trial.set_user_attr("trainable_share", round(trainable / total, 6))


def _warn_eager(trial: optuna.Trial, model: torch.nn.Module, reporter: Reporter,
                warned: str | None) -> str | None:
    """Warn once that the compiler failed and the trial trains eagerly; returns the failure
    warned of."""
    failure = model.failure if isinstance(model, CompiledOrEager) else None
    if failure is not None and warned is None:
        reporter.warning(f"trial {trial.number}: torch.compile failed, so the trial trains "
                         f"without it (slower): {failure}")
    return failure


def _record_compiled(trial: optuna.Trial, failure: str | None) -> None:
    trial.set_user_attr("compiled", failure is None)
    if failure is not None:
        trial.set_user_attr("compile_error", failure)


def _record_progress(
    trial: optuna.Trial, progress: Progress | None, scores: list[metrics.Scores],
    objective: str, rule: str, model: torch.nn.Module,
) -> None:
    if isinstance(model, CompiledOrEager):
        _record_compiled(trial, model.failure)
    if progress is not None:
        trial.set_user_attr("samples_per_second", round(progress.samples_per_second, 2))
        trial.set_user_attr("padding_efficiency", round(progress.padding_efficiency, 4))
        trial.set_user_attr("train_seconds", round(progress.train_seconds, 3))
        trial.set_user_attr("epochs_completed", len(scores))
    if scores:
        values = [s.get(objective) for s in scores]
        chosen = metrics.chosen_epoch(values, rule)
        # The scores of the epoch the value comes from, and every epoch's objective.
        trial.set_user_attr("value_epoch", chosen + 1)
        trial.set_user_attr("epoch_scores", [round(v, 4) for v in values])
        trial.set_user_attr("macro_f1", round(scores[chosen].macro_f1, 4))
        trial.set_user_attr("micro_f1", round(scores[chosen].micro_f1, 4))
        trial.set_user_attr("f1_per_symptom", scores[chosen].per_label)


def _find_batch(
    build: Callable[[], torch.nn.Module], plan: Plan, device: Device, key: str, bound: int,
    cache: StudyBatchCache, length: int, watch: Watch,
) -> tuple[memory.BatchLimit, int]:
    known = cache.get(key)
    holder: dict[str, torch.nn.Module] = {}

    def step(batch: int) -> None:
        watch(key, batch)
        if "model" not in holder:
            holder["model"] = prepare(build(), plan, device)
        model = holder["model"]
        model.zero_grad(set_to_none=True)
        probe_step(model, plan, device, batch, length, model.config.vocab_size)

    result = memory.search(step, bound, known, memory.device_memory_probe(device))
    holder.clear()
    memory.release_memory()
    limit = cache.update(key, result.limit) if result.probes else result.limit
    if limit.largest_ok == 0:
        raise torch.OutOfMemoryError(f"out of memory even at micro-batch 1 ({key})")
    return limit, result.probes
