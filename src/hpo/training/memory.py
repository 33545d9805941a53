"""Out-of-memory handling: recognise an OOM, release memory, and find the largest batch that
fits.

A search result is an interval per key (model, precision, max_length, device): the largest
micro-batch known to fit and the smallest known to fail. Intervals from several workers merge
by taking the tighter bounds, so concurrent writers cannot widen them; the study keeps them
(`hpo.search.study.StudyBatchCache`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hpo.hardware import CONTEXTS_SHARE, Device

_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "HIP out of memory",
    "MPS backend out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN reports an allocation it could not make for its workspace as "not supported".
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(exc: BaseException) -> bool:
    """True when `exc` means the device ran out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args:
        message = str(exc.args[0])
        return any(marker in message for marker in _OOM_MESSAGES)
    return False


def release_memory() -> None:
    """Collect garbage, return the GPU's cached blocks and the host heap's free pages; call it
    outside any `except` block, where the exception's traceback no longer pins the tensors of
    the failed step."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        # glibc keeps the freed activations of every batch shape in its arenas; without a
        # trim a worker's resident memory ratchets up trial after trial.
        malloc_trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: musl and macOS have no malloc_trim
        return None


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Within the block, every object alive at its start (imported modules, tokenizers,
    preloaded weights and tokens: what a worker holds for its whole life) is out of the
    garbage collector's sight. A full collection walks every tracked object, a cost paid at
    each `release_memory` and at each of the full collections Python starts on its own
    during training (benchmarks/README.md measures both); in the block, collections walk
    only what trials create. At its end the
    collector gets them all back (Python unfreezes every frozen object at once), so a
    process that goes on after its worker (a notebook, a test run) collects them again:
    objects frozen in a reference cycle, such as a storage and its pooled connections,
    would otherwise never be freed."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fits(step: Callable[[int], None], batch: int) -> bool:
    """Run `step(batch)`; False if it ran out of memory, any other error propagates. Memory
    is released only after an OOM: a step that succeeded freed its tensors as it returned."""
    out_of_memory = False
    try:
        step(batch)
    except Exception as exc:
        if not is_oom(exc):
            raise
        out_of_memory = True
    if out_of_memory:
        release_memory()
    return not out_of_memory


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


@dataclass(frozen=True)
class MemoryProbe:
    """How a device reports memory: `peak()` gives the peak bytes of the last probe step and
    `capacity` the bytes a step may use. Only a GPU can say; on a CPU the search bisects."""

    capacity: int
    peak: Callable[[], int]


def search_bound(device: Device, target: int, max_physical: int) -> int:
    """The largest batch a model's search probes. On a GPU, the physical limit: running out
    of its memory is an exception the search catches, so a model and precision is searched
    once and a later trial at a larger effective batch probes nothing. On a CPU, the trial's
    own batch: the host's only out-of-memory signal is the OOM killer, and every probe above
    what fits costs a trial (and, without `training.isolate_trials`, the worker)."""
    if device.type == "cuda":
        return max_physical
    return min(target, max_physical)


# What a worker holds on a CUDA device outside its allocator's reserve (its context and the
# libraries' modules; measured in benchmarks/README.md, "On a GPU"), with an
# isolating parent's context beside it, stays under this share of the device, or this much
# on a small card; beyond it, another process is using the device. The same share a shared
# GPU's workers leave outside their allocators' caps (`Device.memory_fraction`).
SHARED_SHARE = CONTEXTS_SHARE
SHARED_FLOOR = 5 * 2**29  # 2.5 GiB


def foreign_bytes(device: Device) -> int:
    """The memory of a CUDA device held outside this process's allocator, where it is more
    than contexts and the other workers of a shared device (`Device.sharing`, each capped at
    its share) account for: a process nobody declared is using the device. 0 off CUDA and
    on a device this process has to itself or shares as asked. The batch search otherwise
    sizes for the whole device, or for this worker's share."""
    if device.type != "cuda":
        return 0
    index = device.torch_device
    free, total = torch.cuda.mem_get_info(index)
    outside = total - free - torch.cuda.memory_reserved(index)
    siblings = (device.sharing - 1) * int(total * device.memory_fraction)
    undeclared = outside - siblings
    return undeclared if undeclared > max(SHARED_FLOOR, SHARED_SHARE * total) else 0


def device_memory_probe(device: Device, foreign: int = 0) -> MemoryProbe | None:
    """A CUDA device's allocator reports peaks; 5% of the memory this process may use (all of
    it or its share, less the `foreign_bytes` held outside its allocator) is left to the
    allocator's own fragmentation and the CUDA context."""
    if device.type != "cuda":
        return None
    index = device.torch_device

    def peak() -> int:
        value = torch.cuda.max_memory_allocated(index)
        torch.cuda.reset_peak_memory_stats(index)  # the next probe measures its own peak
        return value

    torch.cuda.reset_peak_memory_stats(index)
    return MemoryProbe(capacity=int(0.95 * (device.usable_memory - foreign)), peak=peak)


def step_memory(device: Device, step: Callable[[], object]) -> int | None:
    """Run `step()`; the bytes it needed above what the process held before it, where the
    device can say: a CUDA allocator's peak, or a Linux process's peak resident memory
    (reset through /proc/self/clear_refs), the host's freed pages returned first so that a
    step reusing them does not read as needing nothing. None where neither can be read."""
    if device.type == "cuda":
        index = device.torch_device
        torch.cuda.reset_peak_memory_stats(index)
        before = torch.cuda.memory_allocated(index)
        step()
        return max(0, torch.cuda.max_memory_allocated(index) - before)
    release_memory()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident size
        before = _status_bytes("VmRSS")
    except (OSError, LookupError):
        step()
        return None
    step()
    return max(0, _status_bytes("VmHWM") - before)


def free_bytes(device: Device) -> int | None:
    """The memory free for a step now: a CUDA device's, or the host's available memory (Linux);
    None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device.torch_device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # in kB
    raise LookupError(field)


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's allocated memory around one trial, in MiB: before it, its peak while it
    trained (after the batch search), and after its memory was released."""

    before: float
    peak: float | None = None
    after: float | None = None

    def to_attrs(self) -> dict[str, float]:
        return {name: value for name, value in (
            ("memory_before_mib", self.before), ("peak_memory_mib", self.peak),
            ("memory_after_mib", self.after)) if value is not None}


def device_memory(device: Device) -> DeviceMemory | None:
    """Allocated memory now, and the peak counter started from here; None off CUDA, whose
    allocators keep no such counts."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device.torch_device)
    return DeviceMemory(before=torch.cuda.memory_allocated(device.torch_device) / 2**20)


def restart_peak(device: Device) -> None:
    """The peak counter from here on: training's peak, not the batch search's probes."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device.torch_device)


def after_trial(device: Device, mark: DeviceMemory | None) -> DeviceMemory | None:
    """`mark` with the peak since it (or since `restart_peak`) and the memory still allocated;
    call it after `release_memory`."""
    if mark is None or device.type != "cuda":
        return mark
    index = device.torch_device
    return DeviceMemory(mark.before, torch.cuda.max_memory_allocated(index) / 2**20,
                        torch.cuda.memory_allocated(index) / 2**20)


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
