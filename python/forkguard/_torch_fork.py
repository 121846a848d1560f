"""torch's own fork poison, seen from the process that holds it, without initializing anything.

A CUDA build of torch registers, at its first device count (``torch._C._cuda_getDeviceCount``:
``torch.cuda.is_available()``, ``device_count()`` when NVML cannot count) or CUDA init, a
``pthread_atfork`` child handler that marks every later fork child "in a bad fork": there
``torch._C._cuda_isInBadFork()`` is True and torch's first CUDA use raises "Cannot re-initialize
CUDA in forked subprocess". It does so on a machine with no GPU or driver too, where no libcuda is
mapped and the driver-level probe says ``clean``. torch keeps no Python-side trace of it (measured
on 2.14.1: nothing in ``torch.cuda``'s namespace changes). Its C++ does: torch 2.14's
``torch/csrc/utils/device_lazy_init.cpp`` sets ``at_fork_registered[device type]`` (a ``bool``
array in an anonymous namespace) before it registers the handler once.

That array is not exported, but libtorch_python.so's wheels keep their ``.symtab``. So it is read
in place: the symbol's value from the file's symbol table, the load bias from an exported symbol
of the same table (``torch::utils::is_device_in_bad_fork``, whose address ``dlsym`` gives on the
copy already loaded, ``RTLD_NOLOAD``), checked against the mapping's inode and permissions, then
one byte read. Resolved once per process (about 10-60 ms, mmap of the file); each check after is a
byte read (0.6 us). Nothing is loaded, called or written. A probe fork (a child that asks
torch._C._cuda_isInBadFork()) was measured and rejected: 34-68 ms per check for a 500 MB torch
process, and every library's pthread_atfork handlers run in this process (docs/probe.md).

Where it cannot be read (a stripped libtorch_python, a torch whose internals differ, a file
replaced on disk since it was loaded) the answer says so in ``notes``; ``torch.cuda._initialized``
(torch's own lazy init done, which registers the handler first) is then the only evidence left.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
from typing import List, NamedTuple, Optional, Tuple

# c10::DeviceType::CUDA (c10/core/DeviceType.h): index into torch's per-device arrays.
_CUDA = 1
_REGISTERED = "_ZN5torch5utils12_GLOBAL__N_118at_fork_registeredE"
_BAD_FORK = "_ZN5torch5utils12_GLOBAL__N_114is_in_bad_forkE"
_ANCHOR = "_ZN5torch5utils21is_device_in_bad_forkEN3c1010DeviceTypeE"  # exported, same table
_REGISTERED_NAME = "torch::utils::(anonymous namespace)::at_fork_registered[CUDA]"

POISONED = "torch_fork_poisoned"  # this process's fork children are in torch's bad fork
BAD_FORK = "torch_bad_fork"  # this process itself is in torch's bad fork (and its children)

SUMMARIES = {
    POISONED: "torch has registered its fork poison here (torch's flag, not the driver's): a "
              "child forked from this process is in a bad fork, and its first CUDA use raises "
              "\"Cannot re-initialize CUDA in forked subprocess\", even where no GPU or driver "
              "is present.",
    BAD_FORK: "This process was forked after its parent registered torch's fork poison: torch's "
              "first CUDA use here raises \"Cannot re-initialize CUDA in forked subprocess\" "
              "(torch's flag, not the driver's), and so does its forked children's.",
}

CURES = [
    "forkguard.guard(): multiprocessing's fork children (DataLoader workers, Pool, "
    "accelerate's notebook_launcher) then start from its clean interpreter fork server",
    "ask torch.cuda.is_available() / device_count() in the children, after the fork, not in the "
    "parent before it (accelerate >= 1.14 no longer asks in notebook_launcher, its PR #4059)",
    "PYTORCH_NVML_BASED_CUDA_CHECK=1 before the first torch.cuda.is_available(): torch then "
    "counts through NVML and registers no poison, but only where NVML can count (a GPU and its "
    "driver); without them torch falls back to its own count and registers it anyway",
]

_EvidenceTuple = Tuple[str, str, str]


class TorchForkState(NamedTuple):
    """``verdict``: POISONED, BAD_FORK or None (no poison seen); ``evidence`` as (kind, detail,
    source) tuples; ``notes``: what could not be checked."""

    verdict: Optional[str]
    evidence: List[_EvidenceTuple]
    notes: List[str]


_NOTHING = TorchForkState(None, [], [])
# Resolved once; no lock: two threads resolving at once find the same, and a lock held by another
# thread at a fork would stay held in the child.
_resolved = False
_flags: Optional[Tuple[object, object, str]] = None  # (registered array, bad-fork array, path)
_unreadable: Optional[str] = None  # why the flags cannot be read, once resolved


def state() -> TorchForkState:
    """torch's fork poison in this process. Nothing when torch is not imported or has no CUDA
    build (torch 1.13 in Debian: no ``_cuda_getDeviceCount``, no poison)."""
    torch_c = sys.modules.get("torch._C")
    if torch_c is None or not hasattr(torch_c, "_cuda_getDeviceCount"):
        return _NOTHING
    flags = _resolve()
    evidence: List[_EvidenceTuple] = []
    notes: List[str] = []
    registered = bad = False
    bad_source = "torch._C._cuda_isInBadFork()"
    if flags is not None:
        reg_array, bad_array, path = flags
        registered = bool(reg_array[_CUDA])
        if registered:
            evidence.append((
                "torch_fork_poison",
                "torch's CUDA fork handler is registered (by torch._C._cuda_getDeviceCount: "
                "torch.cuda.is_available(), device_count() when NVML cannot count, or torch's "
                "CUDA init): every child fork()ed from here has torch._C._cuda_isInBadFork() "
                "True and fails at its first CUDA use",
                f"{_REGISTERED_NAME} = 1 in {path} (.symtab)"))
        bad = bool(bad_array[_CUDA])  # what torch._C._cuda_isInBadFork() reads
        bad_source = (f"torch::utils::(anonymous namespace)::is_in_bad_fork[CUDA] = 1 in {path} "
                      "(.symtab), what torch._C._cuda_isInBadFork() returns")
    else:
        notes.append(f"torch's fork poison (registered by torch.cuda.is_available() on a CUDA "
                     f"build, even without a GPU) cannot be read here: {_unreadable}")
        cuda = sys.modules.get("torch.cuda")
        if cuda is not None and getattr(cuda, "_initialized", False) is True:
            registered = True
            evidence.append((
                "torch_fork_poison",
                "torch.cuda's lazy init has run (it registers torch's CUDA fork handler first): "
                "every child fork()ed from here is in a bad fork",
                "torch.cuda._initialized"))
    is_in_bad_fork = getattr(torch_c, "_cuda_isInBadFork", None)
    if flags is None and is_in_bad_fork is not None:
        bad = bool(is_in_bad_fork())  # reads torch's flag; initializes nothing
    if bad:
        evidence.append((
            "torch_bad_fork",
            "this process is in torch's bad fork: forked after its parent registered torch's "
            "CUDA fork handler; torch's first CUDA use here raises \"Cannot re-initialize CUDA "
            "in forked subprocess\"",
            bad_source))
        return TorchForkState(BAD_FORK, evidence, notes)
    return TorchForkState(POISONED if registered else None, evidence, notes)


def _resolve():
    global _resolved, _flags, _unreadable
    if not _resolved:
        try:
            _flags = _read_flags()
        except _Unreadable as e:
            _unreadable = str(e)
        except (OSError, ValueError, struct.error) as e:
            _unreadable = f"{type(e).__name__}: {e}"
        _resolved = True
    return _flags


class _Unreadable(Exception):
    pass


def _mapping_of(basename_prefix: str):
    """(path, inode) of the first mapped library whose basename starts so."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(basename_prefix):
                return parts[5].strip(), int(parts[4])
    return None, None


