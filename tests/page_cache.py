"""A file's pages in the page cache: how many are resident (mincore(2)), and dropping them (a cold read); and
which file a tensor's memory is mapped from.

Standard library only: the tests that prove a read touches only headers or its own shard use it, and so do
the benchmarks' cold runs (bench/measure.py imports it from here).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of ``path`` in the page cache: mincore(2) over a mapping of our own, which reads nothing."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages) * mmap.PAGESIZE


def drop_from_page_cache(path: str | os.PathLike[str]) -> int:
    """``os.sync()``, then POSIX_FADV_DONTNEED over the file (or every file of a directory); returns the bytes
    that stayed cached: 0 unless a process still maps them or the file system keeps files in memory (tmpfs)."""
    os.sync()
    root = Path(path)
    files = [f for f in sorted(root.rglob("*")) if f.is_file()] if root.is_dir() else [root]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return sum(resident_bytes(f) for f in files)


def mapped_from(t: Any) -> str:
    """The file a tensor's memory is mapped from, per /proc/self/maps ('' for anonymous memory).

    Proves a read is lazy: tensor bytes still in the checkpoint file's pages, not copied.
    """
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return ""
