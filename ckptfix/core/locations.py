"""Locations: a local path or a remote URL, its bytes by position (exactly the ranges asked) and the few directory
questions readers ask of it.

``open_source(location)`` picks the backend by scheme: a local path (``pread``, readahead off), ``http(s)://``
(Range requests), ``s3://bucket/key`` (boto3: endpoint and credentials the standard AWS way, ``AWS_ENDPOINT_URL``
included) or ``hf://org/repo[@revision]/path`` (huggingface_hub: ``HF_ENDPOINT``, ``HF_TOKEN``, a file already in
the local HF cache read from there). The schemes are a table of backends, :mod:`ckptfix.core.remote`: every
question below about a URL is asked of its scheme's backend.

A :class:`RangeBuffer` stands in for the memory map the format readers slice (``len()`` and ``buf[a:b]``): each
slice is served from a small block cache that fetches what is missing, concurrently where a reader announces many
ranges at once (``prefetch``: a zip's local headers). Every remote fetch is checked against the validator (ETag,
Last-Modified, the Hub's commit) taken on the first one, so a file that changes mid-read is refused, not mixed. A
local file read inside a :func:`session` is held under a read lease until it ends (:func:`hold`): another process's
truncation waits instead of turning the verb's mapped reads into SIGBUS.

>>> with session() as s:                                     # doctest: +SKIP
...     buf = open_source("s3://bucket/model.pth").buffer()
...     head = buf[:4096]; s.bytes_fetched
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import remote, rollback
from .atomic import TEMP_SUFFIX
from .checksums import Tally
from ..errors import MissingFileError
from .positional import WORKERS, ByteSource, LocalSource, RangeBuffer, SourceFile, prefetch, window

__all__ = ["ByteSource", "Holder", "RangeBuffer", "Session", "as_file", "dirname", "first_file", "hold", "holding",
           "is_dir", "is_file", "is_remote", "join", "listdir", "open_buffer", "open_source", "opened", "prefetch",
           "read_all", "read_head", "session", "size_of", "warm", "window"]


def is_remote(location: Any) -> bool:
    """Whether ``location`` names a remote object: a URL of a scheme registered in :mod:`ckptfix.core.remote`."""
    return remote.backend_for(location) is not None


class Holder:
    """Read leases on the local files read while it is current (:func:`holding`; every :func:`session` is inside one),
    each taken once (:meth:`hold`), dropped by :meth:`release`."""

    def __init__(self) -> None:
        self.leases: dict[str, int | None] = {}  # a local file's real path -> its lease's descriptor (None: none had)
        self._real: dict[str, str] = {}  # a path as given -> its real path

    def hold(self, path: str) -> bool:
        """A read lease on the local file ``path`` until the holder is released (:func:`~ckptfix.core.rollback.lease`),
        taken once: another process that opens it for writing or truncates it (``torch.save`` to the same path)
        waits until the verb is done — up to lease-break-time —, instead of shrinking what the verb has mapped
        (reading a mapped page past the new end is SIGBUS: the process killed, no message). Whether one is held;
        none where the file is open for writing already, is another user's, or its filesystem has no leases, nor
        past :data:`MAX_LEASES` files, nor on ckptfix's own temp outputs (this process writes them)."""
        key = self._real.get(path)
        if key is None:
            key = self._real[path] = os.path.realpath(path)
        if key not in self.leases:
            held = sum(fd is not None for fd in self.leases.values())
            ours = TEMP_SUFFIX in key  # an output being written (no other process knows it): never held
            self.leases[key] = (rollback.lease(key) if held < MAX_LEASES and not ours and os.path.isfile(key)
                                else None)
        return self.leases[key] is not None

    def release(self) -> None:
        """Drop every lease (the writers waiting on one go on)."""
        for fd in self.leases.values():
            if fd is not None:
                rollback.drop(fd)
        self.leases.clear()


