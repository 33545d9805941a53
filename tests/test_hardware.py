import json
import os
import subprocess
import sys
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


def test_a_share_of_a_gpu_has_its_own_memory_cache_key_and_words():
    from dataclasses import replace

    half = replace(H100, sharing=2)
    assert half.memory_fraction == pytest.approx(0.475)
    assert half.usable_memory == int(80 * 2**30 * 0.475)
    assert H100.usable_memory == H100.total_memory and H100.share is None
    # A limit found under a share is the share's, never the whole card's.
    assert half.cache_key == "NVIDIA H100 80GB HBM3 81920MiB 1/2" != H100.cache_key
    assert half.describe() == ("cuda (NVIDIA H100 80GB HBM3, compute 9.0, 80.0 GiB; 1/2 share: "
                               "38.0 GiB, one of 2 workers)")


@pytest.mark.parametrize(("value", "sharing"), [(None, 1), ("", 1), ("1", 1), ("4", 4)])
def test_the_workers_sharing_a_gpu_come_from_the_environment(value, sharing):
    environ = {} if value is None else {hardware.WORKERS_PER_GPU: value}
    assert hardware.workers_per_gpu(environ) == sharing


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_malformed_share_is_a_one_line_error(value):
    from hpo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"HPO_WORKERS_PER_GPU must be a whole number of "
                                          r"workers, at least 1, got "):
        hardware.workers_per_gpu({hardware.WORKERS_PER_GPU: value})


def test_a_shared_gpus_allocator_is_capped_at_the_workers_share(monkeypatch):
    from dataclasses import replace

    import torch

    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: capped.append((fraction, index)))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda _p: None)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    hardware.configure_backends(H100)
    assert capped == []
    hardware.configure_backends(replace(H100, sharing=4, index=1))
    assert capped == [(pytest.approx(0.95 / 4), 1)]


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


@pytest.fixture
def backend_flags():
    """TF32 and cuDNN flags set off for the test and restored after it, through torch's
    public setters (cudnn.flags restores on exit), not its flag objects' attributes."""
    import torch

    precision = torch.get_float32_matmul_precision()
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False,
                                    allow_tf32=False):
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(precision)


def test_backend_flags_on_ampere_only(backend_flags):
    import torch

    def flags():
        return (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark)

    hardware.configure_backends(T4)
    assert flags() == ("highest", False, False)
    hardware.configure_backends(A100)
    assert flags() == ("high", True, True)


def test_a_cpu_worker_bounds_the_kernel_caches():
    hardware.configure_backends(CPU_AVX2)
    for name, value in hardware.CPU_KERNEL_CACHES.items():
        assert os.environ[name] == value


def test_a_users_own_kernel_cache_settings_win(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")
    hardware.configure_backends(CPU_AVX512_BF16)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "4096"
    assert os.environ["LRU_CACHE_CAPACITY"] == hardware.CPU_KERNEL_CACHES["LRU_CACHE_CAPACITY"]


def test_a_gpu_worker_sets_no_cpu_variable(backend_flags):
    hardware.configure_backends(A100)
    assert not set(hardware.CPU_KERNEL_CACHES) & set(os.environ)


KERNEL_CACHE_GROWTH = """
import ctypes, gc, json, os, sys
import psutil, torch
from hpo import hardware

if sys.argv[1] == "bounded":
    hardware.configure_backends(hardware.detect("cpu"))
else:  # the capacities oneDNN and ideep have when nobody sets them
    os.environ.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
trim = ctypes.CDLL("libc.so.6").malloc_trim
torch.manual_seed(0)
conv = torch.nn.Conv1d(32, 32, 3)
rss = []
for trial in range(5):
    for length in range(8 + 200 * trial, 8 + 200 * (trial + 1)):  # new shapes every trial
        conv(torch.randn(2, 32, length, requires_grad=True)).sum().backward()
    gc.collect()
    trim(0)
    rss.append(psutil.Process().memory_info().rss / 2**20)
print(json.dumps(rss))
"""


def kernel_cache_growth(arm: str) -> float:
    """Resident memory a process gains over four trials of new convolution shapes (oneDNN
    compiles and caches kernels for convolutions on every x86 CPU), after its first."""
    result = subprocess.run([sys.executable, "-c", KERNEL_CACHE_GROWTH, arm],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    return rss[-1] - rss[0]


def test_bounded_kernel_caches_keep_a_cpu_workers_memory_flat():
    bounded, unbounded = kernel_cache_growth("bounded"), kernel_cache_growth("unbounded")
    assert bounded < 5 < unbounded, (bounded, unbounded)
