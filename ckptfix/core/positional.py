"""Positional reads: exactly the byte ranges asked for, straight into the caller's buffer (``os.preadv``), and
the :class:`ByteSource` of one file (local here, remote in :mod:`ckptfix.core.remote`) with its block cache and the
:class:`RangeBuffer` that stands in for a memory map (:mod:`ckptfix.core.locations` opens them).

A loader that needs part of a file — one rank's shard of each tensor, a few records — reads those ranges
and nothing else: the kernel's readahead is turned off for the descriptor (``POSIX_FADV_RANDOM``), so a
cold read of a 1/8 shard pulls 1/8 of the file into the page cache, not the 8 MiB around every fault a
memory map would. Each read lands in the destination's own memory (a tensor's bytes): no staging copy.
``bytes_read`` counts what was read, for reports and tests. Given an ``opener`` (``locations.open_source``), a
:class:`PositionalReader` reads a URL the same way: a remote source fills the buffer with concurrent ranged fetches.

>>> with PositionalReader() as r:                       # doctest: +SKIP
...     r.read_into("m.safetensors", 4096, memoryview(buf))
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .checksums import crc32
from ..errors import FormatError, MissingFileError

#: bytes per preadv call (a bound on one syscall's latency, not on memory: reads land in the caller's buffer)
_STEP = 64 * 2**20
#: bytes per read of a CRC-32 pass (:func:`crc32_notes`; measured here: 1–4 MiB best, 256 KiB and 16 MiB slower)
_CRC_READ = 4 * 2**20


def crc32_range(fd: int, offset: int, size: int, crc: int = 0) -> int:
    """CRC-32 of a file range (:func:`crc32_notes`); ``crc``: that of the bytes before it, to chain ranges into one
    checksum."""
    return crc32_notes(fd, offset, offset + size, (), crc)[offset + size]


def crc32_notes(fd: int, start: int, end: int, cuts: Iterable[int], crc: int = 0) -> dict[int, int]:
    """``{cut: CRC-32 of fd[start:cut]}`` (chained from ``crc``) for ``start``, ``end`` and each of ``cuts`` between
    them, in one pass of reads into this thread's buffer (:data:`_CRC_READ`). Reads, not a mapping: a file truncated
    under the pass (another process's write) is an OSError here; through a mapping it was SIGBUS, the process killed.
    Measured here: 77–80 ms per GiB against the mapping's 51, on a thread beside the copy."""
    notes = {start: crc}
    if end <= start:
        return notes
    buf = _crc_buffer(end - start)[: min(_CRC_READ, end - start)]
    pending = sorted(c for c in set(cuts) if start < c < end)
    k, pos = 0, start
    while pos < end:
        base, n = pos, min(len(buf), end - pos)
        _read_fully(fd, buf[:n], base)
        while k < len(pending) and pending[k] <= base + n:
            crc = crc32(buf[pos - base : pending[k] - base], crc)
            pos = pending[k]
            notes[pos] = crc
            k += 1
        crc = crc32(buf[pos - base : n], crc)
        pos = base + n
    notes[end] = crc
    return notes


def _crc_buffer(nbytes: int) -> memoryview:
    """This thread's buffer for :func:`crc32_notes`, at least ``nbytes`` or :data:`_CRC_READ` long (kept: a pass per
    tensor would otherwise fault a fresh buffer in each time)."""
    buf: memoryview | None = getattr(_local, "crc", None)
    want = min(nbytes, _CRC_READ)
    if buf is None or len(buf) < want:
        buf = _local.crc = memoryview(bytearray(max(want, 2**16)))
    return buf


def _read_fully(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise SourceShort(fd, offset + len(buf), "short read while computing CRC-32")
        done += got


class SourceShort(OSError):
    """A source file ends before the bytes a copy or a CRC-32 pass needs: it shrank under the reader. ``inode``
    (device, inode) says which file (the caller that opened it by path names it); ``now`` its size, ``needed`` the
    end."""

    def __init__(self, fd: int, needed: int, what: str) -> None:
        st = os.fstat(fd)
        self.inode, self.now, self.needed = (st.st_dev, st.st_ino), st.st_size, needed
        super().__init__(5, f"{what}: the source ends at byte {self.now}, bytes up to {needed} are needed")


_local = threading.local()


class PositionalReader:
    """Open files by path once (a :class:`ByteSource` each: ``opener(path)``, by default a :class:`LocalSource`),
    read ranges into buffers with no cache, count the bytes; close with ``close()``/``with``. A remote source
    (``opener`` = ``locations.open_source`` inside a verb's session) belongs to the session, which closes it."""

    def __init__(self, opener: Callable[[str], ByteSource] | None = None) -> None:
        self._open: Callable[[str], ByteSource] = opener or LocalSource
        self._files: dict[str, ByteSource] = {}
        self.bytes_read = 0

    def __enter__(self) -> PositionalReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _file(self, path: str) -> ByteSource:
        if path not in self._files:
            self._files[path] = self._open(path)
        return self._files[path]

    def fd(self, path: str) -> int:
        """A read-only descriptor for a local ``path`` with readahead off (opened once)."""
        source = self._file(path)
        if not isinstance(source, LocalSource):
            raise TypeError(f"{path}: a remote source has no file descriptor")
        return source.fd

    def is_remote(self, path: str) -> bool:
        return self._file(path).remote

    def size(self, path: str) -> int:
        """The file's size when first opened (a file changing under a load is not a case this reads around)."""
        return self._file(path).size

    def read_into(self, path: str, offset: int, buf: memoryview, count: bool = True) -> None:
        """Fill ``buf`` (a writable byte view) with ``path[offset : offset + len(buf)]``; a file that ends
        first is a FormatError naming the range (a truncated checkpoint). ``count``: add them to ``bytes_read``."""
        self._file(path).read_into(offset, buf)
        if count:
            self.bytes_read += buf.nbytes

    def crc32(self, path: str, offset: int, size: int) -> int:
        """CRC-32 of ``path[offset : offset + size]``: a local file's through a memory map, a remote one's as
        fetched (in :data:`PART`-sized ranges)."""
        source = self._file(path)
        if isinstance(source, LocalSource):
            return crc32_range(source.fd, offset, size)
        crc, scratch = 0, bytearray(min(PART, size))
        for pos in range(0, size, PART):
            n = min(PART, size - pos)
            view = memoryview(scratch)[:n]
            source.read_into(offset + pos, view)
            crc = crc32(view, crc)
        return crc

    def close(self) -> None:
        for source in self._files.values():
            if not source.remote:
                source.close()
        self._files.clear()


#: bytes per cached block (a remote fetch is at least this long: a zip local header and its neighbours)
BLOCK = 16 * 1024
#: blocks kept per source (16 MiB)
CACHED_BLOCKS = 1024
#: concurrent fetches per source
WORKERS = 16
#: bytes per ranged fetch when a source fills a large buffer (a tensor, a copied range): few round trips, and
#: WORKERS of them in flight
PART = 8 * 2**20


class ByteSource:
    """One file's bytes by position: ``name`` (for messages), ``size``, ``read(offset, n)``, ``bytes_fetched``.

    Subclasses implement ``_fetch(offset, n)``; this class adds the block cache and the accounting."""

    name: str
    size: int
    remote = True
    validator: object = None  # what identifies this version of the file (ETag …), where the backend has one

    def __init__(self) -> None:
        self.bytes_fetched = 0
        self.failure: Exception | None = None  # the first failed fetch: what the verb reports, whoever caught it
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def _fetch(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def _get(self, offset: int, n: int) -> bytes:
        try:
            data = self._fetch(offset, n)
        except Exception as e:
            if self.failure is None:
                self.failure = e
            raise
        with self._lock:
            self.bytes_fetched += len(data)
        return data

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer at the end of the file), through the block cache."""
        end = min(offset + max(n, 0), self.size)
        if offset >= end:
            return b""
        if not self.remote:  # the page cache is the cache: one exact pread
            return self._fetch(offset, end - offset)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        self._fill(range(first, last + 1))
        with self._lock:
            parts = [self._blocks[b] for b in range(first, last + 1)]
        data = b"".join(parts)
        return data[offset - first * BLOCK : end - first * BLOCK]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch the blocks of many ``(offset, n)`` ranges at once (a reader about to visit them all)."""
        wanted: set[int] = set()
        for offset, n in ranges:
            end = min(offset + n, self.size)
            if offset < end:
                wanted.update(range(offset // BLOCK, (end - 1) // BLOCK + 1))
        self._fill(sorted(wanted))

    def _fill(self, blocks: Any) -> None:
        with self._lock:
            missing = [b for b in blocks if b not in self._blocks]
            for b in blocks:
                if b in self._blocks:
                    self._blocks.move_to_end(b)
        runs: list[tuple[int, int]] = []  # (first block, count): adjacent missing blocks fetched as one range
        for b in missing:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((b, 1))
        if not runs:
            return
        if len(runs) == 1 or not self.remote:
            results = [self._get(b * BLOCK, k * BLOCK) for b, k in runs]
        else:
            with ThreadPoolExecutor(min(WORKERS, len(runs))) as pool:
                results = list(pool.map(lambda run: self._get(run[0] * BLOCK, run[1] * BLOCK), runs))
        with self._lock:
            for (b, k), data in zip(runs, results):
                for i in range(k):
                    self._blocks[b + i] = data[i * BLOCK : (i + 1) * BLOCK]
            while len(self._blocks) > max(CACHED_BLOCKS, len(missing)):
                self._blocks.popitem(last=False)

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``offset ..`` (a tensor's, a copied range's): fetched in :data:`PART`-sized
        ranges, concurrently, around the block cache (each byte is wanted once), each checked like every fetch;
        a file that ends first is a FormatError naming the range."""
        total = buf.nbytes
        if offset + total > self.size:
            raise FormatError(f"{self.name}: ends at byte {self.size}, but bytes {offset}..{offset + total} "
                              "are needed (a truncated file?)")
        parts = [(pos, min(PART, total - pos)) for pos in range(0, total, PART)]

        def fill(part: tuple[int, int]) -> None:
            pos, n = part
            data = self._get(offset + pos, n)
            if len(data) != n:
                raise FormatError(f"{self.name}: {len(data)} bytes came back for bytes {offset + pos}.."
                                  f"{offset + pos + n}")
            buf[pos : pos + n] = data

        if len(parts) <= 1:
            for part in parts:
                fill(part)
            return
        with ThreadPoolExecutor(min(WORKERS, len(parts))) as pool:
            list(pool.map(fill, parts))

    def cached(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """What the block cache holds of bytes ``start..end``, as ``(offset, bytes)`` runs in order: a copy of that
        range takes them rather than fetch them again (a reader's header blocks)."""
        with self._lock:
            found = [(b * BLOCK, self._blocks[b]) for b in range(start // BLOCK, max(start, end - 1) // BLOCK + 1)
                     if b in self._blocks]
        runs = []
        for offset, data in found:
            lo, hi = max(offset, start), min(offset + len(data), end)
            if lo < hi:
                runs.append((lo, data[lo - offset : hi - offset]))
        return runs

    def buffer(self) -> RangeBuffer:
        return RangeBuffer(self)

    def close(self) -> None:
        """Release what the source holds (a descriptor)."""


class LocalSource(ByteSource):
    """A local file read with ``pread``, the kernel's readahead off (``POSIX_FADV_RANDOM``)."""

    remote = False

    def __init__(self, path: str):
        super().__init__()
        self.name = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise MissingFileError(f"{path}: no such file", path) from None
        except OSError as e:
            raise FormatError(f"{path}: can't be read: {e.strerror or e}") from None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size

    def _fetch(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, min(n, self.size - offset), offset)

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``offset ..`` straight from the file (no cache: a tensor's bytes land in the
        tensor); a file that ends first is a FormatError naming the range."""
        done, total = 0, buf.nbytes
        while done < total:
            n = os.preadv(self.fd, [buf[done : done + min(_STEP, total - done)]], offset + done)
            if n <= 0:
                raise FormatError(f"{self.name}: ends at byte {offset + done}, but bytes {offset}..{offset + total} "
                                  "are needed (a truncated file?)")
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RangeBuffer:
    """A source as the readers' ``buf``: ``len()``, ``buf[i]`` (an int) and ``buf[a:b]`` (bytes), ``prefetch``;
    ``base``/``length``: a window of it (a record inside a DCP file)."""

    def __init__(self, source: ByteSource, base: int = 0, length: int | None = None):
        self.source, self.base = source, base
        self.length = source.size - base if length is None else length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                raise ValueError("a RangeBuffer slices with step 1 only")
            return self.source.read(self.base + start, stop - start)
        if key < 0:
            key += self.length
        if not 0 <= key < self.length:
            raise IndexError(key)
        return self.source.read(self.base + key, 1)[0]

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        self.source.prefetch([(self.base + offset, n) for offset, n in ranges])


class SourceFile:
    """A source as a seekable binary file object (``read``, ``readinto``, ``seek``, ``tell``), for readers that
    take one, such as ``torch._C.PyTorchFileReader``: each read goes through the source's block cache."""

    def __init__(self, source: ByteSource):
        self.source, self.pos = source, 0
        self.name = source.name

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.source.size}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.source.size - self.pos if n is None or n < 0 else n
        data = self.source.read(self.pos, n)
        self.pos += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        """(The source stays open: its session closes it.)"""


def window(buf: Any, start: int, length: int) -> Any:
    """Bytes ``start..start+length`` of a reader's ``buf`` as a buffer of their own, without a copy."""
    if isinstance(buf, RangeBuffer):
        return RangeBuffer(buf.source, buf.base + start, length)
    return memoryview(buf)[start : start + length]


_NEAR = 64 * 1024  # (a gap this small is cheaper read than asked around)


def prefetch(buf: Any, ranges: list[tuple[int, int]]) -> None:
    """Announce the ``(offset, n)`` ranges a reader is about to visit: a remote buffer fetches their blocks
    concurrently, a memory map asks the kernel for their pages at once (``MADV_WILLNEED``: one batch of reads, not a
    fault per page under ``MADV_RANDOM``); a plain buffer has them already."""
    hint = getattr(buf, "prefetch", None)
    if hint is not None:
        hint(ranges)
    elif isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_WILLNEED"):
        spans: list[list[int]] = []  # ranges less than _NEAR apart asked for as one span: one call, not thousands
        for offset, n in sorted(r for r in ranges if r[1] > 0 and 0 <= r[0] < len(buf)):
            if spans and offset - spans[-1][1] < _NEAR:
                spans[-1][1] = max(spans[-1][1], offset + n)
            else:
                spans.append([offset, offset + n])
        for start, end in spans:
            start -= start % mmap.PAGESIZE
            buf.madvise(mmap.MADV_WILLNEED, start, min(end, len(buf)) - start)
