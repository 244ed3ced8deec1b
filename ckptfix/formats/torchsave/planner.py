"""A torch zip written from :class:`~ckptfix.core.tensorinfo.TensorInfo` values without torch: ``data.pkl``
pickled here, each tensor's record copied from its source in the kernel (:func:`.records.write_archive`).

``data.pkl`` is written by Python's C pickler (protocol 2, as torch.save runs it) with the opcodes
torch's pickler produces: ``GLOBAL torch._utils _rebuild_tensor_v2`` / ``_rebuild_parameter`` + REDUCE
for each tensor, a persistent id ``('storage', GLOBAL torch.FloatStorage, key, 'cpu', numel)`` for each
storage, OrderedDicts with their ``_metadata`` set by BUILD. torch's globals are written as stand-ins
(:mod:`.torch_globals`) whose GLOBAL opcodes are then rewritten to torch's names, so torch is never
imported. Dtypes without a legacy storage class (uint16, float8 …) are written as torch writes them:
``_rebuild_tensor_v3`` with an ``UntypedStorage`` id and the dtype. Anything this can't reproduce exactly
(a value that isn't plain data, one holding the stand-ins' marker bytes: a key, a bytes value, a huge int)
raises :class:`~ckptfix.core.torch_free.NeedsTorch` before a byte is written.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any, cast

from ...core.tensorinfo import StorageInfo, TensorInfo
from ...core.torch_free import NeedsTorch
from ...core.torch_tables import DTYPE_ITEMSIZE
from ..base import StorageRef, WritePlan
from .zip_describer import dtype as DtypeToken
from . import digest_records
from .records import write_archive
from .torch_globals import (DTYPES, REBUILD_PARAMETER, REBUILD_TENSOR, REBUILD_TENSOR_V3, STORAGE_CLASS,
                            UNTYPED_STORAGE, marker, to_torch)


def plan_write(obj: Any, archive: str = "archive", keep_keys: bool = True) -> WritePlan:
    """Plan writing ``obj`` as a torch zip (NeedsTorch, nothing written, for what only torch's writer
    reproduces). ``keep_keys``: the source's records are named by key (a torch zip), which the output keeps
    as the torch path does."""
    data, order, key_of = pickle_structure(obj, keep_keys)
    names = digest_records.tensor_keys(obj, lambda x: key_of.get(id(x.storage)) if type(x) is TensorInfo else None)

    def write_zip(path: str) -> list[str]:
        write_archive(data, order, path, archive, names)
        return []

    return WritePlan(write_zip)


class _StorageArg:
    """A tensor's storage in its ``_rebuild_tensor_v2`` arguments: pickled as a persistent id."""

    __slots__ = ("storage", "dtype")

    def __init__(self, storage: StorageInfo, dtype: str | None):  # None: an untyped storage
        self.storage, self.dtype = storage, dtype


