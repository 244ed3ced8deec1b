"""On-disk formats: sniff by content (never by extension), then read or write.

One package or module per format family: ``torchsave/`` (torch zip and legacy files), ``safetensors_file``,
``sharded`` (Hugging Face index + shards), ``dcp/`` (torch.distributed.checkpoint, Lightning sharded dirs),
``deepspeed/`` (ZeRO), ``torchscript``; ``describe`` reads any of them without torch and ``torchfree`` writes
without torch. Each format module knows bytes, not wrappers: it returns the unpickled object with the saved
device tag of every storage, or writes a state dict it is handed.

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.safety`, :mod:`ckptfix.statedict`,
:mod:`ckptfix.errors`; a format module may import this package and its sibling families.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..core import limits
from ..safety import scanner as safety
from ..parse.checkpoint_dirs import find_index, no_duplicate_keys
from ..core.devices import storage_id
from ..errors import FormatError
from ..parse.sniff import (DCP, DEEPSPEED, LEGACY_MAGIC, SAFETENSORS, SHARDED, SHARDED_PTH, SHARDED_SAFETENSORS,
                           TORCH_LEGACY, TORCH_ZIP, TORCHSCRIPT, opens_as_tar, sniff, zip_directory)

__all__ = ["DCP", "DEEPSPEED", "LEGACY_MAGIC", "SAFETENSORS", "SHARDED", "SHARDED_PTH", "SHARDED_SAFETENSORS",
           "TORCH_LEGACY", "TORCH_ZIP", "TORCHSCRIPT", "no_duplicate_keys", "opens_as_tar", "sniff", "zip_directory"]

#: formats whose structure read gives every storage's byte range(s), so conversions can stream
STREAMABLE = (TORCH_ZIP, SAFETENSORS, *SHARDED, DEEPSPEED, DCP)

WRITABLE = {"pth": TORCH_ZIP, "safetensors": SAFETENSORS, "dcp": DCP}
_EXT_FORMAT = {".pth": TORCH_ZIP, ".pt": TORCH_ZIP, ".bin": TORCH_ZIP, ".ckpt": TORCH_ZIP,
               ".tar": TORCH_ZIP, ".safetensors": SAFETENSORS}


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

        return sharded.read(find_index(path), plan, trust)
    if fmt == DCP:
        from .dcp import directory as dcp

        return dcp.read(path, plan, trust)
    if fmt in (DEEPSPEED, TORCH_ZIP):
        from .deepspeed import consolidate as deepspeed

        if fmt == DEEPSPEED or select in ("auto", None) and deepspeed.beside(path):
            return deepspeed.read(path, plan, trust, select)
    return read_torch(path, fmt, plan, trust)


def read_torch(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    """A torch zip or legacy file (or TorchScript archive) as it is: structure-only on meta."""
    from .torchsave import torch_io as torchfile

    if fmt == TORCH_ZIP and plan.is_meta and not trust:
        from .torchsave import records as torchzip

        safety.ensure_safe(path, fmt, unpickled_by_caller="data.pkl")  # read_structure checks data.pkl itself
        try:
            return torchzip.read_structure(path)
        except torchzip.Unsupported:
            pass
    return torchfile.read(path, fmt, plan, trust)


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          plan: Any = None) -> list[str]:
    """Write ``obj`` to ``path`` in ``fmt``; returns notes for the report.

    With ``refs`` (from a structure read) tensor bytes are copied from the source file in the
    kernel instead of being loaded; without, tensors are written from memory. With ``plan``
    (:func:`ckptfix.formats.torchfree.prepare`'s, for TensorInfo values) the plan writes ``path``
    and torch is never imported.
    """
    if plan is not None:
        return plan(path)
    if fmt == SAFETENSORS:
        from . import safetensors_file

        return safetensors_file.write(obj, path, refs)
    if refs:
        from .torchsave import records as torchzip

        torchzip.write_structure(obj, refs, path, location=lambda _tag: "cpu", archive=archive)
        return []
    from .torchsave import torch_io as torchfile

    return torchfile.write(obj, path)
