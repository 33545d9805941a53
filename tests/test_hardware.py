from pathlib import Path

import pytest
from conftest import A100, CPU_AVX2, CPU_AVX512_BF16, H100, T4

from hpo import hardware
from hpo.hardware import Device


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (T4, ("fp16", "none")),
        (A100, ("fp16", "bf16", "none")),
        (H100, ("fp16", "bf16", "none")),
        (CPU_AVX2, ("none",)),
        (CPU_AVX512_BF16, ("bf16", "none")),
        (Device("cpu", "Sapphire Rapids", 2**34, cpu_flags=frozenset({"amx_bf16", "amx_fp16"})),
         ("fp16", "bf16", "none")),
    ],
)
def test_native_precisions(device, expected):
    assert hardware.native_precisions(device) == expected


def test_tf32_only_from_ampere():
    assert not T4.tf32 and A100.tf32 and H100.tf32 and not CPU_AVX512_BF16.tf32


def test_cache_key_names_device_and_memory():
    assert T4.cache_key == "Tesla T4 16384MiB"
    assert T4.cache_key != A100.cache_key


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert hardware.read_cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert hardware.read_cpu_flags(tmp_path / "missing") == frozenset()


def test_detect_on_this_machine_is_the_cpu():
    device = hardware.detect("cpu")
    assert device.type == "cpu" and device.total_memory > 0
    assert "none" in hardware.native_precisions(device)


def test_loader_settings_follow_the_device():
    assert hardware.loader_settings(CPU_AVX2).num_workers == 0
    gpu = hardware.loader_settings(A100)
    assert gpu.pin_memory and gpu.persistent_workers and gpu.num_workers >= 1


def test_backend_flags_on_ampere_only(monkeypatch):
    import torch

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    hardware.configure_backends(T4)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.benchmark
    hardware.configure_backends(A100)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
