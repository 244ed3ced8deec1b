"""Moving bytes between files without passing them through Python: copy_file_range where source and destination
offsets sit alike in the page cache's folios, else ``pwrite`` from a mapping of the source (one copy either way), a
bounded-buffer fallback; CRC-32 of a file range computed on the other core meanwhile. What lands in an output being
written is reported to its :class:`~ckptfix.core.outputs.Output` (write-back started, hashed, behind the copies).

A source may also be a URL (:class:`Sources` opens it as a :class:`RemoteFile`): its copies are queued and run
by :meth:`Sources.finish` (:mod:`ckptfix.core.rangecopy`: ranged GETs in bounded windows, written with ``pwrite``,
each range's CRC-32 computed from the bytes as fetched)."""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, cast

from . import locations, outputs
from ..errors import FormatError
from .units import shown
from .checksums import crc32_between
from .positional import ByteSource, SourceShort, crc32_notes, crc32_range
from .rangecopy import Batch, Span

_CHUNK = 64 * 2**20
#: copy_file_range moves whole page-cache folios where the source and destination offsets differ by a multiple of
#: this (a large folio's size); offsets that don't (a safetensors output, a zip's renamed records) cost it 1.3–2×
#: here, so those bytes go through a mapping of the source instead (bench/RESULTS.md, "Wave-5")
_FOLIO = 2 * 2**20
#: a mapped copy's ``pwrite``: the kernel faults the step's source pages in before copying them, so the step stays
#: cache-sized (8 MiB steps took 1.5× as long)
_STEP = 2**20

class _Sink(Protocol):
    def advance(self, nbytes: int) -> None: ...

    def tensor_done(self) -> None: ...


#: the active progress counter (``progress.Progress``), if any
progress: _Sink | None = None


def _move(size: int, step: Callable[[int, int], int], what: str, whole: bool = True, dst: tuple[int, int] = (-1, 0),
          chunk: int = _CHUNK) -> None:
    """Call ``step(done, n)`` (returns bytes moved) until ``size`` bytes are moved; report progress
    (``whole``: these were a whole tensor's bytes, not one segment of them) and, where ``dst`` (its descriptor and
    offset) is an :class:`~ckptfix.core.outputs.Output`'s, what landed there."""
    done = 0
    out = outputs.active(dst[0])
    while done < size:
        moved = step(done, min(chunk, size - done))
        if moved <= 0:
            raise OSError(5, f"{what}: stopped after {done} of {size} bytes")
        if out is not None:
            out.wrote(dst[1] + done, moved)
        done += moved
        if progress is not None:
            progress.advance(moved)
    if progress is not None and whole:
        progress.tensor_done()


class RemoteFile:
    """A remote file as a copy's source (what :class:`Sources` gives for a URL): copies from it are queued in the
    batch of the write, and run when it finishes; a range an earlier output of the same write already holds
    (:func:`reusing`) is copied from there instead, never fetched again."""

    def __init__(self, source: ByteSource, sources: Sources, url: str):
        self.source, self.batch, self.sources, self.url = source, sources.batch, sources, url

    def crc_of(self, offset: int, size: int) -> Callable[[], int]:
        """The CRC-32 of ``size`` bytes at ``offset``, once the batch has run (computed from the bytes a copy of
        the same range fetches, or when an earlier output took them)."""
        held = self.held(offset, size)
        if held is not None:
            return lambda: held[2]
        span = self.batch.check(self.source, offset, size)
        return lambda: _crc(span)

    def held(self, offset: int, size: int) -> tuple[str, int, int] | None:
        """Where an earlier output of this write holds the range: (its path, offset there, the bytes' CRC-32)."""
        landed = self.sources.landed
        return None if landed is None or not size else landed.get((self.url, offset, size))


def _crc(span: Span) -> int:
    if span.crc is None:
        raise RuntimeError("internal: a remote range's CRC-32 asked for before its copy ran")
    return span.crc


Source = int | RemoteFile

#: remote ranges a write already put into one of its outputs ((url, offset, size) -> (output path, offset, CRC-32)),
#: while :func:`reusing` holds; None: no write shares them
_landed: ContextVar[dict[tuple[str, int, int], tuple[str, int, int]] | None] = ContextVar("ckptfix_landed", default=None)


@contextlib.contextmanager
def reusing() -> Iterator[None]:
    """Inside, the outputs written one after another share what they fetch: a remote range one output holds whole (a
    tied tensor's bytes, stored under each name, in an earlier shard) is copied from that output into a later one,
    not fetched again. The earlier outputs must stay where they were written until the block ends."""
    token = _landed.set({})
    try:
        yield
    finally:
        _landed.reset(token)


