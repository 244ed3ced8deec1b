"""Each format recognises its own bytes: one small function per registered format, named by its registry entry
(``recogniser="torch_zip"``), that :func:`ckptfix.parse.sniff.sniff` asks in the registry's order.

A recogniser of bytes takes a :class:`Head` and answers True (mine) or False; it raises FormatError for bytes
that are its format's but damaged (a corrupt zip, a safetensors header length past the end) and NeedsLocalCopy
where a URL can't be read as its format (a tar). A recogniser of directories takes a :class:`Listing`. They
follow torch's own precedence (torch.load takes any file starting with the zip magic as a zip; a TorchScript
archive holds a data.pkl too), so no real file is claimed twice: sniff refuses bytes two recognisers claim.
Kept apart from the registry, which stays plain data the CLI imports at startup.
"""

from __future__ import annotations

import struct
from typing import Any

from ..core import locations
from ..errors import FormatError, NeedsLocalCopy
from .checkpoint_dirs import find_index, index_format, is_dcp_dir, is_deepspeed_dir
from .format_registry import SHARDED_PTH, SHARDED_SAFETENSORS
from .legacy_tar import opens_as_tar, tar_block, tar_has_storages
from .disguise import pickle_prefix
from .pickle_walk import walk
from .safetensors_header import MAX_HEADER_BYTES
from .zipdir import RangeFile, zip_directory

#: the first bytes of every zip (a local file header): torch.load reads any file starting with them as a zip
ZIP_MAGIC = b"PK\x03\x04"
#: what JSON (and safetensors' serde_json) skips before a value
JSON_WHITESPACE = b" \t\n\r"
#: torch.serialization.MAGIC_NUMBER: the first pickle of every legacy (non-zip) torch file.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class Head:
    """What a recogniser of bytes reads: a file's first bytes (4096) and its size, and, listed once for every
    recogniser that asks, a zip's member names."""

    def __init__(self, path: str, remote: bool, head: bytes, size: int):
        self.path, self.remote, self.head, self.size = path, remote, head, size
        self._names: list[str] | FormatError | None = None

    def zip_names(self) -> list[str]:
        """The member names of a file starting with :data:`ZIP_MAGIC` as torch's reader lists them (Python's
        zipfile's where torch can't read it: the safety check reports the disagreement); FormatError for a zip
        neither reads."""
        if self._names is None:
            try:
                self._names = _zip_names(self.path)
            except FormatError as e:
                self._names = e
        if isinstance(self._names, FormatError):
            raise self._names
        return self._names


def _zip_names(path: str) -> list[str]:
    try:
        return [e.name for e in zip_directory(path).entries]
    except (ValueError, OSError, struct.error) as e:
        import zipfile

        try:  # torch can't read it; if Python's zipfile can, the safety check reports the disagreement
            with locations.open_buffer(path) as buf, zipfile.ZipFile(_as_file(buf)) as z:
                return z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError):
            raise FormatError(f"{path}: is a truncated or corrupt zip archive ({e})") from None


def _as_file(buf: Any) -> Any:
    return RangeFile(lambda pos, n: bytes(buf[pos : pos + n]), len(buf))


def _torchscript_names(names: list[str]) -> bool:
    return any(n.endswith("/constants.pkl") or "/code/" in n for n in names)


def torchscript(h: Head) -> bool:
    """A zip archive holding ``constants.pkl`` or ``code/`` (what ``torch.jit.save`` writes)."""
    return h.head.startswith(ZIP_MAGIC) and _torchscript_names(h.zip_names())


def torch_zip(h: Head) -> bool:
    """A zip archive holding ``data.pkl`` (what ``torch.save`` writes), TorchScript's left to :func:`torchscript`."""
    if not h.head.startswith(ZIP_MAGIC):
        return False
    names = h.zip_names()
    return not _torchscript_names(names) and any(n.lower().endswith("data.pkl") for n in names)


def safetensors(h: Head) -> bool:
    """An 8-byte header length, then ``{`` after any JSON whitespace (safetensors' serde_json skips it: a header
    may start with spaces or newlines); FormatError where that length runs past the end of the file."""
    body = h.head[8:].lstrip(JSON_WHITESPACE)
    n = struct.unpack("<Q", h.head[:8])[0] if len(h.head) >= 8 else 0
    if body[:1] != b"{" and (body or len(h.head) <= 8 or n <= len(h.head) - 8):  # (or whitespace past the head)
        return False
    if n > MAX_HEADER_BYTES:  # (safetensors' own refusal: HeaderTooLarge)
        raise FormatError(f"{h.path}: looks like safetensors but its header length ({n} bytes) is over safetensors' "
                          f"limit ({MAX_HEADER_BYTES} bytes): corrupt, or not a safetensors file")
    if n == 0 or n + 8 > h.size:
        raise FormatError(
            f"{h.path}: looks like safetensors but its header length ({n} bytes) runs past the "
            f"end of the file ({h.size} bytes): truncated or corrupt"
        )
    if pickle_prefix(h.path, h.remote, h.head, h.size) is not None:
        raise FormatError(f"{h.path}: is ambiguous: its bytes read as safetensors and as a pickle (a file made to "
                          "be two formats at once); refused: pickle.loads or torch.load(weights_only=False) of it "
                          f"would run what the pickle names (`ckptfix scan {h.path}` lists it)")
    return True


def torch_legacy(h: Head) -> bool:
    """What torch.load's legacy path reads (a file not starting with the zip magic): a tar holding ``storages``
    (torch < 0.4, tried first), or a pickle stream whose first pickle is torch's magic number. A URL's tar
    raises NeedsLocalCopy: tarfile reads a file from its start."""
    if h.head.startswith(ZIP_MAGIC):
        return False
    if h.head[:1] == b"\x80" and _first_pickle_is_magic(h.head):
        return True
    if h.remote:
        if tar_block(h.head):
            raise NeedsLocalCopy(h.path, "reading a tar archive")
        return False
    return opens_as_tar(h.path) and tar_has_storages(h.path)


def _first_pickle_is_magic(head: bytes) -> bool:
    """Whether the first pickle is torch's magic number, read as torch's unpickler reads it."""
    w = walk(head, 0, "magic")
    return w.end is not None and type(w.value) is int and w.value == LEGACY_MAGIC


class Listing:
    """What a recogniser of directories reads: a directory (or a sharded index json) and, looked up once for
    every recogniser that asks, the sharded index it holds (:func:`~ckptfix.parse.checkpoint_dirs.find_index`)."""

    def __init__(self, path: str, remote: bool):
        self.path, self.remote = path, remote
        self._index: tuple[str | None] | None = None

    def index(self) -> str | None:
        if self._index is None:
            self._index = (find_index(self.path),)
        return self._index[0]


def dcp(d: Listing) -> bool:
    """A directory holding torch.distributed.checkpoint's ``.metadata``."""
    return is_dcp_dir(d.path)


def deepspeed(d: Listing) -> bool:
    """A local directory holding DeepSpeed's ``latest`` or ``*_model_states.pt`` files."""
    return not d.remote and is_deepspeed_dir(d.path)


def sharded_safetensors(d: Listing) -> bool:
    """A ``model.safetensors.index.json``, or a directory holding one."""
    index = d.index()
    return index is not None and index_format(index) == SHARDED_SAFETENSORS


def sharded_pth(d: Listing) -> bool:
    """Any other ``*.index.json`` (torch's ``pytorch_model.bin.index.json``), or a directory holding one and no
    safetensors index (which is read first)."""
    index = d.index()
    return index is not None and index_format(index) == SHARDED_PTH
