"""Name a checkpoint's format from its bytes (never its extension), and read a zip's central directory once.

Pure Python below every reader: the safety scan (:mod:`ckptfix.safety`) sniffs before it scans, the format
readers (:mod:`ckptfix.formats`) before they read. The names it gives are the registered ones
(:mod:`ckptfix.parse.format_registry`, whose entries say what each is recognised by).
"""

from __future__ import annotations

import io
import os
import struct
from typing import Any

from ..core import limits, locations
from .checkpoint_dirs import find_index, index_format, is_dcp_dir, is_deepspeed_dir
from ..errors import FormatError, MissingFileError, RemoteError
from .format_registry import DCP, DEEPSPEED, SAFETENSORS, TORCH_LEGACY, TORCH_ZIP, TORCHSCRIPT
from .pickle_walk import walk
from .zipdir import RangeFile, read_directory

# torch.serialization.MAGIC_NUMBER: the first pickle of every legacy (non-zip) torch file.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LFS_PREFIX = b"version https://git-lfs.github.com/spec/"


def sniff(path: str) -> str:
    """Name the format of ``path`` (a local path, or a URL :mod:`ckptfix.core.locations` reads) from its bytes,
    or raise a FormatError that says what it is."""
    remote = locations.is_remote(path)
    if not remote and not os.path.exists(path):
        raise MissingFileError(f"{path}: no such file", path)
    if (locations.is_dir(path) if remote else os.path.isdir(path)) or path.endswith(".index.json"):
        return _sniff_dir(path)
    try:
        head, size = locations.read_head(path, 4096)
    except OSError as e:
        if isinstance(e, (MissingFileError, RemoteError)):
            raise
        raise FormatError(f"{path}: can't be read: {e.strerror or e}") from None
    if size == 0:
        raise FormatError(f"{path}: is empty (0 bytes): the save or the download did not finish")
    if head.startswith(b"PK\x03\x04"):
        return _zip_kind(path)
    if head.startswith(_LFS_PREFIX):
        raise FormatError(f"{path}: this is a Git LFS pointer file, not the checkpoint; run `git lfs pull`")
    if head[8:9] == b"{":
        n = struct.unpack("<Q", head[:8])[0]
        if n == 0 or n + 8 > size:
            raise FormatError(
                f"{path}: looks like safetensors but its header length ({n} bytes) runs past the "
                f"end of the file ({size} bytes): truncated or corrupt"
            )
        return SAFETENSORS
    if head[:1] == b"\x80" and _first_pickle_is_magic(head):
        return TORCH_LEGACY
    if remote and _tar_block(head):
        raise RemoteError(f"{path}: is a tar archive: reading it needs a local copy; download it first")
    if not remote and opens_as_tar(path):
        if not _tar_has_storages(path):
            raise FormatError(f"{path}: is a tar archive but not a torch checkpoint (no 'storages' member); "
                              "extract the checkpoint from it and give that file")
        return TORCH_LEGACY  # torch < 0.4 tar layout (torch.load tries tarfile before the pickle stream)
    low = head.removeprefix(b"\xef\xbb\xbf").lstrip()[:64].lower()  # (a UTF-8 byte order mark first)
    if low.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<!--")):
        raise FormatError(
            f"{path}: is an HTML page, not a checkpoint (a failed or login-walled download?); "
            "download the file itself"
        )
    if low[:1] in (b"{", b"["):
        raise FormatError(
            f"{path}: is a JSON document (starts with {low[:24]!r}), not a checkpoint: a server's error "
            "response saved in its place?"
        )
    if head[:1] == b"\x80":
        raise FormatError(f"{path}: is a plain pickle, not a torch checkpoint (no torch magic number)")
    raise FormatError(
        f"{path}: unknown format (starts with {head[:8]!r}): not a torch zip, torch legacy "
        "or safetensors file"
    )


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


