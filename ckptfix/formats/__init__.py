"""On-disk formats: sniff by content (never by extension), then read or write.

Each format module knows bytes, not wrappers: it returns the unpickled object with the saved
device tag of every storage, or writes a state dict it is handed.
"""

from __future__ import annotations

import os
import pickletools
import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError, MissingFileError

TORCH_ZIP = "torch-zip"
TORCH_LEGACY = "torch-legacy"
SAFETENSORS = "safetensors"
TORCHSCRIPT = "torchscript"
SHARDED_SAFETENSORS = "sharded-safetensors"
SHARDED_PTH = "sharded-pth"
DCP = "dcp"
DEEPSPEED = "deepspeed"
SHARDED = (SHARDED_SAFETENSORS, SHARDED_PTH)
#: formats whose structure read gives every storage's byte range(s), so conversions can stream
STREAMABLE = (TORCH_ZIP, SAFETENSORS, *SHARDED, DEEPSPEED, DCP)

WRITABLE = {"pth": TORCH_ZIP, "safetensors": SAFETENSORS, "dcp": DCP}
_EXT_FORMAT = {".pth": TORCH_ZIP, ".pt": TORCH_ZIP, ".bin": TORCH_ZIP, ".ckpt": TORCH_ZIP,
               ".tar": TORCH_ZIP, ".safetensors": SAFETENSORS}

# torch.serialization.MAGIC_NUMBER: the first pickle of every legacy (non-zip) torch file.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LFS_PREFIX = b"version https://git-lfs.github.com/spec/"


@dataclass
class StorageRef:
    """Where one storage's bytes sit in a file, so a writer can copy them without loading them."""

    path: str
    offset: int
    nbytes: int
    location: str  # saved device tag
    crc: int | None = None  # CRC-32 of the bytes, when the source records it
    key: str | None = None  # record key in a torch zip source


class PiecedRef:
    """A storage whose bytes lie in several files' byte ranges, one after another (a DCP tensor
    sharded in dim-0 chunks): writers copy ``segments()`` in order; where it gives None (chunks that
    don't tile the tensor row-major, or aren't plain bytes) they write ``materialize()`` instead."""

    path = None  # not one byte range of one file
    offset = 0
    crc: int | None = None
    key: str | None = None

    def __init__(self, nbytes: int, location: str = "cpu"):
        self.nbytes = nbytes
        self.location = location

    def segments(self) -> list[tuple[str, int, int]] | None:
        """``[(path, offset, nbytes), …]`` whose concatenation is the storage's bytes, or None."""
        raise NotImplementedError

    def materialize(self) -> Any:
        """The whole tensor on the CPU, contiguous, its storage exactly ``nbytes`` long."""
        raise NotImplementedError


@dataclass
class CastRef:
    """A storage no file holds yet: a view of a source storage cast to another dtype, computed
    tensor by tensor while writing, so memory stays bounded by the largest tensor."""

    source: StorageRef
    key: str  # the state-dict key, for messages
    before: Any  # the source view (a meta tensor: dtype, offset, shape, stride)
    after: Any  # the cast result (a meta tensor with the layout to produce)
    check: Any  # CastReport.check_values
    location: str = "cpu"

    def __post_init__(self) -> None:
        self.location = self.source.location
        self.nbytes = self.after.untyped_storage().nbytes()
        self.crc = None
        self.path = None  # not a byte range of a file: writers materialize() it

    def materialize(self) -> Any:
        """The cast tensor on the CPU, with ``after``'s layout."""
        import torch

        src = torch.empty(0, dtype=self.before.dtype)
        whole = (self.source.materialize().untyped_storage() if isinstance(self.source, (CastRef, PiecedRef))  # computed
                 else mapped(self.source.path)[self.source.offset : self.source.offset + self.source.nbytes])
        src.set_(whole, self.before.storage_offset(), self.before.shape, self.before.stride())
        out = torch.empty_strided(self.after.shape, self.after.stride(), dtype=self.after.dtype)
        out.copy_(src)
        self.check(self.key, src, out)
        return out


_MAPPED: dict[str, Any] = {}


def mapped(path: str) -> Any:
    """The whole file as a private read-only-in-practice memory map (torch.UntypedStorage)."""
    import torch

    if path not in _MAPPED:
        _MAPPED.clear()
        _MAPPED[path] = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    return _MAPPED[path]


