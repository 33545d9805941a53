"""oneDNN's kernel caches, kept from growing across trials.

On a CPU, torch runs reduced-precision matmuls (and convolutions at every precision) through
oneDNN, which compiles a primitive for every new (operation, precision, shape) and keeps it in a
process-wide cache of 1,024 primitives; ideep, torch's layer over oneDNN, keeps up to 1,024
more per thread. Trials that brought a new batch size or precision each left up to 50 MiB
behind in a worker. torch offers no control over either cache at run time, so:

- ideep's capacity is read from LRU_CACHE_CAPACITY at the thread's first oneDNN operation;
  importing hpo sets it to 1. oneDNN's own cache still spares every step its kernel builds.
- oneDNN's cache is emptied after every trial through oneDNN's own C API
  (`dnnl_set_primitive_cache_capacity`), which libtorch_cpu.so links in but does not export:
  the function is found in the library's symbol table, and called only once the code at that
  address in the process is the code the file holds there. Where the table is stripped, or on
  a platform without /proc and dlinfo, nothing is emptied: the cache stays bounded by its
  capacity, as it is without hpo.

The remedy torch's maintainers give (pytorch#98688), ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 with
LRU_CACHE_CAPACITY=1, rebuilds every kernel on every call: 14-23% slower bf16 steps here. A
small capacity instead would only lower the ceiling.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

_LIBRARY = "libtorch_cpu.so"
_SET, _GET = "dnnl_set_primitive_cache_capacity", "dnnl_get_primitive_cache_capacity"
_DNNL_SUCCESS = 0
_COMPARED_BYTES = 32

# ELF64, little-endian (elf.h): header fields, section header and symbol layouts, constants.
_E_TYPE, _E_SHOFF, _E_SHENTSIZE = 0x10, 0x28, 0x3A
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_ET_DYN, _SHT_SYMTAB, _SHT_STRTAB, _STT_FUNC, _RTLD_DI_LINKMAP = 3, 2, 3, 2, 2

# Two trials clearing at once could otherwise leave the capacity at 0 for good.
_lock = threading.Lock()


class Section(NamedTuple):
    name: int
    type: int
    flags: int
    address: int
    offset: int
    size: int
    link: int
    info: int
    align: int
    entry_size: int


class Function(NamedTuple):
    address: int  # link-time address; the loader adds the library's load bias
    code: bytes  # its first bytes in the file, to be found at that address in the process


class Mapping(NamedTuple):
    path: Path
    executable: tuple[tuple[int, int], ...]  # [start, end) of the library's code mappings


def bound_ideep_cache() -> None:
    """Hold ideep's per-thread primitive cache to one entry; a user's own setting wins."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", "1")


def clear_primitive_cache() -> bool:
    """Empty oneDNN's primitive cache, keeping its capacity; True when it was emptied."""
    api = cache_api()
    if api is None:
        return False
    get, set_ = api
    capacity = ctypes.c_int()
    with _lock:
        if get(ctypes.byref(capacity)) != _DNNL_SUCCESS:
            return False
        return set_(0) == _DNNL_SUCCESS and set_(capacity.value) == _DNNL_SUCCESS


def cache_api() -> tuple[Callable, Callable] | None:
    """oneDNN's get and set of the primitive cache capacity, or None where they are out of
    reach (torch not loaded yet, a stripped library, no /proc or dlinfo)."""
    mapping = _loaded_library()
    return None if mapping is None else _resolve(mapping)


@functools.cache
def _resolve(mapping: Mapping) -> tuple[Callable, Callable] | None:
    try:
        functions = function_addresses(mapping.path, (_GET, _SET))
        bias = load_bias(mapping.path)
        if bias is None or len(functions) != 2:
            return None
        if not all(_code_matches(bias, f, mapping) for f in functions.values()):
            return None
    except (OSError, ValueError, AttributeError, IndexError, struct.error):
        return None
    get = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(
        bias + functions[_GET].address)
    set_ = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(bias + functions[_SET].address)
    probe = ctypes.c_int(-1)
    if get(ctypes.byref(probe)) != _DNNL_SUCCESS or probe.value < 0:
        return None
    return get, set_


def _code_matches(bias: int, function: Function, mapping: Mapping) -> bool:
    """The process holds the file's code at bias + address: the library on disk is the one
    loaded (not one reinstalled since), and the address is right."""
    start = bias + function.address
    if not any(low <= start and start + _COMPARED_BYTES <= high
               for low, high in mapping.executable):
        return False
    return ctypes.string_at(start, _COMPARED_BYTES) == function.code


def _loaded_library() -> Mapping | None:
    """The libtorch_cpu.so this process has mapped (not merely one on disk)."""
    try:
        maps = os.fsdecode(Path("/proc/self/maps").read_bytes())
    except OSError:
        return None
    path, executable = None, []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith("/" + _LIBRARY):
            path = path or fields[5]
            if fields[5] == path and "r" in fields[1] and "x" in fields[1]:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                executable.append((low, high))
    return Mapping(Path(path), tuple(executable)) if path and executable else None


def function_addresses(path: Path, names: tuple[str, ...]) -> dict[str, Function]:
    """The named functions of a shared ELF64 library's symbol table ({} when stripped)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4:6] != b"\x02\x01":
            raise ValueError(f"{path} is not a little-endian ELF64 file")
        if struct.unpack_from("<H", elf, _E_TYPE)[0] != _ET_DYN:
            raise ValueError(f"{path} is not a shared library")
        (table,) = struct.unpack_from("<Q", elf, _E_SHOFF)
        entry_size, count = struct.unpack_from("<HH", elf, _E_SHENTSIZE)
        sections = [Section(*_SECTION.unpack_from(elf, table + i * entry_size))
                    for i in range(count)]
        symtab = next((s for s in sections if s.type == _SHT_SYMTAB), None)
        if symtab is None:
            return {}
        strings = sections[symtab.link]
        if strings.type != _SHT_STRTAB:
            raise ValueError(f"{path}: the symbol table links to no string table")
        found = {}
        for name in names:
            at = elf.find(b"\0" + name.encode() + b"\0", strings.offset,
                          strings.offset + strings.size)
            if at >= 0:
                function = _find_function(elf, symtab, sections, at + 1 - strings.offset)
                if function is not None:
                    found[name] = function
        return found


def _find_function(elf: mmap.mmap, symtab: Section, sections: list[Section],
                   name: int) -> Function | None:
    key, end = struct.pack("<I", name), symtab.offset + symtab.size
    at = elf.find(key, symtab.offset, end)
    while at >= 0:
        if (at - symtab.offset) % _SYMBOL.size == 0:
            _, info, _, index, value, _ = _SYMBOL.unpack_from(elf, at)
            if info & 0xF == _STT_FUNC and 0 < index < len(sections) and value:
                home = sections[index]
                offset = value - home.address + home.offset
                return Function(value, elf[offset:offset + _COMPARED_BYTES])
        at = elf.find(key, at + 1, end)
    return None


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_size_t)]  # the leading field of glibc's struct link_map


def load_bias(path: Path) -> int | None:
    """Where the dynamic loader placed the already-loaded library (its link map's l_addr)."""
    handle = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    link_map = ctypes.POINTER(_LinkMap)()
    if ctypes.CDLL(None).dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP,
                                ctypes.byref(link_map)) != 0:
        return None
    return link_map.contents.l_addr
