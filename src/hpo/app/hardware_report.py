"""`hpo hardware`: what this device supports, a short measured training step per precision,
and which precisions `fp_precision: native` and `auto` search here, with the reason."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import psutil
import torch

from hpo.config import PRECISIONS, StudySection
from hpo.hardware import CPU_KERNEL_CACHES, Device, native_precisions
from hpo.space import CostChoice, by_cost

NATIVE, EMULATED, UNSUPPORTED = "native", "emulated", "unsupported"


# Timings are called noisy above this relative spread of one precision's step times, or
# when the load average says that other work held more than half of the cores.
NOISY_SPREAD = 0.25
BUSY_LOAD_PER_CORE = 0.5


@dataclass(frozen=True)
class Shape:
    """The BERT whose training step is timed, and its batch."""

    name: str
    hidden: int
    layers: int
    batch: int
    length: int

    def describe(self) -> str:
        return (f"{self.name} ({self.layers} layers of {self.hidden}, batch {self.batch} x "
                f"{self.length} tokens)")


# A CPU steps a small BERT in tens of milliseconds. On a GPU that step is launch-bound and
# ranks the precisions wrongly (benchmarks/README.md, "On a GPU"), so a GPU times a base-size
# BERT at full length; where that does not fit, the small one.
SHAPES = {"cpu": Shape("small BERT", 256, 2, 16, 64),
          "cuda": Shape("base-size BERT", 768, 12, 8, 512)}


def shape_for(device: Device) -> Shape:
    return SHAPES.get(device.type, SHAPES["cpu"])


def measure_fitting(device: Device, steps: int) -> tuple[Shape, tuple[Measurement, ...]]:
    """The device's shape measured, or the small BERT where that runs out of memory (a small
    card, a MIG slice, a GPU others use)."""
    from hpo.training.memory import is_oom, release_memory

    shape = shape_for(device)
    try:
        return shape, measure(device, steps, shape)
    except RuntimeError as exc:
        if not is_oom(exc) or shape == SHAPES["cpu"]:
            raise
    release_memory()  # outside the except block: its traceback no longer pins the tensors
    return SHAPES["cpu"], measure(device, steps, SHAPES["cpu"])


@dataclass(frozen=True)
class Measurement:
    precision: str
    step_seconds: float  # median over the timed steps
    speedup: float  # fp32 step time / this step time
    peak_memory_mb: float
    spread: float = 0.0  # (slowest - fastest) / median step time


@dataclass(frozen=True)
class Report:
    device: Device
    support: dict[str, str]  # fp16, bf16, tf32 -> native | emulated | unsupported
    measurements: tuple[Measurement, ...]
    searched: tuple[str, ...]  # by `native`: what the device runs natively
    reasons: dict[str, str]
    # By `auto` on the BERT measured here (`shape`), if it was: a study's own check decides
    # for its models.
    by_cost: CostChoice | None = None
    shape: Shape = SHAPES["cpu"]
    kernel_caches: dict[str, str] = field(default_factory=dict)  # CPU only: variable -> value
    load_average: float = 0.0  # 1-minute load average when the measurement began
    cores: int = 1


def support(device: Device) -> dict[str, str]:
    """Autocast runs fp16 and bf16 on every CUDA card and every CPU; where the hardware lacks
    the instructions it is emulated, which is slower than fp32."""
    native = native_precisions(device)
    result = {p: NATIVE if p in native else EMULATED for p in ("fp16", "bf16")}
    result["tf32"] = NATIVE if device.tf32 else UNSUPPORTED
    return result


def reasons(device: Device) -> dict[str, str]:
    native = native_precisions(device)
    if device.type == "cuda":
        cc = ".".join(map(str, device.compute_capability or (0, 0)))
        why = {
            "fp16": f"fp16 tensor cores on compute capability {cc}" if "fp16" in native
            else f"compute capability {cc} has no fast fp16",
            "bf16": f"bf16 tensor cores on compute capability {cc} (8.0+)" if "bf16" in native
            else f"compute capability {cc} is below 8.0: bf16 would be emulated",
        }
    else:
        flags = device.cpu_flags
        why = {
            "fp16": "AVX512-FP16/AMX-FP16 instructions" if "fp16" in native
            else "no AVX512-FP16 or AMX-FP16: fp16 would be emulated",
            "bf16": "AVX512-BF16/AMX-BF16 instructions" if "bf16" in native
            else "no AVX512-BF16 or AMX-BF16: bf16 would be emulated",
        }
        if not flags:
            why = {p: f"{p}: CPU flags unknown, assumed not native" for p in ("fp16", "bf16")}
    why["none"] = "fp32 runs everywhere"
    return why


def measure(device: Device, steps: int = 3, shape: Shape | None = None
            ) -> tuple[Measurement, ...]:
    """Time `steps` training steps of the `shape`'s BERT (the device's, `shape_for`) per
    precision, after one warm-up step; each precision's step time is the median of its
    steps."""
    from transformers import BertConfig, BertForSequenceClassification

    from hpo.training.train import autocast, optimizer_step

    torch.manual_seed(0)
    shape = shape or shape_for(device)
    batch, length = shape.batch, shape.length
    config = BertConfig(vocab_size=8000, hidden_size=shape.hidden,
                        num_hidden_layers=shape.layers, num_attention_heads=shape.hidden // 64,
                        intermediate_size=4 * shape.hidden, max_position_embeddings=512)
    config.num_labels = 9  # a property: the config's dataclass fields do not list it
    inputs = {
        "input_ids": torch.randint(0, 8000, (batch, length)),
        "attention_mask": torch.ones((batch, length), dtype=torch.long),
    }
    inputs = {k: v.to(device.torch_device) for k, v in inputs.items()}
    labels = torch.zeros((batch, 9), device=device.torch_device)
    results: dict[str, tuple[list[float], float]] = {}
    for precision in ("none", "bf16", "fp16"):
        # transformers wraps `to` in functools.wraps(Module.to), which mypy reads unbound.
        model = BertForSequenceClassification(config).to(device.torch_device)  # type: ignore[arg-type]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        before = _memory(device, reset=True)
        peak = before
        times: list[float] = []
        for step in range(steps + 1):
            started = time.perf_counter()
            with autocast(device, precision):
                logits = model(**inputs).logits.float()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            scaler.scale(loss).backward()
            optimizer_step(model, optimizer, scaler, 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize(device.torch_device)
            if step:  # the first step pays for allocation and kernel selection
                times.append(time.perf_counter() - started)
            peak = max(peak, _memory(device))
        results[precision] = (times, (peak - before) / 2**20)
    fp32 = statistics.median(results["none"][0])
    measured = []
    for precision in ("none", "bf16", "fp16"):
        times, memory = results[precision]
        median = statistics.median(times)
        measured.append(Measurement(precision, median, fp32 / median, memory,
                                    spread=(max(times) - min(times)) / median))
    return tuple(measured)


def _memory(device: Device, reset: bool = False) -> float:
    if device.type == "cuda":
        if reset:
            torch.cuda.reset_peak_memory_stats(device.torch_device)
        return float(torch.cuda.max_memory_allocated(device.torch_device))
    return float(psutil.Process().memory_info().rss)


def kernel_caches(device: Device) -> dict[str, str]:
    """The capacities of the compiled-kernel caches a worker on this CPU uses: the user's
    own setting of each variable, else hpo's."""
    if device.type != "cpu":
        return {}
    return {name: os.environ.get(name, value) for name, value in CPU_KERNEL_CACHES.items()}


