import gc
import weakref

import pytest
import torch

from hpo.training import memory


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("anything"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."),
        RuntimeError("CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                     "memory: you tried to allocate 1099511627776 bytes."),
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"),
    ],
)
def test_oom_is_recognised(exc):
    assert memory.is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
        RuntimeError(),
        ValueError("CUDA out of memory"),  # only RuntimeErrors carry allocator messages
        KeyError("x"),
    ],
)
def test_other_errors_are_not_oom(exc):
    assert not memory.is_oom(exc)


def test_real_cpu_allocation_failure_is_oom():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert memory.is_oom(exc)
    else:
        pytest.skip("the allocator accepted 4 EiB")


def test_memory_is_released_after_a_failed_probe_only(monkeypatch):
    released = []
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(True))
    def step(batch: int) -> None:
        if batch > 3:
            raise torch.OutOfMemoryError(f"CUDA out of memory at {batch}")

    assert not memory.fits(step, 4)
    assert len(released) == 1
    assert memory.fits(step, 3)
    assert len(released) == 1


def test_objects_are_frozen_within_the_block_and_given_back_after():
    class Node:
        pass

    kept = Node()
    kept.itself = kept
    with memory.long_lived_frozen():
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made in the block is collected as usual
        made_within = weakref.ref(a)
        del a, b
        gc.collect()
        assert made_within() is None
        frozen_cycle = weakref.ref(kept)
        del kept  # a cycle frozen at the start is not, until the block ends
        gc.collect()
        # Still frozen: collecting in the block gives back nothing frozen. (The freeze count
        # is no measure of that: a frozen object that another thread or a finalizer lets go
        # of is freed by its reference count and leaves the count, as one CI run saw.)
        assert frozen_cycle() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert frozen_cycle() is None


def test_no_memory_probe_on_a_cpu():
    from conftest import CPU_AVX2

    assert memory.device_memory_probe(CPU_AVX2) is None


def test_releasing_memory_collects_empties_the_gpu_cache_and_trims_the_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(memory.gc, "collect", lambda: calls.append("gc"))
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: calls.append(("trim", pad)))
    memory.release_memory()
    assert calls == ["gc", "empty_cache", ("trim", 0)]


def test_a_trials_device_memory_is_read_on_cuda_and_nowhere_else(monkeypatch):
    from hpo.hardware import Device

    cpu = Device("cpu", "cpu", 2**34, None)
    assert memory.device_memory(cpu) is None and memory.after_trial(cpu, None) is None
    # A CUDA device's allocator counts, faked: 512 MiB before, a 3 GiB peak, 512 MiB after.
    counts = {"allocated": 512 * 2**20, "peak": 3 * 2**30, "resets": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _index: counts["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda _index: counts["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda _index: counts.__setitem__("resets", counts["resets"] + 1))
    gpu = Device("cuda", "NVIDIA H100", 80 * 2**30, (9, 0))
    mark = memory.device_memory(gpu)
    memory.restart_peak(gpu)  # after the batch search: training's peak alone
    assert counts["resets"] == 2
    assert memory.after_trial(gpu, mark).to_attrs() == {
        "memory_before_mib": 512.0, "peak_memory_mib": 3072.0, "memory_after_mib": 512.0}


def test_a_steps_memory_is_its_peak_above_what_the_process_held():
    """On a Linux host the peak resident memory is reset before the step, and the pages freed
    before it returned, so a step that reuses freed memory still reads as needing it."""
    from conftest import CPU_AVX2

    held = torch.ones(64 * 2**20 // 4)  # held throughout: not the step's

    def step() -> None:
        torch.ones(256 * 2**20 // 4).add_(1)  # 256 MiB, freed as the step returns

    for _ in range(2):
        needed = memory.step_memory(CPU_AVX2, step)
        assert 240 * 2**20 < needed < 320 * 2**20
    assert memory.step_memory(CPU_AVX2, lambda: None) < 32 * 2**20
    assert memory.free_bytes(CPU_AVX2) > 0
    del held


def test_a_gpu_steps_memory_is_its_allocators_peak_above_what_was_allocated(monkeypatch):
    from conftest import H100

    counts = {"allocated": 512 * 2**20, "peak": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _index: counts["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda _index: counts["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda _index: counts.__setitem__("peak", counts["allocated"]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _index: (70 * 2**30, 80 * 2**30))

    def step() -> None:
        counts["peak"] = counts["allocated"] + 3 * 2**30

    assert memory.step_memory(H100, step) == 3 * 2**30
    assert memory.free_bytes(H100) == 70 * 2**30


def test_memory_other_processes_hold_on_a_gpu_is_what_is_used_beyond_this_ones(monkeypatch):
    from conftest import CPU_AVX2, H100

    state = {"free": 80 * 2**30 - 2**30, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _index: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _index: state["reserved"])
    # Alone: this process's context (1 GiB here) is no other process's.
    assert memory.foreign_bytes(H100) == 0
    # Its own reserve, however large, is its own.
    state.update(free=10 * 2**30, reserved=69 * 2**30)
    assert memory.foreign_bytes(H100) == 0
    # An isolating parent's context beside the child's: within 5% of the 80 GiB.
    state.update(free=77 * 2**30 + 2**29, reserved=0)
    assert memory.foreign_bytes(H100) == 0
    # Another worker holding 40 GiB beside this one's context.
    state.update(free=39 * 2**30, reserved=0)
    assert memory.foreign_bytes(H100) == 41 * 2**30
    assert memory.foreign_bytes(CPU_AVX2) == 0


def test_on_a_shared_gpu_only_memory_beyond_the_other_workers_shares_is_foreign(monkeypatch):
    from dataclasses import replace

    from conftest import H100

    half = replace(H100, sharing=2)
    state = {"free": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _index: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _index: state["reserved"])
    # The other worker holds its whole share (38 GiB) and both contexts 2 GiB: as asked.
    state.update(free=80 * 2**30 - 40 * 2**30 - 10 * 2**30, reserved=10 * 2**30)
    assert memory.foreign_bytes(half) == 0
    # A process nobody declared holds 20 GiB more: that much is foreign, and warned of.
    state.update(free=80 * 2**30 - 60 * 2**30 - 10 * 2**30)
    assert memory.foreign_bytes(half) == 60 * 2**30 - int(80 * 2**30 * 0.475)
    # The batch search sizes for the share, less what is foreign.
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda _index: None)
    assert memory.device_memory_probe(half).capacity == int(0.95 * half.usable_memory)
    assert memory.device_memory_probe(H100).capacity == int(0.95 * H100.total_memory)


def test_the_memory_model_sizes_for_what_other_processes_leave(monkeypatch):
    from conftest import H100

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda _index: None)
    alone = memory.device_memory_probe(H100)
    shared = memory.device_memory_probe(H100, foreign=40 * 2**30)
    assert alone is not None and shared is not None
    assert alone.capacity == int(0.95 * 80 * 2**30)
    assert shared.capacity == int(0.95 * 40 * 2**30)
