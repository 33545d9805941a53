"""What the device can do: its name, memory, natively supported precisions and backend flags.

Everything GPU-specific that the rest of the package needs to know goes through `Device`, so
tests can hand in a T4, an A100 or an H100 without owning one.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from hpo import faults
from hpo.config import PRECISIONS
from hpo.errors import ConfigError

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "none": None}

# Ampere (8.0) is the first CUDA generation with bf16 and TF32 tensor cores; older cards
# emulate bf16, which torch.cuda.is_bf16_supported() reports as supported unless told not to.
_AMPERE = (8, 0)
# Pascal (6.0) and newer run fp16 natively; all CUDA cards a training job would use today do.
_NATIVE_FP16 = (6, 0)

# Set by `hpo run --workers gpus:K` in each worker (or by hand, for K workers started on one
# GPU): K workers share the device, each with a stated share of its memory.
WORKERS_PER_GPU = "HPO_WORKERS_PER_GPU"
# The share of a device its workers' CUDA contexts and libraries' modules take, outside any
# allocator's cap: left out of the shares of a shared GPU, and what memory.foreign_bytes
# allows beside a worker before it calls the device shared.
CONTEXTS_SHARE = 0.05


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" or "cpu"
    name: str
    total_memory: int  # bytes
    compute_capability: tuple[int, int] | None = None
    index: int | None = None
    cpu_flags: frozenset[str] = field(default=frozenset(), repr=False)
    # Workers on this device, each given 1/sharing of it (`memory_fraction`): 1, the whole.
    sharing: int = 1

    @property
    def memory_fraction(self) -> float:
        """The share of the device's memory this worker's allocator may hold."""
        return 1.0 if self.sharing == 1 else (1 - CONTEXTS_SHARE) / self.sharing

    @property
    def usable_memory(self) -> int:
        """The bytes this worker's batches may use: the whole device, or its share."""
        return int(self.total_memory * self.memory_fraction)

    @property
    def native_bf16(self) -> bool:
        if self.type == "cuda":
            return self.compute_capability is not None and self.compute_capability >= _AMPERE
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    @property
    def native_fp16(self) -> bool:
        if self.type == "cuda":
            return self.compute_capability is not None and self.compute_capability >= _NATIVE_FP16
        return bool({"avx512_fp16", "amx_fp16"} & self.cpu_flags)

    @property
    def tf32(self) -> bool:
        return self.type == "cuda" and self.native_bf16

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(
            self.type
        )

    @property
    def cache_key(self) -> str:
        """Name, memory and share: two devices with all equal hold the same batch. A limit
        found under a share is the share's, never the whole card's."""
        share = f" 1/{self.sharing}" if self.sharing > 1 else ""
        return f"{self.name} {self.total_memory // 2**20}MiB{share}"

    @property
    def share(self) -> str | None:
        """This worker's share of the device in words, where it has one."""
        if self.sharing == 1:
            return None
        return (f"1/{self.sharing} share: {self.usable_memory / 2**30:.1f} GiB, one of "
                f"{self.sharing} workers")

    def describe(self) -> str:
        cc = f", compute {self.compute_capability[0]}.{self.compute_capability[1]}" if (
            self.compute_capability
        ) else ""
        share = f"; {self.share}" if self.share else ""
        return f"{self.type} ({self.name}{cc}, {self.total_memory / 2**30:.1f} GiB{share})"


def native_precisions(device: Device) -> tuple[str, ...]:
    """The precisions the device runs natively, in PRECISIONS order; `none` always."""
    native = {"fp16": device.native_fp16, "bf16": device.native_bf16, "none": True}
    return tuple(p for p in PRECISIONS if native[p])


def precision_name(precision: str) -> str:
    """A precision as users call it: `fp_precision: none` trains in fp32."""
    return "fp32" if precision == "none" else precision


def precision_names(precisions: tuple[str, ...] | list[str]) -> str:
    return ", ".join(precision_name(p) for p in precisions)


def autocast_dtype(precision: str) -> torch.dtype | None:
    return _DTYPES[precision]


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def detect(requested: str = "auto") -> Device:
    """The device a worker trains on: `auto` takes the first visible GPU, else the CPU."""
    sharing = workers_per_gpu()
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return Device(
            type="cpu",
            name=_cpu_name(),
            total_memory=psutil.virtual_memory().total,
            cpu_flags=read_cpu_flags(),
            sharing=sharing,
        )
    index = 0 if requested in ("auto", "cuda") else int(requested.split(":", 1)[1])
    props = torch.cuda.get_device_properties(index)
    return Device(
        type="cuda",
        name=props.name,
        total_memory=props.total_memory,
        compute_capability=(props.major, props.minor),
        index=index,
        sharing=sharing,
    )


def workers_per_gpu(environ: Mapping[str, str] = os.environ) -> int:
    """How many workers share this worker's GPU (HPO_WORKERS_PER_GPU), 1 where unset."""
    text = environ.get(WORKERS_PER_GPU, "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{WORKERS_PER_GPU} must be a whole number of workers, at least 1, "
                          f"got {text!r}")
    return int(text)