class Session:
    """The sources one verb opens, each opened once (its cache shared by sniff, scan and describe)."""

    def __init__(self) -> None:
        self.sources: dict[str, ByteSource] = {}
        self.listed = 0  # bytes of the directory listings asked (S3's and the Hub's pages)
        self.fetched = Tally()  # CRC-32s of the ranges fetched whole (a storage): a digest check fetches none again

    @property
    def bytes_fetched(self) -> int:
        return self.listed + sum(s.bytes_fetched for s in self.sources.values() if s.remote)

    @property
    def remote(self) -> bool:
        return any(s.remote for s in self.sources.values())

    @property
    def failure(self) -> Exception | None:
        """The first failed remote fetch, which a reader may have caught as damage: the verb reports it instead."""
        return next((s.failure for s in self.sources.values() if s.failure is not None), None)

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Raise the first failed fetch (a 412, a timeout) in place of whatever a reader made of it."""
        try:
            yield
        except Exception:
            if self.failure is not None:
                raise self.failure from None
            raise
        if self.failure is not None:
            raise self.failure


#: read leases one holder holds at most (a descriptor each): a directory of more shards leases the first ones
MAX_LEASES = 256
_HOLDER: contextvars.ContextVar[Holder | None] = contextvars.ContextVar("ckptfix_leases", default=None)
_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("ckptfix_sources", default=None)


@contextlib.contextmanager
def holding() -> Iterator[Holder]:
    """Hold read leases on the local files read inside until it ends (:meth:`Holder.hold`): a verb whose checks
    read mapped values after its reads' sessions ended (``verify``, ``diff``) holds them through; a nested call joins
    the outer one."""
    outer = _HOLDER.get()
    if outer is not None:
        yield outer
        return
    h = Holder()
    token = _HOLDER.set(h)
    try:
        yield h
    finally:
        _HOLDER.reset(token)
        h.release()


@contextlib.contextmanager
def session() -> Iterator[Session]:
    """Share the remote sources opened inside, and hold read leases on the local files read inside (:func:`holding`)
    until it ends; a nested call joins the outer session."""
    outer = _SESSION.get()
    if outer is not None:
        yield outer
        return
    s = Session()
    with holding():
        token = _SESSION.set(s)
        try:
            yield s
        finally:
            _SESSION.reset(token)
            for source in s.sources.values():
                source.close()


def hold(location: str) -> bool:
    """Inside :func:`holding` (a :func:`session`), a read lease on the local file ``location`` until it ends
    (:meth:`Holder.hold`; a URL: nothing, its fetches are checked against its validator instead). Every reader that
    maps a local file, and :func:`open_source`, call this first. Whether one is held (reading its mapping can't meet
    a truncation: SIGBUS)."""
    current = _HOLDER.get()
    return current is not None and not is_remote(location) and current.hold(location)


def fetched() -> Tally:
    """The current session's CRC-32s of the ranges fetched whole (an empty tally outside a session)."""
    current = _SESSION.get()
    return current.fetched if current is not None else Tally()


def open_source(location: str) -> ByteSource:
    """The :class:`ByteSource` for a local path or a remote URL (inside a :func:`session`, opened once)."""
    backend = remote.backend_for(location)
    if backend is None:
        hold(location)
        return LocalSource(location)
    current = _SESSION.get()
    if current is not None and location in current.sources:
        return current.sources[location]
    source = backend.open(location)
    if current is not None:
        current.sources[location] = source
    return source


