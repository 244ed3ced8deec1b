"""An in-memory URL scheme for tests: ``mem://KEY`` served from a dict of bytes, registered through the public
``ckptfix.register_url_scheme`` the way a new scheme (``gs://``) would be, so URL behaviour is tested without a
server (the real servers of remote_servers.py stay the tests of Range, ETag, redirects and deadlines).

>>> with registered(MemoryBackend()) as mem:                      # doctest: +SKIP
...     mem.put_tree(Path("fixtures/mlp_fsdp2"), "ckpt")
...     ckptfix.describe(mem.url("ckpt"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import ckptfix
from ckptfix.core.remote import ByteSource
from ckptfix.errors import DestinationError, MissingFileError


class MemorySource(ByteSource):
    """One object's bytes; every fetch counted by ByteSource, as a server's would be."""

    def __init__(self, name: str, data: bytes):
        super().__init__()
        self.name, self.data, self.size = name, data, len(data)
        self.validator = ("id", id(data))

    def _fetch(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]


class MemoryBackend(ckptfix.UrlBackend):
    """``SCHEME://KEY`` → ``objects[KEY]``; keys with ``/`` make folders, listed as S3 lists a prefix; one-file
    outputs are "uploaded" into ``objects``."""

    def __init__(self, scheme: str = "mem"):
        self.scheme = scheme
        self.objects: dict[str, bytes] = {}

    def url(self, key: str) -> str:
        return f"{self.scheme}://{key}"

    def key(self, location: str) -> str:
        return location.partition("://")[2]

    def put_tree(self, path: Path, key: str) -> str:
        """A local file, or every file under a local directory, stored under ``key``; its URL."""
        if path.is_file():
            self.objects[key] = path.read_bytes()
        for f in sorted(path.rglob("*")) if path.is_dir() else []:
            if f.is_file():
                self.objects[f"{key}/{f.relative_to(path).as_posix()}"] = f.read_bytes()
        return self.url(key)

    def open(self, location: str) -> ByteSource:
        key = self.key(location)
        if key not in self.objects:
            raise MissingFileError(f"{location}: no such object", location)
        return MemorySource(location, self.objects[key])

    def listdir(self, location: str) -> tuple[list[str], int]:
        key = self.key(location).strip("/")
        prefix = key + "/" if key else ""
        names = {k[len(prefix):].split("/", 1)[0] + ("/" if "/" in k[len(prefix):] else "")
                 for k in self.objects if k.startswith(prefix)}
        return sorted(names), 0

    def check_writable(self, location: str, directory: bool = False) -> None:
        if directory:
            raise DestinationError(f"{location}: {self.scheme}:// takes one file, not a directory")

    def check_destination(self, src: str, dst: str, force: bool) -> None:
        super().check_destination(src, dst, force)
        if self.key(dst) in self.objects and not force:
            raise DestinationError(f"{dst}: already exists")

    def upload(self, path: str, url: str, replace: bool) -> tuple[int, int]:
        data = Path(path).read_bytes()
        self.objects[self.key(url)] = data
        return len(data), 1


@contextlib.contextmanager
def registered(backend: MemoryBackend) -> Iterator[MemoryBackend]:
    """``backend`` registered for its scheme while inside, unregistered after."""
    ckptfix.register_url_scheme(backend.scheme, backend)
    try:
        yield backend
    finally:
        ckptfix.unregister_url_scheme(backend.scheme)
