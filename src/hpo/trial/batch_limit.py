"""The largest micro-batch that fits, in one home. What is known per key (model, precision,
max_length, device and adapter): an interval, the largest micro-batch known to fit and the
smallest known to fail, merged across workers by taking the tighter bounds so that concurrent
writers cannot widen it. The study keeps it (`StudyBatchCache`, under the study lock); a trial
searches where it has none (`search`, a pure search over an injected step, probing through
`memory.fits`), trains at a safety margin below it (`physical_batch`), evaluates at the
largest batch a step survived (`eval_batch`), and lowers it after an out-of-memory error in
training (`tried_alone`, `StudyBatchCache.lower`). `fit_batch` puts these together for a
worker's trial and for `hpo final`."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import optuna
import torch

from hpo.config import TrainingConfig
from hpo.hardware import Device
from hpo.outcome import Outcome
from hpo.search import budget
from hpo.search.resilience import ResilientRDBStorage
from hpo.space import Params
from hpo.training import adapters, memory
from hpo.training.memory import MemoryProbe, fits
from hpo.training.train import Plan, prepare, probe_step
from hpo.trial.resources import Resources

# Called with the batch cache key and the micro-batch before each step that may run out of
# memory (each probe, then training): a process killed by the OOM killer cannot say it itself.
Watch = Callable[[str, int], None]


def unwatched(_key: str, _batch: int) -> None:
    return None


@dataclass(frozen=True)
class BatchLimit:
    """What is known about one key: `largest_ok` fits (0: nothing known to fit yet);
    `smallest_fail` ran out of memory (None: no failure seen)."""

    largest_ok: int = 0
    smallest_fail: int | None = None

    def merge(self, other: BatchLimit) -> BatchLimit:
        fails = [f for f in (self.smallest_fail, other.smallest_fail) if f is not None]
        smallest_fail = min(fails) if fails else None
        largest_ok = max(self.largest_ok, other.largest_ok)
        if smallest_fail is not None:
            largest_ok = min(largest_ok, smallest_fail - 1)
        return BatchLimit(largest_ok, smallest_fail)

    def after_oom(self, batch: int) -> BatchLimit:
        """The limit once `batch` ran out of memory during training."""
        return self.merge(BatchLimit(0, max(batch, 1)))

    def to_json(self) -> dict[str, int | None]:
        return {"largest_ok": self.largest_ok, "smallest_fail": self.smallest_fail}

    @classmethod
    def from_json(cls, data: dict[str, int | None]) -> BatchLimit:
        return cls(int(data["largest_ok"] or 0), data.get("smallest_fail"))


@dataclass(frozen=True)
class SearchResult:
    limit: BatchLimit
    probes: int


def search_bound(device: Device, target: int, max_physical: int) -> int:
    """The largest batch a model's search probes. On a GPU, the physical limit: running out
    of its memory is an exception the search catches, so a model and precision is searched
    once and a later trial at a larger effective batch probes nothing. On a CPU, the trial's
    own batch: the host's only out-of-memory signal is the OOM killer, and every probe above
    what fits costs a trial (and, without `training.isolate_trials`, the worker)."""
    if device.type == "cuda":
        return max_physical
    return min(target, max_physical)


# Model-chosen probes before the search falls back to plain bisection: memory that does not
# grow linearly with the batch must not turn the search into a crawl.
_MODEL_PROBES = 3


def search(
    step: Callable[[int], None],
    bound: int,
    known: BatchLimit,
    memory: MemoryProbe | None = None,
) -> SearchResult:
    """Binary search for the largest batch in [1, bound] that `step` survives.

    The bound itself is probed first, since it usually fits; then the open interval between
    what is known to fit and to fail is bisected: at most 1 + ceil(log2(bound)) probes, none
    when `known` already answers. A result with largest_ok == 0 means even one sample fails.

    With a `memory` probe the search fits peak memory = a + b * batch on two cheap probes and
    asks the line where the limit is, then checks the batch above its answer: about five
    probes wherever the limit lies, instead of nine.
    """
    limit = known
    probes = 0
    if _resolved(limit, bound):
        return SearchResult(limit, 0)
    top = bound if limit.smallest_fail is None else min(bound, limit.smallest_fail - 1)
    probes += 1
    if fits(step, top):
        return SearchResult(limit.merge(BatchLimit(top, None)), probes)
    low, high = limit.largest_ok, top
    seen: list[tuple[int, int]] = []
    model_probes = 0 if memory is not None else _MODEL_PROBES
    while high - low > 1:
        mid = (low + high) // 2
        guided = model_probes < _MODEL_PROBES
        if guided:
            assert memory is not None  # without a probe model_probes starts at the limit
            guess = low + 1 if len(seen) < 2 else _predict(seen, memory.capacity)
            if guess is None:
                guided, model_probes = False, _MODEL_PROBES
            else:
                mid = min(max(guess, low + 1), high - 1)
                model_probes += len(seen) >= 2
        probes += 1
        if fits(step, mid):
            low = mid
            if memory is not None:
                seen.append((mid, memory.peak()))
        else:
            high = mid
            if guided and len(seen) >= 2:
                model_probes = _MODEL_PROBES  # the line overestimated: bisect from here
    return SearchResult(limit.merge(BatchLimit(low, high)), probes)


def _predict(seen: list[tuple[int, int]], capacity: int) -> int | None:
    """The largest batch whose peak memory the least-squares line keeps within capacity."""
    n = len(seen)
    mean_x = sum(x for x, _ in seen) / n
    mean_y = sum(y for _, y in seen) / n
    spread = sum((x - mean_x) ** 2 for x, _ in seen)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in seen) / spread
    if slope <= 0:
        return None
    return math.floor((capacity - (mean_y - slope * mean_x)) / slope)


def _resolved(limit: BatchLimit, bound: int) -> bool:
    if limit.largest_ok >= bound:
        return True
    return limit.smallest_fail is not None and limit.smallest_fail <= limit.largest_ok + 1


def physical_batch(limit: BatchLimit, bound: int, safety_margin: float) -> int:
    """The micro-batch to train with. The margin applies only when a real memory limit was
    found below the bound: a batch that never met one has nothing to keep a distance from."""
    if limit.smallest_fail is not None and limit.smallest_fail <= bound:
        return max(1, min(bound, math.floor(safety_margin * limit.largest_ok)))
    return max(1, min(bound, limit.largest_ok))


def eval_batch(limit: BatchLimit, physical: int, bound: int) -> int:
    """Evaluation keeps no activations for backward and no optimizer state, so it can run
    larger micro-batches: the largest batch a full training step survived, or twice the
    training batch when no limit has been met."""
    if limit.smallest_fail is not None and limit.smallest_fail <= bound:
        return max(physical, limit.largest_ok)
    return 2 * physical


class StudyBatchCache:
    """Batch limits kept as study user attributes, so every worker of the study sees them."""

    PREFIX = "batch_limit:"

    def __init__(self, study: optuna.Study,
                 lock: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
                 ) -> None:
        self._study = study
        self.lock = lock  # the study lock, which carry_over takes too

    def get(self, key: str) -> BatchLimit:
        stored = self._study.user_attrs.get(self.PREFIX + key)
        return BatchLimit.from_json(stored) if stored else BatchLimit()

    def update(self, key: str, limit: BatchLimit) -> BatchLimit:
        """Merge what a trial learned into the study's limit; returns the merged limit the
        trial goes by. An out-of-memory at one sample is that trial's alone: it says the
        device was full at that moment (a GPU shared with another process), not that the key
        never fits, and kept it would prune every later trial of the key for good. A
        combination that cannot run one sample is the study's check to mark unusable."""
        # Read, merged and written under the study lock: another worker may be learning
        # something about the same key at the same moment.
        with self.lock():
            stored = self.get(key)
            merged = stored.merge(limit)
            kept = merged if merged.smallest_fail != 1 else stored.merge(
                BatchLimit(limit.largest_ok))
            if kept != stored:
                self._study.set_user_attr(self.PREFIX + key, kept.to_json())
        return merged

    def lower(self, key: str, batch: int) -> BatchLimit:
        return self.update(key, BatchLimit().after_oom(batch))