def _tar_block(head: bytes) -> bool:
    """Whether the first 512 bytes are a tar header tarfile takes."""
    import tarfile

    try:
        return head[:512].count(0) < 512 and bool(tarfile.TarInfo.frombuf(head[:512], tarfile.ENCODING,
                                                                           "surrogateescape"))
    except (tarfile.HeaderError, ValueError):
        return False


_TAR_EXTENDED = (b"L", b"K", b"x", b"g", b"X")  # GNU long names/links, pax headers: data read into memory


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


def _tar_has_storages(path: str) -> bool:
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


def _sniff_dir(path: str) -> str:
    """A torch.distributed.checkpoint directory, a DeepSpeed one, or a Hugging Face sharded one (or its index)."""
    if is_dcp_dir(path):
        return DCP
    if not locations.is_remote(path) and is_deepspeed_dir(path):
        return DEEPSPEED
    index = find_index(path)
    if index is not None:
        return index_format(index)
    if not locations.is_dir(path):
        raise FormatError(f"{path}: is not a sharded-checkpoint index (expected a JSON file with a weight_map)")
    if locations.is_remote(path):
        raise FormatError(f"{path}: is neither a torch.distributed.checkpoint (no .metadata) nor a sharded "
                          "checkpoint (no model.safetensors.index.json / pytorch_model.bin.index.json); give a file "
                          "inside it")
    singles = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, n))]
    hint = f"; give the file inside it: {os.path.join(path, singles[0])}" if singles else ""
    raise FormatError(
        f"{path}: is a directory but neither a torch.distributed.checkpoint (no .metadata), a DeepSpeed checkpoint "
        f"(no latest) nor a sharded checkpoint (no model.safetensors.index.json / pytorch_model.bin.index.json){hint}"
    )


def _first_pickle_is_magic(head: bytes) -> bool:
    """Whether the first pickle is torch's magic number, read as torch's unpickler reads it."""
    w = walk(head, 0, "magic")
    return w.end is not None and type(w.value) is int and w.value == LEGACY_MAGIC


_ZIP_CACHE: dict[tuple, Any] = {}


def zip_directory(path: str) -> Any:
    """The zip's central directory as torch reads it (:class:`ckptfix.parse.zipdir.Directory`), parsed once
    per file version: sniffing, the safety checks and the structure reader all need it, and for a
    checkpoint of 20,000 tensors parsing it costs a noticeable fraction of a second.
    Raises ``zipfmt.ZipFormatError`` (a ValueError) where torch's reader would fail."""
    if locations.is_remote(path):
        source = locations.open_source(path)
        if source.validator is None:  # (a version can't be told: parsed again, from the session's cached blocks)
            with locations.open_buffer(path) as buf:
                return read_directory(buf, len(buf))
        key: tuple = (path, source.size, source.validator)
    else:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _ZIP_CACHE:
        with locations.open_buffer(path) as buf:
            directory = read_directory(buf, len(buf))
        _ZIP_CACHE.clear()  # keep only the latest file: conversions read one source at a time
        _ZIP_CACHE[key] = directory
    return _ZIP_CACHE[key]


def _as_file(buf: Any) -> Any:
    return RangeFile(lambda pos, n: bytes(buf[pos : pos + n]), len(buf))


def _zip_kind(path: str) -> str:
    try:
        names = [e.name for e in zip_directory(path).entries]
    except (ValueError, OSError, struct.error) as e:
        import zipfile

        try:  # torch can't read it; if Python's zipfile can, the safety check reports the disagreement
            with locations.open_buffer(path) as buf, zipfile.ZipFile(_as_file(buf)) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError):
            raise FormatError(f"{path}: is a truncated or corrupt zip archive ({e})") from None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return TORCHSCRIPT
    if any(n.lower().endswith("data.pkl") for n in names):
        return TORCH_ZIP
    raise FormatError(f"{path}: is a zip archive but not a torch checkpoint (no data.pkl inside)")
