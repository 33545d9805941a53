"""What a trial records beside its value: where it ran, its plan, what its model and optimizer
got, how its training went, how it ended and, for the study's best, its model kept in the
artifact store. Every user attribute a trial run writes is written here (the reaper writes its
own, in `liveness`); nothing here decides a trial's state."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import optuna
import psutil
import torch

from hpo.config import StudySection
from hpo.errors import one_line
from hpo.hardware import fused_adamw, library_versions
from hpo.outcome import Outcome
from hpo.search import artifacts, liveness
from hpo.search.resilience import batched_user_attrs
from hpo.training import adapters, export, metrics
from hpo.training.memory import DeviceMemory
from hpo.training.models import config_of
from hpo.training.train import CompiledOrEager, Progress, as_epochs
from hpo.trial.batch_limit import BatchLimit
from hpo.trial.planning import PlannedTrial
from hpo.trial.resources import Resources
from hpo.trial.run import Trained, TrialRun


class Warner(Protocol):
    def warning(self, text: str) -> None: ...


def worker_name() -> str:
    """The worker running this trial: this process, or the worker whose trial runs in this
    process (`training.isolate_trials`), whose death its launcher watches for."""
    return liveness.worker_on_this_host(int(os.environ.get(liveness.WORKER_PID, os.getpid())))


@batched_user_attrs()
def record_start(trial: optuna.Trial, resources: Resources) -> None:
    trial.set_user_attr("worker", worker_name())
    trial.set_user_attr("device", resources.device.describe())
    if resources.device.sharing > 1:  # its batches were sized for this share (hpo status)
        trial.set_user_attr("gpu_share", f"1/{resources.device.sharing}")
    trial.set_user_attr("versions", library_versions())


@batched_user_attrs()
def record_plan(trial: optuna.Trial, planned: PlannedTrial) -> None:
    plan = planned.plan
    trial.set_user_attr("physical_batch_size", plan.physical_batch)
    trial.set_user_attr("grad_accum_steps", plan.grad_accum_steps)
    trial.set_user_attr("effective_batch_size", plan.effective_batch)
    trial.set_user_attr("eval_batch_size", plan.eval_batch)
    trial.set_user_attr("batch_probes", planned.probes)
    trial.set_user_attr("tokenization", planned.tokenization)
    trial.set_user_attr("tokenization_seconds", round(planned.tokenization_seconds, 3))
    trial.set_user_attr("batch_search_seconds", round(planned.batch_search_seconds, 3))
    if planned.shared_bytes:
        trial.set_user_attr("device_shared_gib", round(planned.shared_bytes / 2**30, 2))
    trial.set_user_attr("samples_dropped_per_epoch",
                        len(planned.train_data) % plan.effective_batch)
    # The resolved settings beside the result, enough to repeat the run.
    trial.set_user_attr("training", planned.training.model_dump(mode="json"))


def record_retry(trial: optuna.Trial, retried: int) -> None:
    """The trial this one re-runs: the reaper's retry copy of `retried`."""
    trial.set_user_attr("retry_of", retried)


@batched_user_attrs()
def record_model(trial: optuna.Trial, model: torch.nn.Module, device_type: str,
                 seconds: float) -> None:
    """What the model and optimizer got, which the family and the device decide, and the
    seconds it took to build it."""
    trial.set_user_attr("model_seconds", round(seconds, 3))
    # transformers keeps the attention in a private config field (models.py reads it too);
    # the family tests fail if it moves.
    trial.set_user_attr("attention_implementation", config_of(model)._attn_implementation)
    trial.set_user_attr("fused_adamw", fused_adamw(device_type))
    trainable, total = adapters.trainable_parameters(model)
    trial.set_user_attr("trainable_parameters", trainable)
    trial.set_user_attr("trainable_share", round(trainable / total, 6))


def warn_eager(number: int, model: torch.nn.Module, display: Warner,
               warned: str | None) -> str | None:
    """Warn once that the compiler failed and the trial trains eagerly; returns the failure
    warned of."""
    failure = model.failure if isinstance(model, CompiledOrEager) else None
    if failure is not None and warned is None:
        display.warning(f"trial {number}: torch.compile failed, so the trial trains "
                         f"without it (slower): {failure}")
    return failure


def record_compiled(trial: optuna.Trial, failure: str | None) -> None:
    trial.set_user_attr("compiled", failure is None)
    if failure is not None:
        trial.set_user_attr("compile_error", failure)


@batched_user_attrs()
def record_speed(trial: optuna.Trial, progress: Progress) -> None:
    trial.set_user_attr("samples_per_second", round(progress.samples_per_second, 2))
    trial.set_user_attr("padding_efficiency", round(progress.padding_efficiency, 4))
    trial.set_user_attr("train_flops", float(f"{progress.model_flops:.4g}"))
    trial.set_user_attr("flops_per_second", float(f"{progress.flops_per_second:.4g}"))
    if progress.mfu is not None:
        trial.set_user_attr("mfu", round(progress.mfu, 4))
        trial.set_user_attr("peak_flops", progress.peak_flops)
    if progress.grad_scale is not None:
        trial.set_user_attr("grad_scale", progress.grad_scale)