def shared_batch_cache(study: optuna.Study, storage: ResilientRDBStorage) -> StudyBatchCache:
    """The study's batch cache, updated under the study lock all its workers share."""
    return StudyBatchCache(
        study, functools.partial(budget.study_lock, storage.engine, study.study_name))


def cache_key(params: Params, training: TrainingConfig, max_length: int, device: Device) -> str:
    return (f"{params.model_name}|{params.fp_precision}|{max_length}|{device.cache_key}"
            f"{adapters.cache_suffix(training, params.fp_precision)}")


def unfitted_plan(params: Params, training: TrainingConfig) -> Plan:
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
        pos_weight=training.pos_weight,
    )


def fit_batch(params: Params, training: TrainingConfig, resources: Resources,
              cache: StudyBatchCache, *, watch: Watch = unwatched, shared: int = 0
              ) -> tuple[Plan, str, int]:
    """The plan of a configuration (`unfitted_plan`) with the physical and evaluation batches
    that fit this device: the study's cached limit for the model and precision, searched
    (probes > 0) where there is none. On a device other processes hold `shared` bytes of,
    what fits changes with what they hold: the search starts from what is known to fail,
    sizes for what is left, and its result stays with this trial. Returns the plan, the
    cache key and the number of probes."""
    config, device = resources.config, resources.device
    base = unfitted_plan(params, training)
    tokenizer = resources.models.tokenizer(params.model_name)
    key = cache_key(params, training, config.data.max_length, device)
    bound = min(params.target_effective_batch_size, training.max_physical_batch_size)
    build = functools.partial(adapters.build, resources.models, params.model_name,
                              resources.num_labels, training, params.fp_precision)
    probe = _Probe(build, base, device, key,
                   min(config.data.max_length, tokenizer.model_max_length), watch)
    # A GPU others use is searched no further than the trial needs: its result stays with
    # the trial, and a probe of the whole bound could take the memory a neighbour is using.
    searched_to = bound if shared else search_bound(
        device, params.target_effective_batch_size, training.max_physical_batch_size)
    limit, probes = _find_batch(probe, searched_to, cache, shared)
    physical = physical_batch(limit, bound, training.safety_margin)
    plan = replace(
        base, physical_batch=physical, eval_batch=eval_batch(limit, physical, bound)
    )
    return plan, key, probes


