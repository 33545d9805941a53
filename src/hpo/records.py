"""What a trial records beside its value: where it ran, its plan, what its model and optimizer
got, how its training went, and, for the study's best, its model kept in the artifact store.
Everything here is written to the trial as user attributes; nothing here decides its state."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import optuna
import torch

from hpo import adapters, artifacts, export, metrics
from hpo.errors import one_line
from hpo.hardware import fused_adamw, library_versions
from hpo.planning import TrialPlan
from hpo.resources import Resources
from hpo.train import CompiledOrEager, Progress


class Warner(Protocol):
    def warning(self, text: str) -> None: ...


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def record_start(trial: optuna.Trial, resources: Resources) -> None:
    trial.set_user_attr("worker", worker_name())
    trial.set_user_attr("device", resources.device.describe())
    trial.set_user_attr("versions", library_versions())


def record_plan(trial: optuna.Trial, planned: TrialPlan) -> None:
    plan = planned.plan
    trial.set_user_attr("physical_batch_size", plan.physical_batch)
    trial.set_user_attr("grad_accum_steps", plan.grad_accum_steps)
    trial.set_user_attr("effective_batch_size", plan.effective_batch)
    trial.set_user_attr("eval_batch_size", plan.eval_batch)
    trial.set_user_attr("batch_probes", planned.probes)
    trial.set_user_attr("samples_dropped_per_epoch",
                        len(planned.train_data) % plan.effective_batch)
    # The resolved settings beside the result, enough to repeat the run.
    trial.set_user_attr("training", planned.training.model_dump(mode="json"))


def record_model(trial: optuna.Trial, model: torch.nn.Module, device_type: str,
                 seconds: float) -> None:
    """What the model and optimizer got, which the family and the device decide, and the
    seconds it took to build it."""
    trial.set_user_attr("model_seconds", round(seconds, 3))
    # transformers keeps the attention in a private config field (models.py reads it too);
    # the family tests fail if it moves.
    trial.set_user_attr("attention_implementation", model.config._attn_implementation)
    trial.set_user_attr("fused_adamw", fused_adamw(device_type))
    trainable, total = adapters.trainable_parameters(model)
    trial.set_user_attr("trainable_parameters", trainable)
    trial.set_user_attr("trainable_share", round(trainable / total, 6))


def warn_eager(number: int, model: torch.nn.Module, reporter: Warner,
               warned: str | None) -> str | None:
    """Warn once that the compiler failed and the trial trains eagerly; returns the failure
    warned of."""
    failure = model.failure if isinstance(model, CompiledOrEager) else None
    if failure is not None and warned is None:
        reporter.warning(f"trial {number}: torch.compile failed, so the trial trains "
                         f"without it (slower): {failure}")
    return failure


def record_compiled(trial: optuna.Trial, failure: str | None) -> None:
    trial.set_user_attr("compiled", failure is None)
    if failure is not None:
        trial.set_user_attr("compile_error", failure)


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


def record_progress(trial: optuna.Trial, progress: Progress | None,
                    scores: list[metrics.Scores], objective: str, rule: str,
                    model: torch.nn.Module) -> None:
    if isinstance(model, CompiledOrEager):
        record_compiled(trial, model.failure)
    if progress is not None:
        record_speed(trial, progress)
        trial.set_user_attr("train_seconds", round(progress.train_seconds, 3))
        trial.set_user_attr("eval_seconds", round(progress.eval_seconds, 3))
        trial.set_user_attr("epoch_seconds", [round(s, 3) for s in progress.epoch_seconds])
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


def keep(trial: optuna.Trial, planned: TrialPlan, resources: Resources,
         keeper: artifacts.Keeper, model: torch.nn.Module, value: float, epoch: int,
         reporter: Warner, lock: Callable[[], AbstractContextManager[object]]) -> None:
    """Keep the trial's model if it ranks in the study's best; a failure to keep it is a
    warning and an attribute, never the trial's failure."""
    data = resources.config.data

    def save(directory: Path) -> None:
        export.save_model(directory, model, planned.params.model_name, resources.label_names,
                          task=data.task, max_length=data.max_length,
                          thresholds=dict.fromkeys(resources.label_names, 0.5))
        (directory / "hpo-trial.json").write_text(artifacts.settings(
            trial, value, epoch, planned.training.model_dump(mode="json")))

    began = time.perf_counter()
    try:
        artifacts.keep(trial, value, keeper, save, lock)
        trial.set_user_attr("keep_seconds", round(time.perf_counter() - began, 3))
    except Exception as exc:
        reporter.warning(f"trial {trial.number}: its model could not be kept in "
                         f"{keeper.where}: {one_line(exc)}")
        with contextlib.suppress(Exception):
            trial.set_user_attr("checkpoint_error", one_line(exc))
