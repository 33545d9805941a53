"""Out-of-memory handling and memory probes: recognise an OOM, run a step and say whether it
fit, release memory, and read what a device holds (its allocator's peak, memory other
processes hold, a trial's memory). The batch limit these serve is `hpo.trial.batch_limit`."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
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
class MemoryProbe:
    """How a device reports memory: `peak()` gives the peak bytes of the last probe step and
    `capacity` the bytes a step may use. Only a GPU can say; on a CPU the search bisects."""

    capacity: int
    peak: Callable[[], int]


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