class _Records:
    """The ``data/KEY`` records to copy, in first-use order, as torch's streamed writer numbers them:
    a torch zip source's record key where it is still free, else the next index."""

    def __init__(self, keep_keys: bool, shared: frozenset[int] = frozenset()):
        self.keep_keys = keep_keys
        self.order: list[tuple[str, StorageRef]] = []
        self.key_of: dict[int, str] = {}
        self.used: set[str] = set()
        #: the dtypes each storage's tensors have; ``shared``: storages of several, written as untyped (see below)
        self.dtypes: dict[int, set[str]] = {}
        self.shared = shared

    def persistent_id(self, arg: _StorageArg) -> tuple:
        st = arg.storage
        if id(st) not in self.key_of:
            if not _unmarked(st.key):
                raise NeedsTorch("a record name holding ckptfix's own pickle marker")
            key = st.key if self.keep_keys and st.key not in self.used else str(len(self.order))
            while key in self.used:
                key = f"{key}_"
            self.used.add(key)
            self.key_of[id(st)] = key
            record = st.record
            crc = record.known if self.keep_keys and record is not None and record.size == st.nbytes else None
            self.order.append((key, StorageRef(st.path, st.offset, st.nbytes, st.location, crc, st.key, record)))
        if arg.dtype is None:
            return ("storage", UNTYPED_STORAGE, self.key_of[id(st)], "cpu", st.nbytes)
        return ("storage", STORAGE_CLASS[arg.dtype], self.key_of[id(st)], "cpu", st.nbytes // DTYPE_ITEMSIZE[arg.dtype])


class _Saves:
    """What torch's pickler does to tensors and storages, for TensorInfo and its storage."""

    records: _Records

    def persistent_id(self, obj: Any) -> Any:
        return self.records.persistent_id(obj) if type(obj) is _StorageArg else None

    def reducer_override(self, obj: Any) -> Any:
        return _reduce_tensor(obj, self.records) if type(obj) is TensorInfo else NotImplemented


class _Pickler(_Saves, pickle.Pickler):
    """Python's C pickler, as torch.save runs it (protocol 2), writing TensorInfo as torch writes tensors."""

    def __init__(self, file: Any, records: _Records):
        super().__init__(file, protocol=2)
        self.records = records


class _PyPickler(_Saves, pickle._Pickler):
    """The same in Python's pure pickler, which can also write a dtype value (``"dtype": torch.float16``)
    as torch's global: the C pickler can't be told to write a value as another object."""

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[DtypeToken] = lambda pickler, obj: cast(Any, pickler).save(DTYPES[obj.name])

    def __init__(self, file: Any, records: _Records):
        super().__init__(file, protocol=2)
        self.records = records


def _reduce_tensor(t: TensorInfo, records: _Records) -> tuple:
    """As torch writes the tensor. A storage its tensors view under several dtypes (an untyped record read as
    float by one v3 tensor, as bytes by another): torch.load gives every reference the typed storage of the
    first and v2 takes its dtype, so every tensor but a uint8 one is written as v3 over the untyped storage."""
    if t.is_parameter:  # torch: Parameter.__reduce_ex__ → _rebuild_parameter(plain data, requires_grad, hooks)
        inner = TensorInfo(t.dtype, t.shape, t.stride, t.storage_offset, t.storage)
        return REBUILD_PARAMETER, (inner, t.requires_grad, OrderedDict())
    records.dtypes.setdefault(id(t.storage), set()).add(t.dtype)
    if t.dtype not in STORAGE_CLASS or id(t.storage) in records.shared and t.dtype != "uint8":  # torch writes v3
        args: tuple[Any, ...] = (_StorageArg(t.storage, None), t.storage_offset, t.shape, t.stride, t.requires_grad,
                                 OrderedDict(), DTYPES[t.dtype])
        return REBUILD_TENSOR_V3, args
    rebuild: tuple[Any, ...] = (_StorageArg(t.storage, t.dtype), t.storage_offset, t.shape, t.stride, t.requires_grad,
                                OrderedDict())
    return REBUILD_TENSOR, rebuild


_PLAIN = (str, int, float, bool, complex, type(None), bytes)
_MARKER = marker()
_MARKER_TEXT = _MARKER.decode("ascii")
#: an int of fewer bits pickles (LONG1: little-endian, two's complement) in fewer bytes than the marker
_SHORT_INT_BITS = 8 * (len(_MARKER) - 1)


def _unmarked(x: Any) -> bool:
    """``x`` pickles without the bytes of a stand-in's GLOBAL (the rewrite to torch's names stays exact)."""
    if type(x) is int:
        return x.bit_length() < _SHORT_INT_BITS
    if type(x) is str:
        return _MARKER_TEXT not in x
    return type(x) is not bytes or _MARKER not in x


def _check_plain(obj: Any) -> bool:
    """Only values the structure reader produces: containers, atoms, dtypes, TensorInfo. True when a
    dtype value is among them (only the pure-Python pickler writes it as torch does)."""
    seen: set[int] = set()
    stack = [obj]
    dtypes = False
    while stack:
        x = stack.pop()
        if isinstance(x, _PLAIN):
            if not _unmarked(x):
                raise NeedsTorch("a value holding ckptfix's own pickle marker")
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        cls = type(x)
        if cls is TensorInfo:
            if not all(map(_unmarked, (x.storage_offset, *x.shape, *x.stride))):
                raise NeedsTorch("a tensor of a size no file holds")
        elif cls is DtypeToken:
            dtypes = True
        elif cls in (dict, OrderedDict):
            stack.extend(x.keys())
            stack.extend(x.values())
            stack.extend(vars(x).values() if cls is OrderedDict else ())
        elif cls in (list, tuple, set, frozenset):
            stack.extend(x)
        else:
            raise NeedsTorch(f"a {cls.__name__} value")
    return dtypes


def pickle_structure(obj: Any, keep_keys: bool) -> tuple[bytes, list[tuple[str, StorageRef]], dict[int, str]]:
    """``data.pkl`` for ``obj``, the records it names, ``[(key, StorageRef), …]``, and each storage's key (by the id
    of its StorageInfo): pickled by Python's
    C pickler (its pure-Python one where a dtype value needs it) with stand-ins for torch's globals,
    which are then rewritten to torch's names."""
    pickler = _PyPickler if _check_plain(obj) else _Pickler
    records = _Records(keep_keys)
    buf = io.BytesIO()
    pickler(buf, records).dump(obj)
    shared = frozenset(sid for sid, found in records.dtypes.items() if len(found) > 1)
    if shared:  # (rare) pickled again, each tensor over those storages as _reduce_tensor says
        records, buf = _Records(keep_keys, shared), io.BytesIO()
        pickler(buf, records).dump(obj)
    try:
        return to_torch(buf.getvalue()), records.order, records.key_of
    except ValueError as e:  # the marker where _unmarked can't see it: torch's writer, not a broken file
        raise NeedsTorch(str(e)) from None
