import ctypes
import mmap
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpo import onednn

linux_wheel = pytest.mark.skipif(
    onednn._loaded_library() is None, reason="torch's libtorch_cpu.so is not mapped from a file"
)
# oneDNN's internal count of cached primitives, for the tests only.
CACHE_SIZE = "_ZN4dnnl4impl24get_primitive_cache_sizeEPi"


def run(script: str, *args: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "LRU_CACHE_CAPACITY"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, check=True, env={**environment, **env}).stdout.strip()


def library():
    return onednn._loaded_library().path


def cached_primitives() -> int:
    function = onednn.function_addresses(library(), (CACHE_SIZE,))[CACHE_SIZE]
    size = ctypes.c_int(-1)
    call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(
        onednn.load_bias(library()) + function.address)
    assert call(ctypes.byref(size)) == 0
    return size.value


@linux_wheel
def test_the_functions_are_found_where_nm_finds_them():
    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not installed")
    listed = subprocess.run(["nm", str(library())], capture_output=True, text=True).stdout
    expected = {}
    for fields in map(str.split, listed.splitlines()):
        if len(fields) == 3 and fields[1] in "tT" and fields[2] in (onednn._GET, onednn._SET):
            expected[fields[2]] = int(fields[0], 16)
    assert len(expected) == 2
    found = onednn.function_addresses(library(), (onednn._GET, onednn._SET))
    assert {name: f.address for name, f in found.items()} == expected


@linux_wheel
def test_the_load_bias_is_where_the_library_starts_in_memory():
    maps = Path("/proc/self/maps").read_text().splitlines()
    first = next(line for line in maps
                 if line.endswith(str(library())) and line.split()[2] == "00000000")
    assert onednn.load_bias(library()) == int(first.split("-")[0], 16)


@linux_wheel
def test_the_cache_is_emptied_and_keeps_its_capacity():
    api = onednn.cache_api()
    assert api is not None, "oneDNN's cache functions were not found"
    get, _ = api
    capacity = ctypes.c_int()
    assert get(ctypes.byref(capacity)) == 0
    for batch in (1, 2):  # fp32 convolutions run through oneDNN on every x86 CPU
        torch.nn.Conv2d(3, 4, 3)(torch.randn(batch, 3, 8, 8)).sum().backward()
    assert cached_primitives() > 0
    assert onednn.clear_primitive_cache()
    assert cached_primitives() == 0
    after = ctypes.c_int()
    get(ctypes.byref(after))
    assert after.value == capacity.value > 0


@linux_wheel
def test_code_that_differs_from_the_file_is_never_called(monkeypatch):
    """A library reinstalled since it was loaded, or a wrong address: refused before a call."""
    real = onednn.function_addresses
    altered = {name: f._replace(code=bytes(reversed(f.code)))
               for name, f in real(library(), (onednn._GET, onednn._SET)).items()}
    resolve = onednn._resolve.__wrapped__  # not the worker's cached answer
    assert resolve(onednn._loaded_library()) is not None
    monkeypatch.setattr(onednn, "function_addresses", lambda path, names: altered)
    assert resolve(onednn._loaded_library()) is None
    monkeypatch.setattr(onednn, "function_addresses", real)
    assert resolve(onednn._loaded_library()._replace(executable=((0, 4096),))) is None


def elf_header(section_table: int, sections: int = 1) -> bytearray:
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", header, onednn._E_TYPE, onednn._ET_DYN)
    struct.pack_into("<Q", header, onednn._E_SHOFF, section_table)
    struct.pack_into("<HH", header, onednn._E_SHENTSIZE, onednn._SECTION.size, sections)
    return header


def symtab_linking_to(link: int) -> bytes:
    return onednn._SECTION.pack(0, onednn._SHT_SYMTAB, 0, 0, 0, 0, link, 0, 8, 24)


@pytest.mark.parametrize(
    "content",
    [
        b"MZ" + bytes(100),  # not ELF
        b"\x7fELF",  # cut short
        bytes(elf_header(section_table=10_000)),  # section table past the end
        bytes(elf_header(section_table=64)) + symtab_linking_to(7),  # no such string table
        bytes(elf_header(section_table=64)) + symtab_linking_to(0),  # links to itself
    ],
    ids=["not-elf", "cut-short", "table-past-end", "no-string-table", "self-link"],
)
def test_a_malformed_library_gives_no_api(tmp_path, content):
    fake = tmp_path / onednn._LIBRARY
    fake.write_bytes(content)
    assert onednn._resolve.__wrapped__(onednn.Mapping(fake, ((0, 1),))) is None


def test_a_stripped_library_has_no_functions(tmp_path):
    fake = tmp_path / onednn._LIBRARY
    fake.write_bytes(bytes(elf_header(section_table=64)) + bytes(onednn._SECTION.size))
    assert onednn.function_addresses(fake, (onednn._GET,)) == {}


def test_a_mapped_file_whose_name_is_not_utf8_is_no_trouble(tmp_path):
    odd = os.path.join(os.fsencode(tmp_path), b"\xff.bin")
    with open(odd, "wb") as file:
        file.write(bytes(4096))
    with open(odd, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ):
        onednn._loaded_library()
        onednn.clear_primitive_cache()


def test_ideeps_capacity_is_set_on_import_unless_the_user_set_it():
    script = "import os, hpo; print(os.environ['LRU_CACHE_CAPACITY'])"
    assert run(script) == "1"
    assert run(script, LRU_CACHE_CAPACITY="64") == "64"


@linux_wheel
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="bf16 matmuls run through oneDNN only on AVX512 and AMX CPUs")
def test_resident_memory_is_flat_over_trials_with_new_batch_shapes():
    """Six trials of bf16 steps, each at eight batch sizes the last did not use, in a fresh
    process: with the cache emptied after each trial memory stays where the first left it; the
    control arm, whose cache is kept, grows by its compiled kernels."""
    script = """
import sys, torch
from hpo import memory, onednn
if sys.argv[1] == "kept":
    onednn.clear_primitive_cache = lambda: False
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
def rss():
    status = open("/proc/self/status").read().split("VmRSS:")[1]
    return int(status.split()[0]) / 1024
def trial(batches):
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(batch, 7, 256)).float().sum().backward()
    memory.release_memory()
trial(range(1, 9))
first = rss()
for t in range(1, 6):
    trial(range(8 * t + 1, 8 * t + 9))
print(rss() - first)
"""
    emptied, kept = float(run(script, "emptied")), float(run(script, "kept"))
    assert emptied < 4  # MiB; 0.2 measured
    assert kept > 30  # 63 measured
