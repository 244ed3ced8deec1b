"""On-disk formats: sniff by content (never by extension), then read, describe or write through one registry.

Each format is declared once in :mod:`ckptfix.parse.format_registry` (its name, abilities and family);
this module dispatches to the family that implements it, imported by name only when a verb needs it:
``torchsave/`` (torch zip and legacy files), ``safetensors``, ``sharded`` (Hugging Face index + shards),
``dcp/`` (torch.distributed.checkpoint, Lightning sharded dirs), ``deepspeed/`` (ZeRO), ``torchscript``.
Every family exposes the same verbs: ``read(path, fmt, plan, trust, select, read_part)``, and where the
registry says so ``describe(path, fmt, select, describe_part)`` (torch-free), ``write(obj, path, fmt, refs,
archive, force)``, ``plan_write(obj, fmt, archive, keep_keys)`` (torch-free), ``dir_output(fmt)`` and
``recorded_members(path, fmt, select, part_members)`` (the zip records a torch read goes through, to CRC-check);
``read_part``/``describe_part``/``part_members`` read a member file (a shard, Lightning's ``meta.pt``) through
this registry,
so no family calls back up into it. A family knows bytes, not wrappers: it returns the unpickled object
with the saved device tag of every storage, or writes a state dict it is handed. The shared types of
every family (:class:`RawRead`, :class:`StorageRef` …) live here.

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.safety`, :mod:`ckptfix.statedict`,
:mod:`ckptfix.errors`; a format module may import this package and its sibling families.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from ..core import limits, locations
from ..core.atomic import DirOutput
from ..core.bytecopy import Recorded
from ..core.devices import storage_id
from ..core.torch_free import NeedsTorch
from ..errors import ConversionError, FormatError
from ..parse import format_registry as registry
from ..parse.checkpoint_dirs import deepspeed_beside
from ..parse.format_registry import (DCP, DEEPSPEED, SAFETENSORS, SHARDED, SHARDED_PTH, SHARDED_SAFETENSORS,
                                     TORCH_LEGACY, TORCH_ZIP, TORCHSCRIPT)
from ..parse.sniff import opens_as_tar, sniff

__all__ = ["DCP", "DEEPSPEED", "SAFETENSORS", "SHARDED", "SHARDED_PTH", "SHARDED_SAFETENSORS", "TORCH_LEGACY",
           "TORCH_ZIP", "TORCHSCRIPT", "CastRef", "PiecedRef", "RawRead", "StorageRef", "WritePlan", "describe",
           "dir_output", "format_for_destination", "opens_as_tar", "plan_write", "read", "sniff", "write",
           "write_sharded"]


@dataclass
class StorageRef:
    """Where one storage's bytes sit in a file, so a writer can copy them without loading them."""

    path: str
    offset: int
    nbytes: int
    location: str  # saved device tag
    crc: int | None = None  # CRC-32 of the bytes, when the source records it
    key: str | None = None  # record key in a torch zip source
    record: Recorded | None = None  # the zip member holding them, its CRC-32 checked as they are copied


def source_record(ref: Any) -> Recorded | None:
    """The zip member a ref's bytes come from (a cast's: its source's), to check while copying. A ref computed
    from many ranges (DeepSpeed's GatherRef, its own source) has none."""
    while isinstance(ref, CastRef) and ref.source is not ref:
        ref = ref.source
    return getattr(ref, "record", None)


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

    def pieces(self) -> list[tuple[list[int], list[int], tuple[str, int, int]]] | None:
        """``[(offsets, sizes, (path, offset, nbytes)), …]``: boxes of the tensor, each stored row-major in one
        byte range, together covering it; or None (the bytes are computed)."""
        return None

    def materialize(self) -> Any:
        """The whole tensor on the CPU, contiguous, its storage exactly ``nbytes`` long."""
        raise NotImplementedError


@dataclass
class CastRef:
    """A storage no file holds yet: a view of a source storage cast to another dtype, computed
    tensor by tensor while writing, so memory stays bounded by the largest tensor."""

    source: StorageRef | PiecedRef | CastRef  # a computed one (a cast of a cast, DCP chunks) materialised
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

        whole = (self.source.materialize().untyped_storage() if isinstance(self.source, (CastRef, PiecedRef))  # computed
                 else stored_bytes(self.source))
        src = view_like(whole, self.before).resolve_conj().resolve_neg()  # (copy_ to another dtype drops a neg bit)
        out = torch.empty_strided(self.after.shape, self.after.stride(), dtype=self.after.dtype)
        out.copy_(src)
        self.check(self.key, src, out)
        return out


_MAPPED: dict[str, Any] = {}


