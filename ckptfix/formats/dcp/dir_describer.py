"""A DCP directory described without torch: tensors from ``.metadata`` (read into inert stand-ins,
:func:`ckptfix.safety.dcp_policy.load_inert`), each bytes entry as the torch.save zip it is, in its byte
range of a ``.distcp`` file, a Lightning ``meta.pt`` beside them as the torch zip it is. Whatever the
torch read (:mod:`.directory`) would refuse or this doesn't model raises :class:`~ckptfix.core.torch_free.NeedsTorch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from ...core import limits, locations
from ...core.tensorinfo import StorageInfo, TensorInfo
from ...core.torch_free import NeedsTorch
from ...errors import FormatError
from ...core.torch_tables import DTYPE_ITEMSIZE
from ...parse.checkpoint_dirs import member_path
from ...parse.format_registry import DCP
from ...safety.dcp_policy import METADATA, Token, is_inert, load_inert
from ..base import RawRead, Reader, contiguous_strides
from ..torchsave.zip_describer import read_torch_record
from .chunks import tiling_problem, whole
from .directory import unflatten
from .lightning import with_meta


@dataclass(frozen=True, eq=False)
class ConsolidatedInfo(TensorInfo):
    """A DCP tensor: consolidated from its chunks on read, so it has no single byte range in any file
    (its storage names the directory and the tensor's FQN; offset -1 says it is not a file range)."""

    @property
    def byte_range(self) -> tuple[int, int] | None:
        return None


def describe(path: str, describe_meta: Reader) -> RawRead:
    """A DCP directory as :func:`.directory.read` reads it on meta: each tensor whole (shape and dtype from
    the metadata, its chunks checked to tile it), each bytes entry (a ``torch.save`` zip in a byte range of
    a ``.distcp`` file: optimizer hyper-parameters, any other value) described as that zip
    (:func:`~ckptfix.formats.torchsave.zip_describer.read_torch_record`), keys nested again from the planner data,
    joined with a Lightning ``meta.pt`` beside them (described by ``describe_meta``) as the torch read joins it.
    Any metadata or record the torch read would refuse or doesn't model raises NeedsTorch."""
    meta = load_inert(path)
    if meta is None:
        raise NeedsTorch("metadata the inert read doesn't model")
    meta_path = locations.join(path, METADATA)
    records: dict[tuple[Any, Any], Any] = {}
    files: dict[Any, str] = {}
    try:
        for index, info in meta.storage_data.items():
            if info.relative_path not in files:
                files[info.relative_path] = member_path(path, info.relative_path, meta_path, what="chunk file")
            offset = index.offset
            records[(index.fqn, None if offset is None else tuple(offset))] = info
    except Exception as e:  # the torch read gives the refusal
        raise NeedsTorch(f"storage data: {e}") from None
    flat: dict[str, Any] = {}
    tags: dict[int, str] = {}
    sharded_count = 0
    for fqn, md in meta.state_dict_metadata.items():
        if type(fqn) is str and is_inert(md, "BytesStorageMetadata"):
            flat[fqn] = _dcp_value(path, fqn, records.get((fqn, None)), files, tags)
            continue
        flat[fqn] = t = _dcp_tensor(path, fqn, md, records)
        tags[id(t.storage)] = "cpu"
        sharded_count += not whole(md)
    notes = [f"consolidated {len(flat)} DCP entries ({sharded_count} tensors sharded in chunks) "
             f"from {len(files)} file(s)"]
    try:
        obj = unflatten(flat, meta.planner_data, meta_path)
    except Exception as e:
        raise NeedsTorch(f"planner data: {e}") from None
    return with_meta(RawRead(obj=obj, format=DCP, tags=tags, notes=notes), path, describe_meta)


def _dcp_value(path: str, fqn: str, info: Any, files: dict[Any, str], tags: dict[int, str]) -> Any:
    """A bytes entry as ``Chunks.value`` reads it: its record's range checked inside its file and within
    max_pickle_bytes, read, and described as the torch.save zip it holds (tags: its storages' devices)."""
    if info is None or info.transform_descriptors:
        raise NeedsTorch(f"entry {fqn!r}: no plain record")
    offset, length = info.offset, info.length
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise NeedsTorch(f"entry {fqn!r}: a malformed byte range")
    if length > limits.current().max_pickle_bytes:
        raise NeedsTorch(f"entry {fqn!r}: over max_pickle_bytes")  # torch's read: the LimitError
    file = files[info.relative_path]
    try:
        with locations.opened(file) as source:
            if offset + length > source.size:
                raise NeedsTorch(f"entry {fqn!r}: its record lies outside {file}")
            data = source.read(offset, length)
    except OSError as e:
        raise NeedsTorch(f"{file}: {e}") from None
    if len(data) != length:
        raise NeedsTorch(f"{file}: changed while read")
    value, value_tags = read_torch_record(file, data, offset, f"{path}: entry {fqn!r}")
    tags.update(value_tags)
    return value


def _ints(value: Any) -> TypeGuard[tuple[int, ...]]:
    return type(value) is tuple and len(value) <= 64 and all(type(n) is int and n >= 0 for n in value)


def _dcp_tensor(path: str, fqn: str, md: Any, records: dict[tuple[Any, Any], Any]) -> ConsolidatedInfo:
    """One entry as the torch read checks it (``Chunks.check_geometry``), or NeedsTorch."""
    props = getattr(md, "properties", None)
    if type(fqn) is not str or not is_inert(md, "TensorStorageMetadata") or not is_inert(props, "TensorProperties"):
        raise NeedsTorch(f"entry {fqn!r}: not a plain tensor")
    dtype_token, layout = getattr(props, "dtype", None), getattr(props, "layout", None)
    if not (isinstance(dtype_token, Token) and dtype_token.kind == "dtype" and dtype_token.name in DTYPE_ITEMSIZE
            and layout == Token("layout", "torch.strided")):
        raise NeedsTorch(f"entry {fqn!r}: dtype or layout")
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    if not _ints(size) or type(chunks) is not list:
        raise NeedsTorch(f"entry {fqn!r}: size or chunks")
    if not all(is_inert(c, "ChunkStorageMetadata") and _ints(getattr(c, "offsets", None))
               and _ints(getattr(c, "sizes", None)) for c in chunks):
        raise NeedsTorch(f"entry {fqn!r}: a chunk")
    problem = tiling_problem(fqn, size, [(c.offsets, c.sizes) for c in chunks])
    if problem is not None:
        raise FormatError(f"{locations.join(path, METADATA)}: {problem}")
    for c in chunks:
        info = records.get((fqn, c.offsets))
        if info is None or info.transform_descriptors:
            raise NeedsTorch(f"entry {fqn!r}: a chunk without a plain record")
    dtype_name = dtype_token.name
    storage = StorageInfo(path, fqn, -1, math.prod(size) * DTYPE_ITEMSIZE[dtype_name], "cpu")
    return ConsolidatedInfo(dtype_name, size, contiguous_strides(size), 0, storage)
