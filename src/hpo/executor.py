"""One trial: parameters -> batch search -> training -> metrics, and what becomes of it.

`execute` is the one place where an exception turns into a trial state: a pruner's verdict,
an out-of-memory error or a non-finite loss prune the trial (with `prune_reason`); anything
else fails that trial alone, with the error recorded on it.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import optuna
import psutil
import torch
from optuna.trial import FrozenTrial, TrialState

from hpo import memory, metrics
from hpo.config import StudyConfig
from hpo.data import token_cache
from hpo.data.batching import Encoded
from hpo.data.redsm5 import label_names, read_redsm5
from hpo.data.splits import Splits, split_posts
from hpo.data.tasks import Example, build_examples
from hpo.hardware import Device, library_versions
from hpo.models import ModelStore
from hpo.space import Params, PinnedSpace, suggest
from hpo.train import (
    NonFiniteLoss,
    Plan,
    Progress,
    balanced_pos_weight,
    predict,
    prepare,
    probe_step,
    train,
)


class Reporter(Protocol):
    def trial_started(self, number: int, params: Params, plan: Plan, probes: int) -> None: ...
    def step(self, number: int, progress: Progress, epochs: int) -> None: ...
    def epoch(self, number: int, epoch: int, epochs: int, score: float) -> None: ...


@dataclass(frozen=True)
class Outcome:
    state: TrialState
    value: float | None = None
    prune_reason: str | None = None
    error: str | None = None


@dataclass
class Worker:
    """What a worker keeps across trials: data, tokenized splits, models, device."""

    config: StudyConfig
    pinned: PinnedSpace
    device: Device
    train_examples: list[Example]
    validation_examples: list[Example]
    label_names: tuple[str, ...]
    models: ModelStore = field(default_factory=ModelStore)
    token_cache_dir: Path | None = field(default_factory=token_cache.default_dir)
    _encoded: dict[str, tuple[Encoded, Encoded]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def encoded(self, model_name: str) -> tuple[Encoded, Encoded, str]:
        """Both splits tokenized for this model, and where they came from: this worker's
        memory, the machine's disk cache, or the tokenizer."""
        if model_name in self._encoded:
            return *self._encoded[model_name], "worker memory"
        tokenizer = self.models.tokenizer(model_name)
        max_length = self.config.data.max_length
        train, train_hit = token_cache.cached_encode(
            tokenizer, self.train_examples, max_length, self.token_cache_dir
        )
        validation, validation_hit = token_cache.cached_encode(
            tokenizer, self.validation_examples, max_length, self.token_cache_dir
        )
        self._encoded[model_name] = (train, validation)
        return train, validation, "disk cache" if train_hit and validation_hit else "tokenizer"

    def preload(self) -> dict[str, str]:
        """Every model of the search space read and its splits tokenized before the first
        trial, so the worker holds from the start what it would hold after each model's first
        trial. Returns where each model's tokens came from."""
        sources = {}
        for name in self.pinned.declared["model_name"]:
            try:
                train, _, sources[name] = self.encoded(name)
                self.models.build(name, train.labels.shape[1], seed=self.config.training.seed)
            except Exception as exc:  # the trials that draw this model fail with the error
                sources[name] = f"not loaded: {_one_line(exc)}"
        memory.release_memory()
        return sources

    def gold(self) -> torch.Tensor:
        """The validation posts' labels as a post x label grid."""
        labels = torch.tensor([e.labels for e in self.validation_examples])
        return metrics.as_grid(labels, len(self.label_names)).bool()

    def baseline(self) -> metrics.Scores:
        return metrics.all_positive_baseline(self.gold(), self.label_names)


def make_worker(
    config: StudyConfig, pinned: PinnedSpace, device: Device, splits: Splits | None = None
) -> Worker:
    """A worker for this study's data, reading and splitting it unless `splits` is given."""
    data = config.data
    if splits is None:
        posts = read_redsm5(data.dir, special_case=data.special_case)
        splits = split_posts(posts, validation=data.validation_fraction,
                             test=data.test_fraction, seed=data.split_seed)
    return Worker(
        config=config,
        pinned=pinned,
        device=device,
        train_examples=build_examples(splits.train, data.task, special_case=data.special_case),
        validation_examples=build_examples(
            splits.validation, data.task, special_case=data.special_case
        ),
        label_names=label_names(data.special_case),
    )


def cache_key(params: Params, max_length: int, device: Device) -> str:
    return f"{params.model_name}|{params.fp_precision}|{max_length}|{device.cache_key}"


