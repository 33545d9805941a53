"""A trial before training, its parameters sampled: the physical batch that fits the device
(the study's cached limit, or a binary search where it has none) and the plan derived from
them: accumulation steps, evaluation batch, precision."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpo.config import TrainingConfig
from hpo.data.batching import Encoded
from hpo.hardware import Device
from hpo.space import Params
from hpo.training import memory
from hpo.training.train import Plan
from hpo.trial import step_check
from hpo.trial.batch_limit import Fitted, fit_batch
from hpo.trial.context import TrialContext
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

    @property
    def fitted(self) -> Fitted:
        return Fitted(self.batch_key, self.plan.physical_batch, self.shared_bytes)


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
        context.display.warning(shared_device_warning(device, shared))
    plan, key, probes = fit_batch(params, training, resources, context.cache,
                                  watch=context.watch, shared=shared)
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