def _mapped_rw(lo: int, hi: int) -> bool:
    """[lo, hi) lies in one readable and writable mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 2)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= lo and hi <= end:
                return parts[1].startswith("rw")
    return False


def _elf(path: str, names):
    """({name: (st_value, st_size, st_info)} from the ELF file's .symtab, [(p_vaddr, p_memsz)]
    of its writable PT_LOAD segments). 64-bit little-endian only."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            raise _Unreadable(f"{path} is not a 64-bit little-endian ELF file")
        phoff, shoff = struct.unpack_from("<QQ", m, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", m, 0x36)
        writable = []
        for i in range(phnum):
            p_type, p_flags, _, p_vaddr, _, _, p_memsz, _ = struct.unpack_from(
                "<IIQQQQQQ", m, phoff + i * phentsize)
            if p_type == 1 and p_flags & 2:  # PT_LOAD, PF_W
                writable.append((p_vaddr, p_memsz))
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize)
                    for i in range(shnum)]
        symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
        if symtab is None:
            raise _Unreadable(f"{path} has no symbol table (.symtab: a stripped build)")
        strtab = sections[symtab[6]]
        str_lo, str_hi = strtab[4], strtab[4] + strtab[5]
        sym_lo, sym_hi, entsize = symtab[4], symtab[4] + symtab[5], symtab[9] or 24
        found = {}
        for name in names:
            at = m.find(b"\0" + name.encode() + b"\0", str_lo, str_hi)
            if at < 0:
                continue
            key = struct.pack("<I", at + 1 - str_lo)
            i = m.find(key, sym_lo, sym_hi)
            while i >= 0 and (i - sym_lo) % entsize:
                i = m.find(key, i + 1, sym_hi)
            if i >= 0:
                _, info, _, shndx, value, size = struct.unpack_from("<IBBHQQ", m, i)
                if shndx != 0:
                    found[name] = (value, size, info)
        return found, writable


def _read_flags():
    path, inode = _mapping_of("libtorch_python.so")
    if path is None:
        raise _Unreadable("libtorch_python.so is not mapped")
    if os.stat(path).st_ino != inode:
        raise _Unreadable(f"{path} was replaced on disk since it was loaded")
    syms, writable = _elf(path, (_REGISTERED, _BAD_FORK, _ANCHOR))
    missing = [n for n in (_REGISTERED, _BAD_FORK, _ANCHOR) if n not in syms]
    if missing:
        raise _Unreadable(f"{path} (torch {_torch_version()}) has no {', '.join(missing)}: this "
                          "torch keeps its fork flags elsewhere (read as torch 2.14 keeps them)")
    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the copy loaded; never loads
    bias = ctypes.addressof(ctypes.c_char.in_dll(lib, _ANCHOR)) - syms[_ANCHOR][0]
    arrays = []
    for name in (_REGISTERED, _BAD_FORK):
        value, size, info = syms[name]
        if info & 0xF != 1 or size <= _CUDA:  # STT_OBJECT, an array reaching CUDA's index
            raise _Unreadable(f"{name} in {path} is not the array torch 2.14 has")
        if not any(v <= value and value + size <= v + n for v, n in writable):
            raise _Unreadable(f"{name} in {path} is not in a writable segment")
        address = bias + value
        if not _mapped_rw(address, address + size):
            raise _Unreadable(f"{name} would lie at {address:#x}, not mapped writable here")
        arrays.append((ctypes.c_ubyte * size).from_address(address))
    return arrays[0], arrays[1], path


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", "?")
