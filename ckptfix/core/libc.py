"""The C library's calls Python's ``os`` and ``mmap`` lack (``madvise`` and ``mincore`` on an address,
``sync_file_range``), looked up once through ctypes. Each is best effort: where libc or the call can't be had, the
lookup gives None and the caller does without (a hint not given, the slower path)."""

from __future__ import annotations

import functools
import mmap
from typing import Any

#: each call's argument and result types, by ctypes name
_SIGNATURES = {
    "madvise": (("c_void_p", "c_size_t", "c_int"), "c_int"),
    "mincore": (("c_void_p", "c_size_t", "c_void_p"), "c_int"),
    "sync_file_range": (("c_int", "c_int64", "c_int64", "c_uint"), "c_int"),
}


@functools.cache
def function(name: str) -> Any:
    """libc's ``name`` (one of :data:`_SIGNATURES`), typed, errno kept; None where it can't be had."""
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    args, result = _SIGNATURES[name]
    fn.argtypes, fn.restype = [getattr(ctypes, a) for a in args], getattr(ctypes, result)
    return fn


def pages(address: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned start and the length covering ``address .. address + nbytes``."""
    start = address - address % mmap.PAGESIZE
    return start, address + nbytes - start


def will_need(address: int, nbytes: int) -> None:
    """``madvise(MADV_WILLNEED)`` over the pages of ``address .. address + nbytes`` (a mapped file's: the kernel
    reads them ahead; anonymous memory: nothing happens)."""
    fn = function("madvise")
    if fn is not None:
        fn(*pages(address, nbytes), getattr(mmap, "MADV_WILLNEED", 3))


def cached(address: int, nbytes: int) -> bool:
    """The first, middle and last pages of ``address .. address + nbytes`` are in memory (a mapped file's: in the page
    cache; ``mincore`` of a page each — of every page it costs 50 ns a page, a third of what a warm read ahead costs):
    the sign that a mapped tensor's file is warm, so asking the kernel to read it ahead would only walk its pages.
    False where that can't be told."""
    fn = function("mincore")
    if fn is None or nbytes <= 0:
        return False
    import ctypes

    vec = ctypes.create_string_buffer(1)
    for at in (address, address + nbytes // 2, address + nbytes - 1):
        if fn(at - at % mmap.PAGESIZE, 1, vec) != 0 or not vec.raw[0] & 1:
            return False
    return True


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start writing a range back, without waiting (where libc or the
    filesystem lacks it, the fsync does it all)."""
    fn = function("sync_file_range")
    if fn is not None:
        fn(fd, offset, nbytes, 2)
