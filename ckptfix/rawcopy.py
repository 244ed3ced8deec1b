"""Moving bytes between files without passing them through Python: copy_file_range, sendfile,
and a bounded-buffer fallback; CRC-32 of a file range computed on the other core meanwhile."""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from typing import Protocol

_CHUNK = 64 * 2**20

class _Sink(Protocol):
    def advance(self, nbytes: int) -> None: ...

    def tensor_done(self) -> None: ...


#: the active progress counter (``progress.Progress``), if any
progress: _Sink | None = None


def copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, size: int) -> None:
    """Copy ``size`` bytes from ``src_fd@src_offset`` to ``dst_fd@dst_offset``, in the kernel if it can."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < size:
        n = min(_CHUNK, size - done)
        copied = 0
        if use_cfr:
            try:
                copied = os.copy_file_range(src_fd, dst_fd, n, src_offset + done, dst_offset + done)
            except OSError:
                use_cfr = False
        if not use_cfr:
            data = os.pread(src_fd, n, src_offset + done)
            copied = os.pwrite(dst_fd, data, dst_offset + done) if data else 0
        if copied <= 0:
            raise OSError(5, f"short copy: source ended after {done} of {size} bytes")
        done += copied
        if progress is not None:
            progress.advance(copied)
    if progress is not None:
        progress.tensor_done()


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (one call writes at most ~2 GiB on Linux)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + _CHUNK], offset + done)
        if n <= 0:
            raise OSError(5, "write made no progress")
        done += n
        if progress is not None:
            progress.advance(n)
    if progress is not None:
        progress.tensor_done()


def crc32_range(fd: int, offset: int, size: int) -> int:
    """CRC-32 of a file range, read through a memory map (no copy into Python memory)."""
    if size == 0:
        return 0
    if offset + size > os.fstat(fd).st_size:
        raise OSError(5, "short read while computing CRC-32")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset + size - start, access=mmap.ACCESS_READ, offset=start) as mm:
        view = memoryview(mm)
        try:
            crc = 0
            for pos in range(offset - start, offset - start + size, _CHUNK):
                crc = zlib.crc32(view[pos : min(pos + _CHUNK, offset - start + size)], crc)
            return crc
        finally:
            view.release()


class CrcWorker:
    """Compute CRCs of file ranges on a background thread (zlib releases the GIL)."""

    def __init__(self, fd: int, ranges: list[tuple[int, int]]):
        self.fd = fd
        self.ranges = ranges
        self.results: dict[tuple[int, int], int] = {}
        self._done = {r: threading.Event() for r in ranges}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for r in list(self.ranges):
                if not self.ranges:
                    break
                self.results[r] = crc32_range(self.fd, *r)
                self._done[r].set()
        except BaseException as e:  # noqa: BLE001 - re-raised in get()
            self.error = e
            for ev in self._done.values():
                ev.set()

    def close(self) -> None:
        """Stop after the current range and release the file descriptor."""
        self.ranges = []
        self._thread.join()
        os.close(self.fd)

    def get(self, offset: int, size: int) -> int:
        key = (offset, size)
        self._done[key].wait()
        if self.error is not None:
            raise self.error
        return self.results[key]