class Sources:
    """The files a write copies from, each opened once: a local path as a read-only descriptor (copied in the
    kernel at once), a URL as a :class:`RemoteFile` (its source from the verb's session; copies queued until
    :meth:`finish`). ``with Sources() as sources: copy_range(sources(path), …); …; sources.finish()``."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.remote: dict[str, RemoteFile] = {}
        self.batch = Batch()
        self.landed = _landed.get()

    def __call__(self, path: str) -> Source:
        if locations.is_remote(path):
            if path not in self.remote:
                self.remote[path] = RemoteFile(locations.open_source(path), self, path)
            return self.remote[path]
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def finish(self) -> None:
        """Run the queued remote copies (each range fetched once, CRC-32s computed as it arrives)."""
        if not self.remote:
            return
        self.batch.run(progress)
        if self.landed is None:
            return
        for url, remote in self.remote.items():  # what landed in an output, for the write's later outputs
            for span in self.batch.spans.get(id(remote.source), {}).values():
                out = next((o for o in map(outputs.active, (fd for fd, _o, _w in span.dests)) if o is not None), None)
                if out is not None and span.crc is not None and span.size:
                    at = next(offset for fd, offset, _w in span.dests if fd == out.fd)
                    self.landed.setdefault((url, span.offset, span.size), (out.path, at, span.crc))

    def __enter__(self) -> Sources:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            refuse_shrunk(exc, self.fds)
        finally:
            self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def refuse_shrunk(exc: BaseException | None, fds: dict[str, int]) -> None:
    """After ``exc``: a source that ended before a copy or a CRC-32 pass was done (:class:`SourceShort`, on this thread
    or the CRC-32 thread's) is one of the files ``fds`` (path -> descriptor): raise the FormatError that names it —
    the source shrank under the convert; the output is not the cause."""
    if not isinstance(exc, SourceShort):
        return
    name = next((path for path, fd in fds.items() if _inode(fd) == exc.inode), None)
    if name is None:  # (one of another writer's files: that writer names it)
        return
    raise FormatError(f"{shown(name)}: ends at byte {exc.now}, but this convert copies bytes up to {exc.needed}: "
                      "another process truncated or rewrote it while it was converted; nothing was written (convert it "
                      "again once that process is done)") from exc


def _inode(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def copy_segments(segments: list[tuple[Source, int, int]], dst_fd: int, dst_offset: int) -> int:
    """Copy ``[(src, src_offset, size), …]`` one after another to ``dst_fd@dst_offset`` (one
    tensor's bytes from several files); returns the bytes copied."""
    pos = dst_offset
    for src_fd, src_offset, size in segments:
        copy_range(src_fd, dst_fd, src_offset, pos, size, whole=False)
        pos += size
    if progress is not None:
        progress.tensor_done()
    return pos - dst_offset


def copy_range(src_fd: Source, dst_fd: int, src_offset: int, dst_offset: int, size: int, whole: bool = True) -> None:
    """Copy ``size`` bytes from ``src_fd@src_offset`` to ``dst_fd@dst_offset``, in the kernel if it can (a
    :class:`RemoteFile`: queued, copied when its :class:`Sources` finishes). A source that ends first (it shrank under
    the copy) is :class:`~ckptfix.core.positional.SourceShort`."""
    if isinstance(src_fd, RemoteFile):
        held = src_fd.held(src_offset, size)
        if held is None:
            src_fd.batch.copy(src_fd.source, src_offset, size, dst_fd, dst_offset, whole)
            return
        src_fd, src_offset = cast(int, src_fd.sources(held[0])), held[1]  # (an earlier output's bytes, in the kernel)
    try:
        if size >= _STEP and (src_offset - dst_offset) % _FOLIO:
            _mapped_copy(src_fd, dst_fd, src_offset, dst_offset, size, whole)
        else:
            _kernel_copy(src_fd, dst_fd, src_offset, dst_offset, size, whole)
    except SourceShort:
        raise
    except OSError as e:  # a short copy, EFAULT from a mapping past the end: the source's fault if it is short now
        if os.fstat(src_fd).st_size < src_offset + size:
            raise SourceShort(src_fd, src_offset + size, "short copy (the source ended early)") from e
        raise


def _kernel_copy(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, size: int, whole: bool) -> None:
    kernel = [hasattr(os, "copy_file_range")]

    def step(done: int, n: int) -> int:
        if kernel[0]:
            try:
                return os.copy_file_range(src_fd, dst_fd, n, src_offset + done, dst_offset + done)
            except OSError:  # another filesystem, an old kernel: copy through a bounded buffer
                kernel[0] = False
        data = os.pread(src_fd, n, src_offset + done)
        return os.pwrite(dst_fd, data, dst_offset + done) if data else 0

    _move(size, step, "short copy (the source ended early?)", whole, (dst_fd, dst_offset))


def _mapped_copy(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, size: int, whole: bool) -> None:
    """Copy through a read-only mapping of the source, ``pwrite`` by ``pwrite`` (where copy_file_range would split
    folios); a source shorter than the range is refused before anything is mapped (one that shrinks during the copy
    makes ``pwrite`` fail with EFAULT: the kernel reads the mapping, nothing here touches the missing pages)."""
    if src_offset + size > os.fstat(src_fd).st_size:
        raise SourceShort(src_fd, src_offset + size, "short copy (the source ended early?)")
    base = src_offset - src_offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(src_fd, src_offset + size - base, access=mmap.ACCESS_READ, offset=base) as mm:
        view = memoryview(mm)[src_offset - base :]
        try:
            _move(size, lambda done, n: os.pwrite(dst_fd, view[done : done + n], dst_offset + done),
                  "write made no progress", whole, (dst_fd, dst_offset), _STEP)
        finally:
            view.release()


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (one call writes at most ~2 GiB on Linux)."""
    _move(len(data), lambda done, n: os.pwrite(fd, data[done : done + n], offset + done), "write made no progress",
          dst=(fd, offset))


class CrcWorker:
    """Compute CRCs of file ranges on a background thread (zlib releases the GIL)."""

    def __init__(self, fd: int, ranges: Sequence[tuple]):
        self.fd = fd
        self.ranges = ranges
        self.results: dict[tuple, int] = {}
        self._done = {r: threading.Event() for r in ranges}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for r in list(self.ranges):
                if not self.ranges:
                    break
                self.results[r] = self._compute(r)
                self._done[r].set()
        except BaseException as e:  # re-raised in get()
            self.error = e
            for ev in self._done.values():
                ev.set()

    def _compute(self, r: tuple) -> int:
        return crc32_range(self.fd, *r)

    def close(self) -> None:
        """Stop after the current range and release the file descriptor."""
        self.ranges = []
        self._thread.join()
        os.close(self.fd)

    def get(self, offset: int, size: int) -> int:
        return self.result((offset, size))

    def result(self, key: tuple) -> int:
        self._done[key].wait()
        if self.error is not None:
            raise self.error
        return self.results[key]


class SegmentsCrcWorker(CrcWorker):
    """CRC-32s of members made of several file ranges (a DCP tensor's chunks), on a background
    thread: each job is ``((fd, offset, size), …)``, its ranges chained in order. The fds stay
    the caller's (closed after :meth:`close`)."""

    def __init__(self, jobs: list[tuple[tuple[int, int, int], ...]]):
        super().__init__(-1, jobs)

    def _compute(self, r: tuple) -> int:
        crc = 0
        for fd, offset, size in r:
            crc = crc32_range(fd, offset, size, crc)
        return crc

    def close(self) -> None:
        self.ranges = []
        self._thread.join()


class RangeCrcs:
    """The CRC-32s of byte ranges of local files (``fds``: path → descriptor), on another thread, from one pass over
    each file's union of them: the CRC-32 of each run of covered bytes is chained from its start and noted at every
    range's ends, and a range's own is two such notes (:func:`~ckptfix.core.checksums.crc32_between`). A record and
    the tensors inside it (whole, a slice, tied names) are read once, while the kernel copies them."""

    def __init__(self, fds: dict[str, int], ranges: Iterable[tuple[str, int, int]]):
        self.fds = fds
        self.wanted: dict[str, set[tuple[int, int]]] = {}
        for path, offset, size in ranges:
            self.wanted.setdefault(path, set()).add((offset, size))
        self.found: dict[tuple[str, int, int], int | BaseException] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for path, ranges in self.wanted.items():
            for start, end, inside in _runs(ranges):
                if self._stop:
                    return
                try:
                    notes = crc32_notes(self.fds[path], start, end, {c for o, n in inside for c in (o, o + n)})
                except BaseException as e:  # (a file shorter than its records say) re-raised in result()
                    self.found.update(((path, o, n), e) for o, n in inside)
                    continue
                self.found.update(((path, o, n), crc32_between(notes[o], notes[o + n], n)) for o, n in inside)

    def result(self, path: str, offset: int, size: int) -> int:
        """The CRC-32 of ``path[offset : offset + size]`` (one of the ranges given), once every range is done."""
        if not size:
            return 0
        self._thread.join()
        found = self.found[(path, offset, size)]
        if isinstance(found, BaseException):
            raise found
        return found

    def close(self) -> None:
        """Stop after the current run of bytes (the descriptors stay the caller's)."""
        self._stop = True
        self._thread.join()


def _runs(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``(start, end, ranges in it)`` of each run of bytes the non-empty ``ranges`` cover together (overlapping or
    touching ones joined), in file order."""
    runs: list[tuple[int, int, list[tuple[int, int]]]] = []
    for offset, size in sorted(r for r in ranges if r[1]):
        if runs and offset <= runs[-1][1]:
            runs[-1][2].append((offset, size))
            runs[-1] = (runs[-1][0], max(runs[-1][1], offset + size), runs[-1][2])
        else:
            runs.append((offset, offset + size, [(offset, size)]))
    return runs


@dataclass(frozen=True)
class Recorded:
    """A zip member bytes are copied from: ``path[offset : offset + size]`` and the CRC-32 its zip records;
    ``recorded`` False where its writer recorded none (torch's CRC-less saves, ``parse.zipdir.unrecorded_crcs``):
    its ``crc`` of 0 is no checksum, so nothing can show its bytes damaged."""

    path: str
    name: str  # the record's name in messages: data/0
    offset: int
    size: int
    crc: int
    recorded: bool = True

    @property
    def known(self) -> int | None:
        """The CRC-32 of its bytes as the zip records it; None where it records none (a writer computes one)."""
        return self.crc if self.recorded else None

    def mismatch(self, crc: int) -> bool:
        """Whether bytes whose CRC-32 is ``crc`` are not the ones its zip records (never where it records none)."""
        return self.recorded and crc != self.crc


class CrcCheck:
    """The CRC-32 of each source member computed on another thread while the copy runs (no second pass
    over the file: the bytes are in the page cache), then compared with the one its zip records, so a
    file damaged after it was written is refused, not laundered into a new file with fresh CRCs. ``ranges``:
    more source ranges whose CRC-32s the writer wants (each tensor's, for its digest), from the same pass
    (:class:`RangeCrcs`). A remote member's or range's CRC-32 is computed from the bytes its copy fetches
    (``sources``: the write's, whose queued copies :meth:`verify` runs first; one no copy covers exactly is
    fetched for it).

    ``with CrcCheck(members, sources, ranges) as check: …copy…; check.verify(); check.crc(*range)``."""

    def __init__(self, members: Iterable[Recorded | None], sources: Sources | None = None,
                 ranges: Iterable[tuple[str, int, int]] = ()):
        self.members = list(dict.fromkeys(m for m in members if m is not None and m.recorded))  # (none: no check)
        self.sources = sources if sources is not None else Sources()
        self._own_sources = sources is None
        self.fds: dict[str, int] = {}
        self.getters: dict[tuple[str, int, int], Callable[[], int]] = {}
        local: list[tuple[str, int, int]] = []
        for key in [(m.path, m.offset, m.size) for m in self.members] + list(ranges):
            path, offset, size = key
            if key in self.getters:
                continue
            if locations.is_remote(path):
                remote = self.sources(path)
                assert isinstance(remote, RemoteFile)
                self.getters[key] = remote.crc_of(offset, size) if size else lambda: 0
                continue
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
            local.append(key)
            self.getters[key] = functools.partial(self._local, key)
        self.worker = RangeCrcs(self.fds, local) if local else None

    def _local(self, key: tuple[str, int, int]) -> int:
        assert self.worker is not None
        return self.worker.result(*key)

    def crc(self, path: str, offset: int, size: int) -> int:
        """The CRC-32 of a range given as ``ranges`` (after :meth:`verify`)."""
        return self.getters[(path, offset, size)]()

    def verify(self) -> None:
        """Raise FormatError, naming the file and the record, for the first member whose bytes don't match."""
        self.sources.finish()
        for m in self.members:
            crc = self.crc(m.path, m.offset, m.size)
            if m.mismatch(crc):
                raise FormatError(f"{m.path}: record {m.name} does not match the CRC-32 its zip records "
                                  f"({crc:08x}, recorded {m.crc:08x}): the file was damaged or altered after it "
                                  "was written; nothing was converted; restore it from a good copy")

    def __enter__(self) -> CrcCheck:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            refuse_shrunk(exc, self.fds)
        finally:
            self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for fd in self.fds.values():
            os.close(fd)
        if self._own_sources:
            self.sources.close()