def stored_bytes(ref: Any) -> Any:
    """``ref.path[ref.offset : ref.offset + ref.nbytes]`` as a torch.UntypedStorage: a slice of the mapped file, or,
    for a URL, that range fetched (ranged GETs in the verb's session, checked like every fetch) into memory."""
    import torch

    if not locations.is_remote(ref.path):
        return mapped(ref.path)[ref.offset : ref.offset + ref.nbytes]
    out = torch.empty(ref.nbytes, dtype=torch.uint8)
    if ref.nbytes:
        locations.open_source(ref.path).read_into(ref.offset, memoryview(cast(Any, out.numpy())))
    return out.untyped_storage()


def view_like(storage: Any, like: Any) -> Any:
    """A CPU tensor viewing ``storage`` as the meta tensor ``like`` does (dtype, offset, shape, stride), with its
    conjugate and negative bits: the values torch's rebuild gives ``like``, not only its stored bytes."""
    import torch

    t = torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.shape, like.stride())
    bits = torch._utils.get_tensor_metadata(like)
    if bits:
        torch._utils.set_tensor_metadata(t, bits)
    return t


def mapped(path: str) -> Any:
    """The whole local file as a private read-only-in-practice memory map (torch.UntypedStorage); a URL's bytes
    come from :func:`stored_bytes`, the range a ref needs."""
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
    return memoryview(cast(Any, whole.numpy()))


@dataclass
class RawRead:
    """What a format reader hands back: the unpickled object and each storage's saved device.

    Structure reads (tensors on meta) also fill ``refs``: storage id → StorageRef.
    """

    obj: Any
    format: str
    tags: dict[int, str] = field(default_factory=dict)  # storage id -> saved location tag
    notes: list[str] = field(default_factory=list)
    refs: dict[int, Any] = field(default_factory=dict)  # StorageRef, PiecedRef or CastRef


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``shape``, as torch computes them."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


#: reads one member file of a checkpoint (a shard, Lightning's ``meta.pt``), sniffed as ``fmt``: ``(path, fmt)``
Reader = Callable[[str, str], RawRead]


class WritePlan:
    """A write decided before anything is written (a torch-free writer has refused what it can't reproduce
    by then): ``write(path)`` writes the file and returns notes for the report."""

    def __init__(self, write: Callable[[str], list[str]]):
        self._write = write

    def write(self, path: str) -> list[str]:
        return self._write(path)


