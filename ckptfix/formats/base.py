"""What every format family shares: where a storage's bytes are (:class:`StorageRef`, :class:`PiecedRef`,
:class:`CastRef`), what a read hands back (:class:`RawRead`), a write decided before it runs (:class:`WritePlan`),
the verbs a family exposes (:class:`Family`), and the helpers on storages the families and the verbs use.

Kept apart from :mod:`ckptfix.formats`, the dispatch, so a family imports these without importing the registry's
dispatch. May import: the layers below :mod:`ckptfix.formats`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from ..core import limits, locations
from ..core.atomic import DirOutput
from ..core.bytecopy import Recorded
from ..core.devices import storage_id


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
        locations.hold(path)
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
    """The verbs a format family's module exposes: ``read`` and ``recorded_members`` always, the others where
    the registry says so (``write_shards``: a sharded format's, the directory of shards it writes)."""

    def read(self, path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead: ...

    def describe(self, path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead: ...

    def write(self, obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
              force: bool = False) -> list[str]: ...

    def plan_write(self, obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan: ...

    def dir_output(self, fmt: str) -> DirOutput: ...

    def write_shards(self, obj: Any, dst_dir: str, fmt: str, max_shard_size: int,
                     plan_shard: Callable[[Any, str], WritePlan], force: bool = False,
                     refs: dict | None = None) -> list[str]: ...

    def recorded_members(self, path: str, fmt: str, select: str | None,
                         part_members: Callable[[str, str, str | None], list[Recorded]]) -> list[Recorded]: ...
