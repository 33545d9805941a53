"""A trial before training, its parameters sampled: the physical batch that fits the device
(the study's cached limit, or a binary search where it has none) and the plan derived from
them: accumulation steps, evaluation batch, precision."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hpo.config import TrainingConfig
from hpo.data.batching import Encoded
from hpo.hardware import Device
from hpo.search.study import StudyBatchCache
from hpo.space import Params
from hpo.training import adapters, memory
from hpo.training.models import config_of
from hpo.training.train import Plan, prepare, probe_step
from hpo.trial import step_check
from hpo.trial.context import TrialContext, Watch, unwatched
from hpo.trial.resources import Resources


@dataclass(frozen=True)
class PlannedTrial:
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
    tokenization: str  # where the tokens came from (`Resources.encoded`)
    tokenization_seconds: float
    batch_search_seconds: float
    # Bytes of the device other processes held when the batch was fitted (`memory.
    # foreign_bytes`): its limit was kept out of the study's cache, and an OOM lowers nothing.
    shared_bytes: int = 0


def cache_key(params: Params, training: TrainingConfig, max_length: int, device: Device) -> str:
    return (f"{params.model_name}|{params.fp_precision}|{max_length}|{device.cache_key}"
            f"{adapters.cache_suffix(training, params.fp_precision)}")


def plan_trial(context: TrialContext, params: Params, resources: Resources) -> PlannedTrial:
    """Refuse a combination the study's check found unusable, find the physical batch that
    fits and derive the plan of the trial's sampled `params`."""
    config, device = resources.config, resources.device
    training = config.training.model_copy(update=params.extras)
    why = step_check.unusable(context.study, device, params.model_name, params.fp_precision,
                         training.peft)
    if why is not None:
        adapter = "" if training.peft == "none" else f" {training.peft}"
        raise step_check.Unusable(f"{params.model_name} {params.fp_precision}{adapter}: {why} "
                             f"(hpo check)")
    began = time.perf_counter()
    train_data, validation_data, source = resources.encoded(params.model_name)
    tokenization_seconds = time.perf_counter() - began
    began = time.perf_counter()
    shared = memory.foreign_bytes(device)
    if shared:
        context.reporter.warning(shared_device_warning(device, shared))
    plan, key, probes = fit_batch(base_plan(params, training), params, training,
                                  train_data.labels.shape[1], resources, context.cache,
                                  context.watch, shared=shared)
    searched = time.perf_counter() - began
    return PlannedTrial(params, training, plan, key, probes, train_data, validation_data,
                        resources.pad_id(params.model_name), source, tokenization_seconds,
                        searched, shared)


def shared_device_warning(device: Device, shared: int) -> str:
    return (f"{shared / 2**30:.1f} GiB of {device.describe()} is held outside this worker "
            f"(other processes use it): this "
            f"trial's batch is searched for what is left now, and neither its limit nor an "
            f"out-of-memory error goes into the study's cache, which every worker on this "
            f"kind of device trusts; run one worker per GPU (CUDA_VISIBLE_DEVICES)")


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
        evaluations_per_epoch=training.evaluations_per_epoch,
        gradient_checkpointing=training.gradient_checkpointing,
        compile=training.compile,
    )


def fit_batch(base: Plan, params: Params, training: TrainingConfig, num_labels: int,
              resources: Resources, cache: StudyBatchCache, watch: Watch = unwatched,
              *, shared: int = 0) -> tuple[Plan, str, int]:
    """`base` with the physical and evaluation batches that fit this device: the study's
    cached limit for the model and precision, searched (probes > 0) where there is none.
    On a device other processes hold `shared` bytes of, what fits changes with what they
    hold: the search starts from what is known to fail, sizes for what is left, and its
    result stays with this trial. Returns the plan, the cache key and the number of probes."""
    config, device = resources.config, resources.device
    tokenizer = resources.models.tokenizer(params.model_name)
    key = cache_key(params, training, config.data.max_length, device)
    bound = min(params.target_effective_batch_size, training.max_physical_batch_size)
    build = functools.partial(adapters.build, resources.models, params.model_name, num_labels,
                              training, params.fp_precision)
    probe_length = min(config.data.max_length, tokenizer.model_max_length)
    # A GPU others use is searched no further than the trial needs: its result stays with
    # the trial, and a probe of the whole bound could take the memory a neighbour is using.
    searched_to = bound if shared else memory.search_bound(
        device, params.target_effective_batch_size, training.max_physical_batch_size)
    limit, probes = _find_batch(build, base, device, key, searched_to, cache, probe_length,
                                watch, shared)
    physical = memory.physical_batch(limit, bound, training.safety_margin)
    plan = replace(
        base, physical_batch=physical, eval_batch=memory.eval_batch(limit, physical, bound)
    )
    return plan, key, probes


def _find_batch(
    build: Callable[[], torch.nn.Module], plan: Plan, device: Device, key: str, bound: int,
    cache: StudyBatchCache, length: int, watch: Watch, shared: int = 0,
) -> tuple[memory.BatchLimit, int]:
    known = cache.get(key)
    if shared:
        known = memory.BatchLimit(0, known.smallest_fail)
    holder: dict[str, torch.nn.Module] = {}

    def step(batch: int) -> None:
        watch(key, batch)
        if "model" not in holder:
            holder["model"] = prepare(build(), plan, device)
        model = holder["model"]
        model.zero_grad(set_to_none=True)
        probe_step(model, plan, device, batch, length, config_of(model).vocab_size)

    result = memory.search(step, bound, known, memory.device_memory_probe(device, shared))
    holder.clear()
    memory.release_memory()
    limit = cache.update(key, result.limit) if result.probes and not shared else result.limit
    if limit.largest_ok == 0:
        raise torch.OutOfMemoryError(f"out of memory even at micro-batch 1 ({key})")
    return limit, result.probes
