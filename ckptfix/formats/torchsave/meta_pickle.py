"""``data.pkl`` for an object holding tensors on ``meta`` (a structure read), as ``torch.save`` would write the
tensors ``torch.load`` of the source returns; the records it names come from ``refs``.

What torch's rebuild honours is kept, never dropped: a conjugate or negative view keeps its bits (the metadata
argument of ``_rebuild_tensor_v2``/``_v3``), a sparse tensor is written as ``_rebuild_sparse_tensor`` of its
indices and values. ``torch.load`` hands every reference to a record the typed storage of its first reference,
and ``_rebuild_tensor_v2`` takes that storage's dtype: where one storage is referenced under several dtypes (an
untyped storage and a float view of it), each tensor whose dtype isn't the storage's is written with
``_rebuild_tensor_v3``, which keeps its own, and every id names the storage's one class (that of a bare storage
referenced, else untyped, as ``torch.save`` writes v3 tensors).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ...core.devices import storage_id
from ...errors import FormatError
from ...safety.standins import pickler_base_for
from ..base import StorageRef


class _TensorStorage:
    """A tensor's storage in its rebuild arguments (not a storage the object holds itself)."""

    __slots__ = ("storage",)

    def __init__(self, storage: Any):
        self.storage = storage


class _Uses:
    """The dtypes each storage is referenced under, as the pickling meets them: tensors' and bare storages'."""

    def __init__(self) -> None:
        self.dtypes: dict[int, set[Any]] = {}
        self.bare: dict[int, Any] = {}  # storage id -> the dtype of a bare storage referencing it

    def add(self, sid: int, dtype: Any, bare: bool) -> None:
        self.dtypes.setdefault(sid, set()).add(dtype)
        if bare:
            self.bare.setdefault(sid, dtype)

    def classes(self) -> dict[int, Any]:
        """Storage id -> the one dtype its ids must name, for storages referenced under more than one."""
        import torch

        return {sid: self.bare.get(sid, torch.uint8) for sid, found in self.dtypes.items() if len(found) > 1}


Records = list[tuple[str, StorageRef]]


def pickle_meta(obj: Any, refs: dict[int, StorageRef],
                location: Callable[[str], str]) -> tuple[bytes, Records, dict[int, str]]:
    """``data.pkl`` for ``obj``, the records it names, ``[(key, StorageRef), …]`` in first-use order, and each
    storage's key (by storage id). Pickled once, and again with one class per storage where some storage turned
    out to be referenced under two dtypes."""
    uses = _Uses()
    found = _pickle(obj, refs, location, {}, uses)
    classes = uses.classes()
    if classes:
        found = _pickle(obj, refs, location, classes, _Uses())
    return found


class _Ids:
    """``persistent_id`` of the pickler: each storage's id, its record in ``order`` (first-use order) keeping the
    source's record key where it is still free."""

    def __init__(self, refs: dict[int, StorageRef], location: Callable[[str], str], uses: _Uses):
        import torch

        self.refs, self.location, self.uses = refs, location, uses
        self.order: Records = []
        self.key_of: dict[int, str] = {}
        self.used: set[str] = set()
        self.torch, self.typed, self.untyped = torch, torch.storage.TypedStorage, torch.UntypedStorage

    def __call__(self, o: Any) -> Any:
        cls = type(o)  # called for every object pickled: the common case must be cheap
        bare = cls is not _TensorStorage
        if not bare:
            o = o.storage
            cls = type(o)
        if cls is self.typed:
            st, numel = o._untyped_storage, o._size()
            storage_type, dtype = getattr(self.torch, o._pickle_storage_type()), o.dtype
        elif cls is self.untyped:
            st, numel, storage_type, dtype = o, o.nbytes(), self.untyped, self.torch.uint8
        else:
            return None
        sid = storage_id(st)
        if sid not in self.refs:
            raise FormatError("internal: a tensor without a source storage reached the zip writer")
        if bare:
            self.uses.add(sid, dtype, True)
        ref = self.refs[sid]
        if sid not in self.key_of:
            key = ref.key if ref.key is not None and ref.key not in self.used else str(len(self.order))
            while key in self.used:  # a fresh key for a source without record keys (safetensors)
                key = f"{key}_"
            self.used.add(key)
            self.key_of[sid] = key
            self.order.append((key, ref))
        return ("storage", storage_type, self.key_of[sid], self.location(ref.location), numel)


def _pickle(obj: Any, refs: dict[int, StorageRef], location: Callable[[str], str], classes: dict[int, Any],
            uses: _Uses) -> tuple[bytes, Records, dict[int, str]]:
    import torch

    ids = _Ids(refs, location, uses)

    def reduce(o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or o.device.type != "meta":
            return NotImplemented
        if o.layout != torch.strided:
            return _reduce_sparse(o)
        if isinstance(o, torch.nn.Parameter):
            inner = torch.Tensor._make_subclass(torch.Tensor, o.detach(), False)
            return (torch._utils._rebuild_parameter, (inner, o.requires_grad, OrderedDict()))
        if type(o) is not torch.Tensor:
            raise FormatError(f"tensor subclass {type(o).__name__} can't be rewritten in place; use --trust")
        uses.add(storage_id(o), o.dtype, False)
        return _reduce_strided(o, classes.get(storage_id(o)))

    class _Pickler(pickler_base_for(obj)):  # type: ignore[misc] # stand-ins keep their original names
        def persistent_id(self, o: Any) -> Any:
            return ids(o)

        def reducer_override(self, o: Any) -> Any:
            return reduce(o)

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), ids.order, ids.key_of


def _reduce_strided(t: Any, shared_as: Any) -> tuple:
    """As ``Tensor.__reduce_ex__``: v2 over a storage typed as ``t`` (v3, untyped, for dtypes without a legacy
    storage class), with the conjugate/negative bits; ``shared_as``: the class of a storage referenced under
    several dtypes, which every id names (v3 for a tensor of another dtype)."""
    import torch

    untyped = t.untyped_storage()
    bits = torch._utils.get_tensor_metadata(t)
    args: tuple[Any, ...] = (t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, OrderedDict())
    v3 = t.dtype in torch.storage._new_dtypes() or shared_as is not None and t.dtype != shared_as
    as_dtype = t.dtype if shared_as is None else shared_as
    storage = untyped if as_dtype in torch.storage._new_dtypes() or as_dtype == torch.uint8 and v3 \
        else torch.storage.TypedStorage(wrap_storage=untyped, dtype=as_dtype, _internal=True)
    if v3:
        return (torch._utils._rebuild_tensor_v3, (_TensorStorage(storage), *args, t.dtype, *([bits] if bits else [])))
    return (torch._utils._rebuild_tensor_v2, (_TensorStorage(storage), *args, *([bits] if bits else [])))


def _reduce_sparse(t: Any) -> tuple:
    """As ``Tensor.__reduce_ex__`` writes a sparse tensor: its layout and its indices and values (meta tensors
    over the source's records, pickled in their turn)."""
    import torch

    layout = t.layout
    if layout == torch.sparse_coo:
        data: tuple[Any, ...] = (t._indices(), t._values(), t.size(), t.is_coalesced())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        data = (t.crow_indices(), t.col_indices(), t.values(), t.size())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        data = (t.ccol_indices(), t.row_indices(), t.values(), t.size())
    else:
        raise FormatError(f"a {layout} tensor can't be rewritten in place; use --trust")
    return (torch._utils._rebuild_sparse_tensor, (layout, data))