class Family(Protocol):
    """The verbs a format family's module exposes (those the registry says it has)."""

    def read(self, path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead: ...

    def describe(self, path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead: ...

    def write(self, obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
              force: bool = False) -> list[str]: ...

    def plan_write(self, obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan: ...

    def dir_output(self, fmt: str) -> DirOutput: ...


def family(fmt: str) -> Family:
    """The module implementing ``fmt``, imported now (a conversion imports only the families it touches)."""
    return cast(Family, importlib.import_module(f"{__name__}.{registry.get(fmt).family}"))


def _as_read(path: str, fmt: str, select: str | None) -> str:
    """The format a read takes: a torch zip named as a DeepSpeed model_states file, optim_states files
    beside it, is read as DeepSpeed (its fp32 master weights) unless ``select`` names another entry."""
    if fmt == TORCH_ZIP and select in ("auto", None) and deepspeed_beside(path):
        return DEEPSPEED
    return fmt


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None = "auto") -> RawRead:
    """Read ``path`` (already sniffed as ``fmt``) with the device plan.

    With ``plan.is_meta`` nothing but structure is read, and ``refs`` says where each storage's
    bytes are, so a writer can copy them straight from the file. ``select`` matters to DeepSpeed
    checkpoints only: ``auto`` consolidates their fp32 master weights (also for a model_states file
    with its optim_states beside it), anything else reads the model_states file as it is.
    """
    fmt = _as_read(path, fmt, select)

    def read_part(part: str, part_fmt: str) -> RawRead:
        return read(part, part_fmt, plan, trust)

    return family(fmt).read(path, fmt, plan, trust, select, read_part)


def describe(path: str, fmt: str, select: str | None = "auto") -> RawRead:
    """The torch-free counterpart of ``read(path, fmt, DevicePlan('meta'), trust=False, select)``: tensors as
    :class:`~ckptfix.core.tensorinfo.TensorInfo`, torch never imported. Raises
    :class:`~ckptfix.core.torch_free.NeedsTorch` for a format or a file only torch describes exactly (the
    caller reads it with torch, whose answer, or refusal, is then the one given)."""
    fmt = _as_read(path, fmt, select)
    if not registry.get(fmt).describe:
        raise NeedsTorch(f"format {fmt}")
    return family(fmt).describe(path, fmt, select, describe)


def format_for_destination(dst: str, format: str | None, sharded: bool = False) -> str:
    """The output format: ``format`` (a ``--format`` name: pth/safetensors/dcp) if given, else by dst's
    extension (a sharded output, a directory, defaults to safetensors)."""
    if format is not None:
        spec = registry.by_write_name(format.lower().lstrip("."))
        if spec is None:
            raise FormatError(f"unknown output format {format!r}; choose {_names(registry.WRITE_NAMES, 'or')}")
        return spec.name
    if sharded:
        return SAFETENSORS
    ext = os.path.splitext(dst)[1].lower()
    spec = registry.by_extension(ext)
    if spec is None:
        files = [f for f in registry.FORMATS.values() if f.extensions]
        dirs = [f.write_names[0] for f in registry.FORMATS.values() if f.directory_output and f.write_names]
        raise FormatError(
            f"{dst}: can't tell the output format from the extension {ext or '(none)'!r}; for one file use "
            f"{' or '.join('/'.join(f.extensions) for f in files)} (or pass --format "
            f"{'|'.join(f.write_names[0] for f in files)}); for a directory pass --max-shard-size SIZE (e.g. 5GB: "
            f"Hugging Face shards)" + "".join(f" or --format {name}" for name in dirs)
        )
    return spec.name


def _names(names: tuple[str, ...], last: str) -> str:
    return ", ".join(names[:-1]) + f" {last} {names[-1]}"


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          force: bool = False) -> list[str]:
    """Write ``obj`` to ``path`` in ``fmt`` with torch; returns notes for the report.

    With ``refs`` (from a structure read) tensor bytes are copied from the source file in the kernel
    instead of being loaded; without, tensors are written from memory. A file format writes ``path``
    (the caller's atomic temp file); a directory format (DCP) writes the directory atomically itself,
    ``force`` replacing an existing one's files.
    """
    return family(fmt).write(obj, path, fmt, refs, archive, force)


def plan_write(obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan:
    """Plan writing TensorInfo values ``obj`` as ``fmt`` without torch; the caller writes the plan. Raises
    NeedsTorch (nothing written) for a format or a value only torch's writers reproduce. ``keep_keys``: the
    source's records are named by key (a torch zip), which the output keeps as the torch path does."""
    if not registry.get(fmt).write_without_torch:
        raise NeedsTorch(f"output format {fmt}")
    return family(fmt).plan_write(obj, fmt, archive, keep_keys)


def write_sharded(obj: Any, dst_dir: str, fmt: str, max_shard_size: int, force: bool = False,
                  refs: dict | None = None, torch_free: bool = False, keep_keys: bool = True) -> list[str]:
    """``obj`` as a Hugging Face sharded directory of ``fmt`` files (safetensors or torch zip shards): each
    shard planned by :func:`plan_write` (``torch_free``: TensorInfo values; NeedsTorch before the directory
    is touched) or written by :func:`write` with ``refs``."""
    sharded = _sharded_as(fmt)

    def plan_shard(part: Any, archive: str) -> WritePlan:
        if torch_free:
            return plan_write(part, fmt, archive, keep_keys)
        return WritePlan(lambda path: write(part, path, fmt, refs or None, archive))

    shards: Any = family(sharded)  # the sharded family writes a directory of files, not one: its own verb
    notes: list[str] = shards.write_shards(obj, dst_dir, sharded, max_shard_size, plan_shard, force, refs)
    return notes


def recorded_members(path: str, fmt: str, select: str | None = "auto") -> list[Recorded]:
    """The zip records a torch read of ``path`` (with ``select``) goes through, each with the CRC-32 its zip
    records, so the caller can check them while torch reads (torch doesn't): a torch zip's, every torch zip
    shard's, a DeepSpeed checkpoint's files'; none for a family that names none (it has no CRC-32s, or reads
    them its own way)."""
    members = getattr(family(fmt), "recorded_members", None)
    return members(path, fmt, select, recorded_members) if members is not None else []


def dir_output(fmt: str, sharded: bool = False) -> DirOutput:
    """The files a directory output of ``fmt`` consists of (``sharded``: shards of ``fmt`` files and their
    index), all that ``force`` replaces; ConversionError for a format that is written as a file."""
    if sharded:
        fmt = _sharded_as(fmt)
    return family(fmt).dir_output(fmt)


def _sharded_as(fmt: str) -> str:
    try:
        return registry.sharded_as(fmt).name
    except KeyError:
        raise ConversionError(f"sharded output is safetensors or pth, not {fmt}") from None