def execute(
    study: optuna.Study, trial: optuna.Trial, worker: Worker, reporter: Reporter
) -> tuple[Outcome, FrozenTrial]:
    """Run one trial to its end and tell the study how it ended."""
    started = time.perf_counter()
    trial.set_user_attr("worker", worker.name)
    trial.set_user_attr("device", worker.device.describe())
    trial.set_user_attr("versions", library_versions())
    cache = memory.StudyBatchCache(study)
    state: dict[str, object] = {}
    oom = False
    try:
        value = _run(trial, worker, reporter, cache, state)
        outcome = Outcome(TrialState.COMPLETE, value=value)
    except optuna.TrialPruned:
        outcome = Outcome(TrialState.PRUNED, prune_reason="pruner")
    except NonFiniteLoss as exc:
        outcome = Outcome(TrialState.PRUNED, prune_reason="nan_loss", error=str(exc))
    except Exception as exc:
        if memory.is_oom(exc):
            oom = True
            outcome = Outcome(TrialState.PRUNED, prune_reason="oom", error=_one_line(exc))
        else:
            outcome = Outcome(TrialState.FAIL, error=_one_line(exc))
            trial.set_user_attr("traceback", traceback.format_exc()[-4000:])
    # Outside the except block: the traceback no longer holds the failed step's tensors.
    state.pop("model", None)
    memory.release_memory()
    if oom and "key" in state:
        lowered = cache.lower(str(state["key"]), int(state["physical"]))
        trial.set_user_attr("batch_limit_after_oom", lowered.to_json())
    if outcome.prune_reason:
        trial.set_user_attr("prune_reason", outcome.prune_reason)
    if outcome.error:
        trial.set_user_attr("error", outcome.error)
    trial.set_user_attr("worker_rss_mb", round(psutil.Process().memory_info().rss / 2**20, 1))
    trial.set_user_attr("trial_seconds", round(time.perf_counter() - started, 3))
    finished = study.tell(trial, outcome.value, state=outcome.state)
    return outcome, finished


def _run(
    trial: optuna.Trial,
    worker: Worker,
    reporter: Reporter,
    cache: memory.StudyBatchCache,
    state: dict[str, object],
) -> float:
    config, device = worker.config, worker.device
    params = suggest(trial, worker.pinned)
    training = config.training.model_copy(update=params.extras)
    began = time.perf_counter()
    train_data, validation_data, source = worker.encoded(params.model_name)
    trial.set_user_attr("tokenization", source)
    trial.set_user_attr("tokenization_seconds", round(time.perf_counter() - began, 3))
    tokenizer = worker.models.tokenizer(params.model_name)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    num_labels = train_data.labels.shape[1]

    def build() -> torch.nn.Module:
        return worker.models.build(params.model_name, num_labels, seed=training.seed)

    base = Plan(
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
    key = cache_key(params, config.data.max_length, device)
    bound = min(params.target_effective_batch_size, training.max_physical_batch_size)
    probe_length = min(config.data.max_length, tokenizer.model_max_length)
    limit, probes = _find_batch(build, base, device, key, bound, cache, probe_length)
    physical = memory.physical_batch(limit, bound, training.safety_margin)
    plan = replace(
        base, physical_batch=physical, eval_batch=memory.eval_batch(limit, physical, bound)
    )
    state.update(key=key, physical=physical)
    trial.set_user_attr("physical_batch_size", physical)
    trial.set_user_attr("grad_accum_steps", plan.grad_accum_steps)
    trial.set_user_attr("effective_batch_size", plan.effective_batch)
    trial.set_user_attr("eval_batch_size", plan.eval_batch)
    trial.set_user_attr("batch_probes", probes)
    trial.set_user_attr("samples_dropped_per_epoch", len(train_data) % plan.effective_batch)
    # The resolved settings beside the result, enough to repeat the run.
    trial.set_user_attr("training", training.model_dump(mode="json"))
    reporter.trial_started(trial.number, params, plan, probes)

    model = prepare(build(), plan, device)
    state["model"] = model
    gold = worker.gold()
    objective = config.study.objective
    scores: list[metrics.Scores] = []

    def evaluate(m: torch.nn.Module) -> float:
        probabilities = predict(m, validation_data, plan.eval_batch, device, plan.precision, pad_id)
        grid = metrics.as_grid(probabilities > 0.5, len(worker.label_names))
        scores.append(metrics.f1_scores(grid, gold, worker.label_names))
        return scores[-1].get(objective)

    def on_epoch(epoch: int, score: float) -> None:
        reporter.epoch(trial.number, epoch, plan.epochs, score)
        trial.report(score, epoch)
        # After the last epoch the compute is spent: the result is kept, not pruned.
        if epoch < plan.epochs and trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {epoch}")

    def on_step(progress: Progress) -> None:
        state["progress"] = progress
        reporter.step(trial.number, progress, plan.epochs)

    pos_weight = (
        balanced_pos_weight(train_data.labels) if training.pos_weight == "balanced" else None
    )
    try:
        train(model, train_data, plan, device, pad_id=pad_id, evaluate=evaluate,
              on_epoch=on_epoch, on_step=on_step, pos_weight=pos_weight)
    finally:
        _record_progress(trial, state.get("progress"), scores)
    return scores[-1].get(objective)


def _record_progress(
    trial: optuna.Trial, progress: object, scores: list[metrics.Scores]
) -> None:
    if isinstance(progress, Progress):
        trial.set_user_attr("samples_per_second", round(progress.samples_per_second, 2))
        trial.set_user_attr("padding_efficiency", round(progress.padding_efficiency, 4))
        trial.set_user_attr("train_seconds", round(progress.train_seconds, 3))
        trial.set_user_attr("epochs_completed", len(scores))
    if scores:
        trial.set_user_attr("macro_f1", round(scores[-1].macro_f1, 4))
        trial.set_user_attr("micro_f1", round(scores[-1].micro_f1, 4))
        trial.set_user_attr("f1_per_symptom", scores[-1].per_label)


def _find_batch(
    build, plan: Plan, device: Device, key: str, bound: int,
    cache: memory.StudyBatchCache, length: int,
) -> tuple[memory.BatchLimit, int]:
    known = cache.get(key)
    holder: dict[str, torch.nn.Module] = {}

    def step(batch: int) -> None:
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]
