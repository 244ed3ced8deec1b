"""Copies out of a remote file (a URL's :class:`~ckptfix.core.positional.ByteSource`) into a local output, planned
while a writer lays the output out and run at once: the ranges asked for are sorted, neighbours merged, and fetched
in bounded windows (:data:`WINDOW`, each a few concurrent ranged GETs, the next windows fetched while one is
written), so each source byte is fetched once and memory stays bounded whatever the file's size. The CRC-32 of each
range is computed from the bytes as they arrive (a zip member's, to check against the one its zip records; a
written member's, for its local header): no second read.

>>> batch = Batch()                                           # doctest: +SKIP
>>> job = batch.copy(source, offset, size, out_fd, pos)       # nothing fetched yet
>>> batch.run(progress); job.crc                              # fetched, written, checksummed
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import outputs
from .checksums import crc32
from .positional import WORKERS, ByteSource

#: bytes per fetched window (its parts are fetched concurrently by ByteSource.read_into)
WINDOW = 64 * 2**20
#: bytes of windows fetched ahead of the one being written (bounds memory: at most this plus one window)
AHEAD = 2 * WINDOW
#: a gap between two wanted ranges this small is fetched rather than asked around (a zip local header)
GAP = 1 * 2**20


@dataclass
class Span:
    """One source range wanted: where each copy of it goes (``(fd, offset, whole)``) and its CRC-32 once run."""

    offset: int
    size: int
    dests: list[tuple[int, int, bool]] = field(default_factory=list)
    crc: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.size


class Batch:
    """The ranges of remote sources a write copies or checks, run together by :meth:`run` (again for ranges added
    after, each run fetching only what is new)."""

    def __init__(self) -> None:
        self.spans: dict[int, dict[tuple[int, int], Span]] = {}  # id(source) -> (offset, size) -> Span
        self.sources: dict[int, ByteSource] = {}

    def _span(self, source: ByteSource, offset: int, size: int) -> Span:
        self.sources[id(source)] = source
        spans = self.spans.setdefault(id(source), {})
        key = (offset, size)
        if key not in spans or spans[key].crc is not None:  # (run already: asked for again, fetched again)
            spans[key] = Span(offset, size)
        return spans[key]

    def copy(self, source: ByteSource, offset: int, size: int, dst_fd: int, dst_offset: int,
             whole: bool = True) -> Span:
        """Copy ``source[offset : offset + size]`` to ``dst_fd@dst_offset`` when run (``whole``: a tensor's bytes,
        for the progress line); the span's ``crc`` is theirs once run."""
        span = self._span(source, offset, size)
        span.dests.append((dst_fd, dst_offset, whole))
        return span

    def check(self, source: ByteSource, offset: int, size: int) -> Span:
        """The CRC-32 of ``source[offset : offset + size]`` once run (from the bytes a copy fetches, if one does)."""
        return self._span(source, offset, size)

    def run(self, progress: Any = None) -> None:
        """Fetch, write and checksum every pending range; ``progress``: a counter with ``advance(n)`` and
        ``tensor_done()``."""
        for sid, spans in self.spans.items():
            pending = sorted((s for s in spans.values() if s.crc is None), key=lambda s: (s.offset, s.size))
            if pending:
                _run_source(self.sources[sid], pending, progress)


def _windows(spans: list[Span]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of the windows covering ``spans`` (sorted): neighbours less than GAP apart merged into
    runs, each run cut into windows of at most WINDOW bytes."""
    start = end = None
    for s in spans:
        if s.size == 0:
            continue
        if start is not None and end is not None and s.offset <= end + GAP:
            end = max(end, s.end)
            continue
        if start is not None and end is not None:
            yield from ((a, min(a + WINDOW, end)) for a in range(start, end, WINDOW))
        start, end = s.offset, s.end
    if start is not None and end is not None:
        yield from ((a, min(a + WINDOW, end)) for a in range(start, end, WINDOW))


def _fetch(source: ByteSource, start: int, end: int) -> memoryview:
    """Bytes ``start..end``: the blocks a reader already fetched taken from the source's cache, the gaps between
    them fetched (concurrently), so each byte is fetched once."""
    buf = memoryview(bytearray(end - start))
    gaps, pos = [], start
    for offset, data in source.cached(start, end):
        if offset > pos:
            gaps.append((pos, offset))
        buf[offset - start : offset - start + len(data)] = data
        pos = offset + len(data)
    if pos < end:
        gaps.append((pos, end))
    if len(gaps) == 1:
        source.read_into(gaps[0][0], buf[gaps[0][0] - start : gaps[0][1] - start])
    elif gaps:
        with ThreadPoolExecutor(min(WORKERS, len(gaps))) as pool:
            list(pool.map(lambda gap: source.read_into(gap[0], buf[gap[0] - start : gap[1] - start]), gaps))
    return buf


def _run_source(source: ByteSource, spans: list[Span], progress: Any) -> None:
    """Fetch ``spans``' windows in order, a few ahead (bounded by AHEAD bytes), and hand each to the spans it holds."""
    for s in spans:
        if s.size == 0:
            _finish(s, 0, progress)
    todo = [s for s in spans if s.size > 0]
    crcs = {id(s): 0 for s in todo}
    windows = deque(_windows(todo))
    active: list[Span] = []
    i = 0
    with ThreadPoolExecutor(4) as pool:
        inflight: deque[tuple[int, int, Future[memoryview]]] = deque()
        try:
            while windows or inflight:
                while windows and (not inflight or sum(e - a for a, e, _ in inflight) + windows[0][1] - windows[0][0]
                                   <= AHEAD):
                    a, e = windows.popleft()
                    inflight.append((a, e, pool.submit(_fetch, source, a, e)))
                a, e, future = inflight.popleft()
                buf = future.result()
                while i < len(todo) and todo[i].offset < e:
                    active.append(todo[i])
                    i += 1
                for s in active:
                    lo, hi = max(s.offset, a), min(s.end, e)
                    if lo >= hi:
                        continue
                    piece = buf[lo - a : hi - a]
                    crcs[id(s)] = crc32(piece, crcs[id(s)])
                    for fd, dst_offset, _whole in s.dests:
                        _write_all(fd, piece, dst_offset + lo - s.offset, progress)
                    if hi == s.end:
                        _finish(s, crcs[id(s)], progress)
                active = [s for s in active if s.end > e]
                del buf
        except BaseException:
            for _a, _e, pending in inflight:
                pending.cancel()
            raise


def _finish(span: Span, crc: int, progress: Any) -> None:
    span.crc = crc
    if progress is not None:
        for _fd, _offset, whole in span.dests:
            if whole:
                progress.tensor_done()


def _write_all(fd: int, data: memoryview, offset: int, progress: Any) -> None:
    """``pwrite`` all of ``data``, told to the output being written (its write-back, its hash behind the copy)."""
    done, out = 0, outputs.active(fd)
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(5, f"write made no progress after {done} of {len(data)} bytes")
        if out is not None:
            out.wrote(offset + done, n)
        done += n
        if progress is not None:
            progress.advance(n)
