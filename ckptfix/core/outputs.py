"""An output file as its writer fills it (:class:`Output`): the write-back of what it wrote started behind the
writes, so the final fsync waits for the last window only, and — where the caller asked (:func:`hashing`: a convert's
``--hash``, ``--sign``, checksums) — its SHA-256 computed on another thread behind them, over the bytes the writer
declared final, as they land. :mod:`~ckptfix.core.bytecopy`'s copies and writes report to it; :func:`create`
opens it without the truncation that costs ext4 a flush at close."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

from . import libc

#: an output's write-back is started every this many bytes written (``sync_file_range``), so its fsync waits for
#: the last window only
_BEHIND = 64 * 2**20
#: the outputs being written, by descriptor: bytecopy's copies tell each what landed in it
_outputs: dict[int, Output] = {}
#: the temp paths whose SHA-256 a caller asked for (:func:`hashing`)
_wanted: dict[str, Hashed] = {}
#: the hash's step: one mapping, one ``update`` (the GIL released throughout: a thread importing beside it, a
#: signed convert's model-signing, would otherwise stall it at every step)
_HASH_WINDOW = 64 * 2**20


def active(fd: int) -> Output | None:
    """The :class:`Output` being written through ``fd``, if any."""
    return _outputs.get(fd)


class Output:
    """An output file as its writer fills it: the write-back of each :data:`_BEHIND` bytes written started at once
    (``sync_file_range``: the fsync then waits for the last window, not the whole file), and, where :func:`hashing`
    asked for its path, its SHA-256 computed on another thread behind the writer — over the bytes the writer
    declared final (:meth:`final`) and those copied right after them, as they land. A write below that mark voids the
    hash (the caller hashes the finished file instead). ``with Output(fd, path) as out: …; out.final(n); …``."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self.lo, self.hi = -1, 0  # the bytes written since write-back was last started (none yet: lo -1)
        self.mark = 0  # bytes [0, mark) are final
        self.void = False
        self.hasher = _Hasher(path) if path in _wanted else None
        if path in _wanted:
            _wanted[path].hasher = None  # (until this write has finished)

    def __enter__(self) -> Output:
        _outputs[self.fd] = self
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        del _outputs[self.fd]
        if self.hasher is not None:
            whole = exc_type is None and not self.void
            self.hasher.end_at(os.fstat(self.fd).st_size if whole else None)
            if whole and self.path in _wanted:
                _wanted[self.path].hasher = self.hasher

    def wrote(self, offset: int, n: int) -> None:
        """``n`` bytes landed at ``offset``."""
        if offset < self.mark:
            self.void = True
        elif offset == self.mark:
            self.final(offset + n)
        if not 0 <= self.lo <= offset <= self.hi + _BEHIND:  # (a zip's local headers between copies: in the window)
            self.lo = offset
        self.hi = max(self.hi, offset + n)
        if self.hi - self.lo >= _BEHIND:
            libc.start_writeback(self.fd, self.lo, self.hi - self.lo)
            self.lo = self.hi

    def final(self, upto: int) -> None:
        """Bytes ``[0, upto)`` won't change: the hash may read them."""
        if upto > self.mark:
            self.mark = upto
            if self.hasher is not None:
                self.hasher.upto(upto)


@contextlib.contextmanager
def create(path: str) -> Iterator[tuple[BinaryIO, Output]]:
    """The output file at ``path`` opened for writing, and its :class:`Output`: ``with create(path) as (f, out):``.
    A file already empty (an atomic write's temp file) is not truncated again: ext4 takes a truncation to zero bytes
    as "replace via truncate" and writes the whole file back when it is closed (auto_da_alloc), which costs the
    close as much as the fsync after it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
        f = os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
    with f, Output(f.fileno(), path) as out:
        yield f, out


class _Hasher:
    """The SHA-256 of a file being written, read (from the page cache) on a thread as far as the writer's mark."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)
        self.sha = hashlib.sha256()
        self.done = self.mark = 0
        self.end: int | None = None  # the file's size once written; -1: stop, no digest
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="ckptfix-output-sha256", daemon=True)
        self.thread.start()

    def upto(self, mark: int) -> None:
        with self.cond:
            self.mark = mark
            self.cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.end is None and self.done >= self.mark:
                        self.cond.wait()
                    end = self.end
                    target = self.mark if end is None else end
                if end is not None and self.done >= target:  # (end -1: stopped)
                    break
                while self.done < target:
                    self._hash(min(target, self.done + _HASH_WINDOW))
        except BaseException as e:  # re-raised by result()
            self.error = e
        finally:
            os.close(self.fd)

    def _hash(self, upto: int) -> None:
        """Hash the bytes from ``done`` to ``upto`` through a mapping (no copy into a buffer: 15 % faster here)."""
        if upto > os.fstat(self.fd).st_size:
            raise OSError(5, "the output ended early while hashing it")
        base = self.done - self.done % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(self.fd, upto - base, access=mmap.ACCESS_READ, offset=base) as mm:
            view = memoryview(mm)
            try:
                self.sha.update(view[self.done - base :])
            finally:
                view.release()
        self.done = upto

    def end_at(self, size: int | None) -> None:
        """The writer is done: hash on to ``size``, the file's length (None: stop, the write failed)."""
        with self.cond:
            self.end = -1 if size is None else size
            self.cond.notify()

    def result(self) -> str:
        """The hex SHA-256 (once the thread has hashed the rest)."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.sha.hexdigest()


class Hashed:
    """What :func:`hashing` yields: after the block, ``hasher`` is the finished write's (its ``result()`` the file's
    SHA-256, the tail still being hashed meanwhile), or None where the writer couldn't hash as it went (it patched
    bytes already hashed, or wrote without an :class:`Output`): the caller hashes the file then."""

    hasher: _Hasher | None = None


@contextlib.contextmanager
def hashing(path: str) -> Iterator[Hashed]:
    """Ask for the SHA-256 of the file written at ``path`` inside the block, computed behind its writer (an
    :class:`Output`) as its bytes land."""
    _wanted[path] = hashed = Hashed()
    try:
        yield hashed
    finally:
        _wanted.pop(path, None)