@dataclass
class _Probe:
    """One probe of the batch search: a training step of `length`-token sequences at a
    micro-batch, on the model `build` makes at the first probe and every later one reuses."""

    build: Callable[[], torch.nn.Module]
    plan: Plan
    device: Device
    key: str
    length: int
    watch: Watch
    model: torch.nn.Module | None = None

    def __call__(self, batch: int) -> None:
        self.watch(self.key, batch)
        if self.model is None:
            self.model = prepare(self.build(), self.plan, self.device)
        self.model.zero_grad(set_to_none=True)
        probe_step(self.model, self.plan, self.device, batch, self.length)


def _find_batch(probe: _Probe, bound: int, cache: StudyBatchCache, shared: int
                ) -> tuple[BatchLimit, int]:
    known = cache.get(probe.key)
    if shared:
        known = BatchLimit(0, known.smallest_fail)
    result = search(probe, bound, known, memory.device_memory_probe(probe.device, shared))
    probe.model = None
    memory.release_memory()
    limit = (cache.update(probe.key, result.limit) if result.probes and not shared
             else result.limit)
    if limit.largest_ok == 0:
        raise torch.OutOfMemoryError(f"out of memory even at micro-batch 1 ({probe.key})")
    return limit, result.probes

@dataclass(frozen=True)
class Fitted:
    """The micro-batch a trial trains at, the key its limit is cached under, and the bytes
    of the device other processes held when it was fitted (then the limit stayed with the
    trial, and an out-of-memory error lowers nothing)."""

    key: str
    batch: int
    shared_bytes: int = 0


def tried_alone(outcome: Outcome, fitted: Fitted | None, device: Device
                ) -> tuple[str, int] | None:
    """The cache key and micro-batch an OOM lowers the study's limit for. An OOM on a device
    other processes held memory of, when the batch was fitted or now, says nothing of what
    fits the device alone: then none. None for any other end, without asking the device
    (after a device-side assert, CUDA answers nothing)."""
    if outcome.prune_reason != "oom" or fitted is None or fitted.shared_bytes:
        return None
    if memory.foreign_bytes(device):
        return None
    return fitted.key, fitted.batch