# NVIDIA's datasheet peaks in dense TFLOP/s (sparsity halved away) per precision: fp16 and
# bf16 on the tensor cores; `none` as hpo trains fp32 there, on TF32 tensor cores from Ampere
# on (configure_backends), plain FP32 before. An entry matches a device whose name holds all
# its words (A10 is not A10G); the first match wins.
_PEAK_TFLOPS: tuple[tuple[frozenset[str], dict[str, float]], ...] = tuple(
    (frozenset(words.split()), peaks) for words, peaks in (
        ("h100 pcie", {"fp16": 756.5, "bf16": 756.5, "none": 378.0}),
        ("h100 nvl", {"fp16": 835.5, "bf16": 835.5, "none": 417.5}),
        ("h100", {"fp16": 989.4, "bf16": 989.4, "none": 494.7}),  # SXM
        ("h200 nvl", {"fp16": 835.5, "bf16": 835.5, "none": 417.5}),
        ("h200", {"fp16": 989.4, "bf16": 989.4, "none": 494.7}),  # SXM
        ("a100", {"fp16": 312.0, "bf16": 312.0, "none": 156.0}),
        ("l40s", {"fp16": 362.05, "bf16": 362.05, "none": 183.0}),
        ("l4", {"fp16": 121.0, "bf16": 121.0, "none": 60.0}),
        ("a10", {"fp16": 125.0, "bf16": 125.0, "none": 62.5}),
        ("t4", {"fp16": 65.0, "none": 8.1}),
        ("v100 pcie", {"fp16": 112.0, "none": 14.0}),
        ("v100", {"fp16": 125.0, "none": 15.7}),  # SXM2
    ))


def peak_flops(device: Device, precision: str) -> float | None:
    """The device's datasheet peak in FLOP/s for training in `precision`, where hpo knows
    it: the GPUs of the table above; None for a CPU or another GPU."""
    if device.type != "cuda":
        return None
    words = set(re.split(r"[^a-z0-9]+", device.name.lower()))
    for needed, peaks in _PEAK_TFLOPS:
        if needed <= words:
            peak = peaks.get(precision)
            return peak * 1e12 if peak is not None else None
    return None


def visible_gpus() -> list[str]:
    """The GPUs a process started here can use, each as CUDA_VISIBLE_DEVICES names it: the
    variable's own entries (indices or UUIDs) where it is set, else 0 ... count-1. Counting
    creates no CUDA context."""
    faked = faults.gpu_count()
    if faked is not None:
        return [str(index) for index in range(faked)]
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(index) for index in range(count)]
    # CUDA stops at the first entry it cannot read; its count says how many it took.
    return [entry.strip() for entry in listed.split(",") if entry.strip()][:count]


# On a CPU, oneDNN compiles a kernel for every new (operation, precision, shape) and keeps it:
# up to 1,024 in its process-wide cache and 1,024 more per thread in ideep's, torch's layer over
# it, so a worker grew with each trial that brought new batch shapes or a new precision. Both
# are bounded through their documented variables, read once per process at its first oneDNN
# call. ideep's entries wrap oneDNN's, so keeping one costs a lookup, not a compilation; 64
# kept the demo study's trials as fast as 1,024 did (benchmarks/README.md).
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1"}


def configure_backends(device: Device) -> None:
    """Process-wide settings for the device, before its first training step: TF32 matmuls
    and cuDNN autotuning where they are free speed (Ampere and newer); on a CPU, bounded
    kernel caches, unless the user set those variables."""
    if device.type == "cpu":
        for name, value in CPU_KERNEL_CACHES.items():
            os.environ.setdefault(name, value)
    if device.type == "cuda" and device.sharing > 1:
        # The allocator itself refuses memory past the share: an OOM the batch search and
        # the executor handle, not a neighbour's crash.
        torch.cuda.set_per_process_memory_fraction(device.memory_fraction, device.index or 0)
    if device.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


@functools.cache
def fused_adamw(device_type: str) -> bool:
    """Whether torch has fused AdamW kernels for this kind of device (CUDA, and CPUs since
    torch 2.4; not every backend). Asked by one real step on a one-element parameter: torch
    checks the device only when a step first meets a parameter, and names no public list."""
    parameter = torch.nn.Parameter(torch.zeros(1, device=device_type))
    parameter.grad = torch.zeros_like(parameter)
    try:
        torch.optim.AdamW([parameter], fused=True).step()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None


def loader_settings(device: Device) -> LoaderSettings:
    # Batches are pre-tokenized lists, so collation is cheap: worker processes only pay off
    # when a GPU waits on the host; on a CPU they would steal the cores that train.
    if device.type == "cuda":
        workers = min(4, max(1, (os.cpu_count() or 2) // 2))
        return LoaderSettings(workers, pin_memory=True, persistent_workers=True, prefetch_factor=4)
    return LoaderSettings(0, pin_memory=False, persistent_workers=False, prefetch_factor=None)


def library_versions() -> dict[str, str]:
    import optuna
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "optuna": optuna.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
    }