def check_expansion(tensors: Any, refs: dict | None, where: str) -> None:
    """Refuse to write views that cover more elements than their storage holds (stride 0, overlapping
    windows) when, written out contiguously, they would exceed the limit max_expand_bytes: a 4-byte
    storage seen as a 10**9-element view must not become gigabytes of output.

    ``tensors``: (key, tensor) pairs about to be materialised; ``refs``: storage id → StorageRef/CastRef.
    """
    from .. import limits
    from ..devices import storage_id

    expanded, worst = 0, None
    for key, t in tensors:
        ref = (refs or {}).get(storage_id(t))
        view = ref.before if isinstance(ref, CastRef) else t
        if isinstance(ref, CastRef):
            nbytes = ref.source.nbytes
        elif ref is not None:
            nbytes = ref.nbytes
        else:
            nbytes = t.untyped_storage().nbytes()
        if view.numel() * view.element_size() > nbytes:
            expanded += t.numel() * t.element_size()
            worst = worst or key
    if expanded > limits.current().max_expand_bytes:
        raise limits.exceeded("max_expand_bytes", f"views larger than their storage (e.g. {worst!r}, a stride-0 "
                              "expansion) would be written out as", expanded, where)


def storage_bytes(t: Any) -> memoryview:
    """The bytes of a CPU tensor's whole storage, without a copy."""
    import torch

    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(whole.numpy())


@dataclass
class RawRead:
    """What a format reader hands back: the unpickled object and each storage's saved device.

    Structure reads (tensors on meta) also fill ``refs``: storage id → StorageRef.
    """

    obj: Any
    format: str
    tags: dict[int, str] = field(default_factory=dict)  # storage id -> saved location tag
    notes: list[str] = field(default_factory=list)
    refs: dict[int, StorageRef] = field(default_factory=dict)


def no_duplicate_keys(what: str) -> Any:
    """A ``json`` ``object_pairs_hook`` refusing a key listed twice (JSON allows it; a checkpoint
    index or header must not: which of the two would a reader take?)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise FormatError(f"{what}: duplicate key {k!r}: it is listed twice")
            seen[k] = v
        return seen

    return hook


def sniff(path: str) -> str:
    """Name the format of ``path`` from its bytes, or raise a FormatError that says what it is."""
    if not os.path.exists(path):
        raise MissingFileError(f"{path}: no such file", path)
    if os.path.isdir(path) or path.endswith(".index.json"):
        return _sniff_dir(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
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
    if opens_as_tar(path):
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

    from .. import limits

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


_TAR_EXTENDED = (b"L", b"K", b"x", b"g", b"X")  # GNU long names/links, pax headers: data read into memory


def _sniff_dir(path: str) -> str:
    """A torch.distributed.checkpoint directory, a DeepSpeed one, or a Hugging Face sharded one (or its index)."""
    from . import dcp, deepspeed, sharded

    if os.path.isdir(path) and dcp.is_dcp_dir(path):
        return DCP
    if deepspeed.is_deepspeed_dir(path):
        return DEEPSPEED
    index = sharded.find_index(path)
    if index is not None:
        return SHARDED_SAFETENSORS if index.endswith("safetensors.index.json") else SHARDED_PTH
    if not os.path.isdir(path):
        raise FormatError(f"{path}: is not a sharded-checkpoint index (expected a JSON file with a weight_map)")
    singles = [n for n in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, n))]
    hint = f"; give the file inside it: {os.path.join(path, singles[0])}" if singles else ""
    raise FormatError(
        f"{path}: is a directory but neither a torch.distributed.checkpoint (no .metadata), a DeepSpeed checkpoint "
        f"(no latest) nor a sharded checkpoint (no model.safetensors.index.json / pytorch_model.bin.index.json){hint}"
    )


def _first_pickle_is_magic(head: bytes) -> bool:
    import io

    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(head)):
            if op.name in ("PROTO", "FRAME"):
                continue
            return op.name in ("LONG1", "LONG", "LONG4") and arg == LEGACY_MAGIC
    except Exception:  # noqa: BLE001 - any parse failure means "not a legacy torch file"
        return False
    return False


_ZIP_CACHE: dict[tuple, Any] = {}


def zip_directory(path: str) -> Any:
    """The zip's central directory as torch reads it (:class:`ckptfix.zipfmt.Directory`), parsed once
    per file version: sniffing, the safety checks and the structure reader all need it, and for a
    checkpoint of 20,000 tensors parsing it costs a noticeable fraction of a second.
    Raises ``zipfmt.ZipFormatError`` (a ValueError) where torch's reader would fail."""
    import mmap

    from ..zipfmt import read_directory

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _ZIP_CACHE:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            directory = read_directory(buf, len(buf))
        _ZIP_CACHE.clear()  # keep only the latest file: conversions read one source at a time
        _ZIP_CACHE[key] = directory
    return _ZIP_CACHE[key]


