import dataclasses
import os

import pytest
from conftest import A100, CPU_AVX2, CPU_AVX512_BF16, H100, T4

from hpo import hardware
from hpo.app import hardware_report
from hpo.app.hardware_report import Measurement
from hpo.cli import main


@pytest.mark.parametrize(
    ("device", "support", "searched"),
    [
        (T4, {"fp16": "native", "bf16": "emulated", "tf32": "unsupported"}, ("fp16", "none")),
        (A100, {"fp16": "native", "bf16": "native", "tf32": "native"}, ("fp16", "bf16", "none")),
        (H100, {"fp16": "native", "bf16": "native", "tf32": "native"}, ("fp16", "bf16", "none")),
        (CPU_AVX2, {"fp16": "emulated", "bf16": "emulated", "tf32": "unsupported"}, ("none",)),
        (CPU_AVX512_BF16, {"fp16": "emulated", "bf16": "native", "tf32": "unsupported"},
         ("bf16", "none")),
    ],
)
def test_verdicts_for_mocked_devices(device, support, searched):
    report = hardware_report.inspect(device, measured=False)
    assert report.support == support
    assert report.searched == searched
    text = hardware_report.render(report)
    assert f"fp_precision: native searches {', '.join(searched)}" in text
    assert "fp_precision: auto (the default) searches those of them" in text


def test_t4_explains_why_bf16_is_left_out():
    text = hardware_report.render(hardware_report.inspect(T4, measured=False))
    assert "no  bf16: compute capability 7.5 is below 8.0: bf16 would be emulated" in text
    assert "yes fp16" in text


def test_real_cpu_run(capsys):
    assert main(["hardware", "--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device: cpu")
    for line in ("fp32:", "bf16:", "fp16:", "ms/step", "x fp32", "fp_precision: native searches",
                 "; for the small BERT above: "):
        assert line in out
    assert "fp16: emulated" in out or "fp16: native" in out
    # The worker's bounds, unless the environment set its own before (a user's value wins).
    expected = {k: os.environ.get(k, v) for k, v in hardware.CPU_KERNEL_CACHES.items()}
    assert "compiled-kernel caches: " + ", ".join(f"{k}={v}" for k, v in expected.items()) in out


def test_a_gpu_has_no_cpu_kernel_caches_to_report():
    assert "compiled-kernel caches" not in hardware_report.render(
        hardware_report.inspect(A100, measured=False))


def test_noisy_timings_are_warned_of_and_the_verdict_stays_with_the_capability():
    quiet = hardware_report.inspect(CPU_AVX512_BF16, measured=False)
    steps = (Measurement("none", 0.1, 1.0, 10.0, spread=0.05),
             Measurement("bf16", 0.7, 0.14, 8.0, spread=0.6),
             Measurement("fp16", 0.5, 0.2, 8.0, spread=0.1))
    busy = dataclasses.replace(quiet, measurements=steps, load_average=3.0, cores=2)
    assert hardware_report.noise_warnings(busy) == [
        "the machine was busy (load average 3.0 on 2 cores): other work slowed these timings",
        "bf16 step times varied by 60% between steps: noisy; measure again with more --steps "
        "on an idle machine",
    ]
    text = hardware_report.render(busy)
    # Measured at 0.14x fp32, bf16 is still native here, and searched.
    assert "\n  bf16: native\n" in text and "yes bf16" in text
    assert "\n  bf16:    700.0 ms/step   0.14x fp32" in text
    assert "warning: the machine was busy" in text and "warning: bf16 step times" in text
    idle = dataclasses.replace(busy, load_average=0.4, measurements=tuple(
        dataclasses.replace(m, spread=0.1) for m in steps))
    assert hardware_report.noise_warnings(idle) == []
    assert "warning" not in hardware_report.render(idle)


def test_a_gpu_times_a_base_size_bert_at_full_length_where_a_small_one_is_launch_bound():
    assert hardware_report.shape_for(CPU_AVX2) == hardware_report.SHAPES["cpu"]
    shape = hardware_report.shape_for(H100)
    assert (shape.hidden, shape.layers, shape.length) == (768, 12, 512)
    steps = (Measurement("none", 0.09, 1.0, 5000.0), Measurement("bf16", 0.04, 2.25, 3000.0),
             Measurement("fp16", 0.04, 2.25, 3000.0))
    report = dataclasses.replace(hardware_report.inspect(H100, measured=False),
                                 measurements=steps)
    text = hardware_report.render(report)
    assert ("a training step of a base-size BERT (12 layers of 768, batch 8 x 512 tokens)"
            in text)


def test_a_gpu_too_small_for_the_base_size_bert_times_the_small_one(monkeypatch):
    import torch

    shapes = []

    def measure(_device, _steps, shape):
        shapes.append(shape)
        if shape.hidden == 768:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return (Measurement("none", 0.01, 1.0, 100.0),)

    monkeypatch.setattr(hardware_report, "measure", measure)
    shape, measured = hardware_report.measure_fitting(H100, 3)
    assert shapes == [hardware_report.SHAPES["cuda"], hardware_report.SHAPES["cpu"]]
    assert shape == hardware_report.SHAPES["cpu"] and measured[0].precision == "none"

    def broken(_device, _steps, _shape):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(hardware_report, "measure", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        hardware_report.measure_fitting(H100, 3)