def noise_warnings(report: Report) -> list[str]:
    """Why the timings may not show what the device can do: other work, or steps that vary."""
    warnings = []
    if report.load_average > BUSY_LOAD_PER_CORE * report.cores:
        warnings.append(f"the machine was busy (load average {report.load_average:.1f} on "
                        f"{report.cores} cores): other work slowed these timings")
    for m in report.measurements:
        if m.spread > NOISY_SPREAD:
            label = "fp32" if m.precision == "none" else m.precision
            warnings.append(f"{label} step times varied by {100 * m.spread:.0f}% between "
                            f"steps: noisy; measure again with more --steps on an idle machine")
    return warnings


TOLERANCE = StudySection.model_fields["precision_tolerance"].default


def inspect(device: Device, steps: int = 3, measured: bool = True) -> Report:
    load_average = os.getloadavg()[0]
    native = native_precisions(device)
    shape, measurements = measure_fitting(device, steps) if measured else (
        shape_for(device), ())
    seconds = {shape.name: {m.precision: m.step_seconds for m in measurements
                            if m.precision in native}}
    return Report(
        device=device,
        support=support(device),
        measurements=measurements,
        searched=native,
        reasons=reasons(device),
        by_cost=by_cost(seconds, native, TOLERANCE) if measurements else None,
        kernel_caches=kernel_caches(device),
        load_average=load_average,
        cores=os.cpu_count() or 1,
        shape=shape,
    )


def render(report: Report) -> str:
    device = report.device
    lines = [f"device: {device.describe()}"]
    if device.type == "cpu":
        lines.append(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}")
    lines.append("capability (what fp_precision: auto goes by):")
    for name in ("fp16", "bf16", "tf32"):
        lines.append(f"  {name}: {report.support[name]}")
    if report.measurements:
        memory = "peak memory" if device.type == "cuda" else "resident memory growth"
        lines.append(f"measured, separately: a training step of a "
                     f"{report.shape.describe()}, median step time, {memory}:")
        for m in report.measurements:
            label = "fp32" if m.precision == "none" else m.precision
            lines.append(f"  {label:>4}: {1000 * m.step_seconds:8.1f} ms/step  "
                         f"{m.speedup:5.2f}x fp32  {m.peak_memory_mb:7.1f} MiB")
        lines += [f"warning: {text}" for text in noise_warnings(report)]
    if report.kernel_caches:
        lines.append("compiled-kernel caches: " + ", ".join(
            f"{name}={value}" for name, value in report.kernel_caches.items()))
    searched = ", ".join(report.searched)
    lines.append(f"fp_precision: native searches {searched} on this device:")
    for precision in PRECISIONS:
        mark = "yes" if precision in report.searched else "no "
        lines.append(f"  {mark} {precision}: {report.reasons[precision]}")
    auto = (f"fp_precision: auto (the default) searches those of them whose training step "
            f"a study's check measures within {TOLERANCE:.0%} of the fastest, summed over its "
            f"models")
    choice = report.by_cost
    if choice is not None:
        auto += f"; for the {report.shape.name} above: {', '.join(choice.kept)}"
        auto += "".join(f" (not {p}: {why})" for p, why in choice.dropped.items())
    lines.append(auto)
    return "\n".join(lines)