@dataclass
class FoldsSoFar:
    """A cross-validated trial's folds so far: each fold's score and the epoch (1-based) it
    comes from, the training seconds of all, the last progress, the compiler's failure."""

    scores: list[float] = field(default_factory=list)
    value_epochs: list[int] = field(default_factory=list)
    seconds: float = 0.0
    progress: Progress | None = None
    compile_failure: str | None = None

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores)


@batched_user_attrs()
def record_folds(trial: optuna.Trial, folds: FoldsSoFar, compiled: bool) -> None:
    """A cross-validated trial's folds so far, and the last fold's speed."""
    trial.set_user_attr("fold_scores", [round(v, 4) for v in folds.scores])
    trial.set_user_attr("fold_value_epochs", folds.value_epochs)
    trial.set_user_attr("train_seconds", round(folds.seconds, 3))
    if folds.progress is not None:
        record_speed(trial, folds.progress)
    if compiled:
        record_compiled(trial, folds.compile_failure)


@batched_user_attrs()
def record_progress(trial: optuna.Trial, progress: Progress | None,
                    scores: list[metrics.Scores], study: StudySection,
                    model: torch.nn.Module, *, per_epoch: int = 1) -> None:
    """How the training went: its speed and seconds, and the scores of the evaluation the
    value comes from (`study.objective_epoch`) and every evaluation's objective."""
    objective, rule = study.objective, study.objective_epoch
    if isinstance(model, CompiledOrEager):
        record_compiled(trial, model.failure)
    if progress is not None:
        record_speed(trial, progress)
        trial.set_user_attr("train_seconds", round(progress.train_seconds, 3))
        trial.set_user_attr("eval_seconds", round(progress.eval_seconds, 3))
        trial.set_user_attr("epoch_seconds", [round(s, 3) for s in progress.epoch_seconds])
        trial.set_user_attr("epochs_completed", len(scores) // per_epoch)
    if scores:
        values = [s.get(objective) for s in scores]
        chosen = metrics.chosen_epoch(values, rule)
        # The scores of the evaluation the value comes from, and every evaluation's objective.
        trial.set_user_attr("value_epoch", as_epochs(chosen + 1, per_epoch))
        trial.set_user_attr("epoch_scores", [round(v, 4) for v in values])
        trial.set_user_attr("macro_f1", round(scores[chosen].macro_f1, 4))
        trial.set_user_attr("micro_f1", round(scores[chosen].micro_f1, 4))
        trial.set_user_attr("f1_per_symptom", scores[chosen].per_label)


@batched_user_attrs()
def record_end(trial: optuna.Trial, outcome: Outcome, *, lowered: BatchLimit | None = None,
               failed_at: str | None = None, device_memory: DeviceMemory | None = None,
               started: float | None = None) -> None:
    """How the trial ended, beside the state it is told with: the reason and error, the
    study's batch limit an OOM `lowered`, the traceback of a failure, the memory and the
    seconds (since `started`, a perf_counter reading) the trial took."""
    if lowered is not None:
        trial.set_user_attr("batch_limit_after_oom", lowered.to_json())
    if outcome.prune_reason:
        trial.set_user_attr("prune_reason", outcome.prune_reason)
    if outcome.error:
        trial.set_user_attr("error", outcome.error)
    if failed_at:
        trial.set_user_attr("traceback", failed_at)
    for name, mib in (device_memory.to_attrs() if device_memory else {}).items():
        trial.set_user_attr(name, round(mib, 1))
    if started is not None:
        trial.set_user_attr("worker_rss_mb", round(psutil.Process().memory_info().rss / 2**20, 1))
        trial.set_user_attr("trial_seconds", round(time.perf_counter() - started, 3))


@batched_user_attrs()
def record_stopped(trial: optuna.Trial, error: str | None, *, interrupted: bool) -> None:
    """A trial ended before its end: `interrupted` by Ctrl-C or SIGTERM (`hpo status` counts
    a deliberate stop apart from failures, `summary.interrupted`), or given back."""
    trial.set_user_attr("error", error)
    if interrupted:
        trial.set_user_attr("interrupted", True)


def keep(run: TrialRun, trained: Trained, keeper: artifacts.Keeper) -> None:
    """Keep the trained model in `keeper` if it ranks in the study's best; a failure to keep
    it is a warning and an attribute, never the trial's failure."""
    trial, model = run.trial, trained.model
    assert model is not None  # a single-model trial's
    began = time.perf_counter()
    try:
        if not artifacts.ranks(trial, trained.value, keeper):
            return
        data, names = run.config.data, run.resources.label_names
        with tempfile.TemporaryDirectory(prefix="hpo-checkpoint-") as scratch:
            model_dir = Path(scratch) / f"trial-{trial.number}"
            export.save_model(model_dir, model, run.model_name, task=data.task,
                              max_length=data.max_length, thresholds=dict.fromkeys(names, 0.5))
            (model_dir / "hpo-trial.json").write_text(artifacts.settings(
                trial, trained.value, trained.epoch,
                run.planned.training.model_dump(mode="json")))
            artifacts.keep(trial, trained.value, keeper, model_dir, run.context.lock)
        trial.set_user_attr("keep_seconds", round(time.perf_counter() - began, 3))
    except Exception as exc:
        run.context.display.warning(f"trial {trial.number}: its model could not be kept in "
                                     f"{keeper.where}: {one_line(exc)}")
        with contextlib.suppress(Exception):
            trial.set_user_attr("checkpoint_error", one_line(exc))
