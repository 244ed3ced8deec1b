"""Positional reads: exactly the byte ranges asked for, straight into the caller's buffer (``os.preadv``).

A loader that needs part of a file — one rank's shard of each tensor, a few records — reads those ranges
and nothing else: the kernel's readahead is turned off for the descriptor (``POSIX_FADV_RANDOM``), so a
cold read of a 1/8 shard pulls 1/8 of the file into the page cache, not the 8 MiB around every fault a
memory map would. Each read lands in the destination's own memory (a tensor's bytes): no staging copy.
``bytes_read`` counts what was read, for reports and tests.

>>> with PositionalReader() as r:                       # doctest: +SKIP
...     r.read_into("m.safetensors", 4096, memoryview(buf))
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import FormatError

#: bytes per preadv call (a bound on one syscall's latency, not on memory: reads land in the caller's buffer)
_STEP = 64 * 2**20


class PositionalReader:
    """Open files by path once, read ranges into buffers, count the bytes; close with ``close()``/``with``."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self.bytes_read = 0

    def __enter__(self) -> PositionalReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def fd(self, path: str) -> int:
        """A read-only descriptor for ``path`` with readahead off (opened once)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[path] = fd
        return fd

    def size(self, path: str) -> int:
        """The file's size when first asked (a file changing under a load is not a case this reads around)."""
        if path not in self._sizes:
            self._sizes[path] = os.fstat(self.fd(path)).st_size
        return self._sizes[path]

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` (a writable byte view) with ``path[offset : offset + len(buf)]``; a file that ends
        first is a FormatError naming the range (a truncated checkpoint)."""
        fd, done, total = self.fd(path), 0, buf.nbytes
        while done < total:
            n = os.preadv(fd, [buf[done : done + min(_STEP, total - done)]], offset + done)
            if n <= 0:
                raise FormatError(f"{path}: ends at byte {offset + done}, but bytes {offset}..{offset + total} "
                                  "are needed (a truncated file?)")
            done += n
        self.bytes_read += total

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