def _zip_kind(path: str) -> str:
    import struct

    try:
        names = [e.name for e in zip_directory(path).entries]
    except (ValueError, OSError, struct.error) as e:
        import zipfile

        try:  # torch can't read it; if Python's zipfile can, the safety check reports the disagreement
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError):
            raise FormatError(f"{path}: is a truncated or corrupt zip archive ({e})") from None
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        return TORCHSCRIPT
    if any(n.lower().endswith("data.pkl") for n in names):
        return TORCH_ZIP
    raise FormatError(f"{path}: is a zip archive but not a torch checkpoint (no data.pkl inside)")


def format_for_destination(dst: str, format: str | None, sharded: bool = False) -> str:
    """The output format: ``format`` ('pth'/'safetensors'/'dcp') if given, else by dst's extension
    (a sharded output, a directory, defaults to safetensors)."""
    if format is not None:
        key = format.lower().lstrip(".")
        if key in ("pt", "bin", "torch"):
            key = "pth"
        if key not in WRITABLE:
            raise FormatError(f"unknown output format {format!r}; choose pth, safetensors or dcp")
        return WRITABLE[key]
    if sharded:
        return SAFETENSORS
    ext = os.path.splitext(dst)[1].lower()
    if ext not in _EXT_FORMAT:
        raise FormatError(
            f"{dst}: can't tell the output format from the extension {ext or '(none)'!r}; "
            "use .pth/.pt/.bin or .safetensors, or pass --format pth|safetensors|dcp"
        )
    return _EXT_FORMAT[ext]


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None = "auto") -> RawRead:
    """Read ``path`` (already sniffed as ``fmt``) with the device plan.

    With ``plan.is_meta`` nothing but structure is read, and ``refs`` says where each storage's
    bytes are, so a writer can copy them straight from the file. ``select`` matters to DeepSpeed
    checkpoints only: ``auto`` consolidates their fp32 master weights (also for a model_states file
    with its optim_states beside it), anything else reads the model_states file as it is.
    """
    if fmt == SAFETENSORS:
        from . import safetensors_file

        return safetensors_file.read(path, plan)
    if fmt in SHARDED:
        from . import sharded

        return sharded.read(sharded.find_index(path), plan, trust)
    if fmt == DCP:
        from . import dcp

        return dcp.read(path, plan, trust)
    if fmt in (DEEPSPEED, TORCH_ZIP):
        from . import deepspeed

        if fmt == DEEPSPEED or select in ("auto", None) and deepspeed.beside(path):
            return deepspeed.read(path, plan, trust, select)
    return read_torch(path, fmt, plan, trust)


def read_torch(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    """A torch zip or legacy file (or TorchScript archive) as it is: structure-only on meta."""
    from . import torchfile

    if fmt == TORCH_ZIP and plan.is_meta and not trust:
        from . import torchzip

        from ..safety import ensure_safe

        ensure_safe(path, fmt, unpickled_by_caller="data.pkl")  # read_structure checks data.pkl itself
        try:
            return torchzip.read_structure(path)
        except torchzip.Unsupported:
            pass
    return torchfile.read(path, fmt, plan, trust)


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive") -> list[str]:
    """Write ``obj`` to ``path`` in ``fmt``; returns notes for the report.

    With ``refs`` (from a structure read) tensor bytes are copied from the source file in the
    kernel instead of being loaded; without, tensors are written from memory.
    """
    if fmt == SAFETENSORS:
        from . import safetensors_file

        return safetensors_file.write(obj, path, refs)
    if refs:
        from . import torchzip

        torchzip.write_structure(obj, refs, path, location=lambda _tag: "cpu", archive=archive)
        return []
    from . import torchfile

    return torchfile.write(obj, path)