@contextlib.contextmanager
def open_buffer(location: str, whole: bool = False) -> Iterator[Any]:
    """``location``'s bytes as the readers' ``buf``: a local file mapped with ``MADV_RANDOM`` (a page fault
    reads its page, not the readahead window around it, so a header-only read stays header-only; ``whole``:
    the normal readahead, for a reader about to go through everything) or a remote file's RangeBuffer."""
    if is_remote(location):
        yield open_source(location).buffer()
        return
    hold(location)
    with open(location, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if not whole and hasattr(buf, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            buf.madvise(mmap.MADV_RANDOM)
        yield buf


@contextlib.contextmanager
def opened(location: str) -> Iterator[ByteSource]:
    """:func:`open_source` for one use: a local file's descriptor is closed after it (a remote source stays in the
    session, its cache shared)."""
    source = open_source(location)
    try:
        yield source
    finally:
        if not is_remote(location):
            source.close()


def as_file(location: str) -> Any:
    """What a reader that takes a path or a file object opens (``torch._C.PyTorchFileReader``): a local path as it
    is, a remote one as a seekable file object over its source (each read through the block cache)."""
    return SourceFile(open_source(location)) if is_remote(location) else location


def read_head(location: str, n: int) -> tuple[bytes, int]:
    """The first ``n`` bytes of a file and its size (local: one small ``pread``, no readahead)."""
    with opened(location) as source:
        return source.read(0, n), source.size


# -- directory questions, asked of a local path or a remote location ----------------------------------------

def join(location: str, name: str) -> str:
    """``location/name`` (a remote one with ``/``)."""
    return location.rstrip("/") + "/" + name if is_remote(location) else os.path.join(location, name)


def listdir(location: str) -> list[str] | None:
    """The names in a directory (folders end in ``/`` remotely); None where a URL can't be listed (https)."""
    backend = remote.backend_for(location)
    if backend is None:
        return sorted(os.listdir(location)) if os.path.isdir(location) else None
    listed = backend.listdir(location)
    if listed is None:
        return None
    names, fetched = listed
    current = _SESSION.get()
    if current is not None:
        current.listed += fetched
    return names


def is_dir(location: str) -> bool:
    """A directory: locally one; remotely what the scheme's backend says of the URL (an http(s) URL whose last
    segment has no extension, a Hub repository), else a prefix or folder with something in it."""
    backend = remote.backend_for(location)
    if backend is None:
        return os.path.isdir(location)
    answer = backend.is_dir(location)
    return answer if answer is not None else bool(listdir(location))


def is_file(location: str) -> bool:
    """A file that exists (remotely: one that opens)."""
    if not is_remote(location):
        return os.path.isfile(location)
    try:
        open_source(location)
    except MissingFileError:
        return False
    return True


def first_file(directory: str, names: Iterable[str]) -> str | None:
    """The first of ``names`` that ``directory`` holds as a file: locally a stat each; remotely one listing where the
    scheme lists, else each file asked for by name."""
    if not is_remote(directory):
        return next((n for n in names if os.path.isfile(os.path.join(directory, n))), None)
    listed = listdir(directory)
    return next((n for n in names if (n in listed if listed is not None else is_file(join(directory, n)))), None)


def dirname(location: str) -> str:
    """The directory holding ``location`` (absolute, locally)."""
    return location.rstrip("/").rsplit("/", 1)[0] if is_remote(location) else os.path.dirname(os.path.abspath(location))


def warm(locations: list[str]) -> None:
    """Open many remote sources at once inside a :func:`session` (all the shards of a sharded checkpoint): their
    first round trips overlap. Failures are left for the reader that opens the source to report."""
    current = _SESSION.get()
    wanted = [loc for loc in dict.fromkeys(locations) if is_remote(loc) and current and loc not in current.sources]
    if len(wanted) < 2 or current is None:
        return

    def attempt(location: str) -> None:
        try:
            source = remote.open_remote(location)  # (the pool's threads don't see the session: registered here)
        except Exception:  # (the reader opens it again and says what is wrong)
            return
        current.sources.setdefault(location, source)

    with ThreadPoolExecutor(min(WORKERS, len(wanted))) as pool:
        list(pool.map(attempt, wanted))


def size_of(location: str) -> int:
    return os.path.getsize(location) if not is_remote(location) else open_source(location).size


def read_all(location: str) -> bytes:
    """A small file's bytes (an index json, a DCP ``.metadata``: the caller checks the size first)."""
    if not is_remote(location):
        with open(location, "rb") as f:
            return f.read()
    source = open_source(location)
    return source.read(0, source.size)
