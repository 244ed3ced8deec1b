"""A tar as ``torch.load``'s legacy path sees it (torch < 0.4 saved checkpoints as tars): whether tarfile takes
the file, whether it holds the ``storages`` member torch extracts first, and a bounded file for reading it.

Recognising a legacy checkpoint (:mod:`ckptfix.parse.recognise`), diagnosing a tar that isn't one
(:mod:`ckptfix.parse.sniff`) and scanning one (:mod:`ckptfix.safety`) all ask these questions.
"""

from __future__ import annotations

import io
from typing import Any

from ..core import limits

_TAR_EXTENDED = (b"L", b"K", b"x", b"g", b"X")  # GNU long names/links, pax headers: data read into memory


def opens_as_tar(path: str) -> bool:
    """Whether ``tarfile.open(mode="r:")`` takes the file, exactly as torch.load's legacy path tries it
    first (an old-style tar needs no ``ustar`` magic: a header block with a valid checksum is enough)."""
    import tarfile

    try:
        with open(path, "rb") as f:
            block = f.read(512)
            if block.count(0) == 512:
                return False  # all zeros: an empty tar to tarfile, but torch then fails (no 'storages')
            try:
                first = tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
            except tarfile.HeaderError:
                return False  # tarfile refuses the first block: torch goes on to the pickle stream
            if first.type in _TAR_EXTENDED and first.size > limits.current().max_pickle_bytes:
                return True  # a header extension tarfile would read whole: a tar, refused unread
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:"):
                return True
    except (tarfile.TarError, OSError, ValueError, EOFError):
        return False


def tar_block(head: bytes) -> bool:
    """Whether the first 512 bytes are a tar header tarfile takes."""
    import tarfile

    try:
        return head[:512].count(0) < 512 and bool(tarfile.TarInfo.frombuf(head[:512], tarfile.ENCODING,
                                                                           "surrogateescape"))
    except (tarfile.HeaderError, ValueError):
        return False


class BoundedReader(io.RawIOBase):
    """A file for tarfile that refuses any single read past the limit max_pickle_bytes: tarfile reads
    header extensions whole, so a forged size would otherwise allocate gigabytes."""

    def __init__(self, f: Any):
        super().__init__()
        self.f = f
        self.limit = limits.current().max_pickle_bytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, out: Any) -> int:
        if len(out) > self.limit:
            raise OSError(f"a tar record of {len(out)} bytes is beyond the limit max_pickle_bytes")
        return self.f.readinto(out)


def tar_has_storages(path: str) -> bool:
    """Whether the tar holds the regular file ``storages``, the member torch.load's tar path extracts first
    (torch < 0.4 wrote ``sys_info``, ``pickle``, ``tensors`` and ``storages``). A tar whose members can't be
    listed within the limits counts as a checkpoint: the scan refuses it unread."""
    import tarfile

    found = False
    try:
        with open(path, "rb") as raw, tarfile.open(fileobj=io.BufferedReader(BoundedReader(raw)), mode="r:") as tar:
            for member in tar:
                if member.name == "storages":
                    found = member.isfile()  # torch takes the last one of that name
    except (tarfile.TarError, OSError, ValueError, EOFError):
        return True
    return found
