"""The guards of torch's tensor rebuilds: every view, quantized, nested or legacy tensor inside its storage.

torch's own rebuilds check some bounds and not others (GHSA-jg6j-8w4h-2pg2: a quantized rebuild whose
strides reach outside its storage read process memory), and older torch checks fewer; these guards check
each rebuild's size, stride and offset against the storage before torch sees them. Quantized and nested
tensors can't be built on ``meta``: a structure read of them raises
:class:`~ckptfix.core.devices.NeedsValues` and its caller reads them on the CPU.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

from ..core.devices import NeedsValues
from ..core.tensorinfo import sparse_parts
from ..core.torch_tables import PACKED_PER_BYTE
from ..parse.unpickler import Refused, Unpickler, type_name
from . import subclasses


def sizes_of(args: Any) -> int:
    """What copying ``args`` costs, as charged to max_alloc_bytes: the lengths of its strings and containers."""
    return sum(len(a) for a in args if isinstance(a, (str, bytes, bytearray, tuple, list, dict, set, frozenset)))


def view_bytes(offset: int, size: tuple[int, ...], stride: tuple[int, ...], itemsize: int, dtype_name: str) -> int:
    """The storage bytes a view reaches (0 when it is empty), as torch's ``set_`` counts them: a sub-byte
    quantized dtype packs :data:`PACKED_PER_BYTE` elements in a byte."""
    if 0 in size:
        return 0
    elements = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    per_byte = PACKED_PER_BYTE.get(dtype_name)
    return -(-elements // per_byte) if per_byte else elements * itemsize


def check_view(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any = None,
               where: str = "") -> tuple[int, int]:
    """A tensor view must lie inside its storage: non-negative offset, sizes and strides, and its
    furthest element within the storage (torch would *resize* the storage instead: uninitialised
    memory, or on ``meta`` another record's bytes; a quantized one read past it). Returns (bytes of a
    dense tensor of ``size``, storage bytes)."""
    torch = _torch()
    if isinstance(storage, torch.storage.TypedStorage):
        itemsize, nbytes, storage_dtype = storage.dtype.itemsize, storage._untyped_storage.nbytes(), storage.dtype
    elif isinstance(storage, torch.UntypedStorage):
        itemsize, nbytes, storage_dtype = 1, storage.nbytes(), torch.uint8
    else:
        raise Refused(f"{where}a tensor is rebuilt from a {type_name(storage)}, not a storage")
    if dtype is not None:
        itemsize, storage_dtype = (dtype.itemsize, dtype) if isinstance(dtype, torch.dtype) else (0, None)
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or type(offset) is not int \
            or len(size) != len(stride) or len(size) > 64 or itemsize <= 0 \
            or not all(type(n) is int for n in (*size, *stride)):
        raise Refused(f"{where}a tensor view has malformed offset/size/stride")
    if offset < 0 or any(n < 0 for n in (*size, *stride)):
        raise Refused(f"{where}a tensor view has a negative offset, size or stride")
    dtype_name = str(storage_dtype).rpartition(".")[2]
    reach = view_bytes(offset, size, stride, itemsize, dtype_name)
    if reach > nbytes:
        raise Refused(f"{where}a tensor view reaches byte {reach} of a storage of {nbytes} bytes (out of bounds)")
    return view_bytes(0, size, _contiguous(size), itemsize, dtype_name), nbytes


def storage_device(storage: Any) -> Any:
    """A storage's device, asked without torch's TypedStorage deprecation warning."""
    return getattr(storage, "_untyped_storage", storage).device


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(size[i + 1:]) for i in range(len(size)))


@functools.lru_cache(maxsize=1)
def _torch() -> Any:
    import torch

    return torch


def _no_hooks(hooks: Any) -> None:
    if hooks not in (None, {}) and not (isinstance(hooks, dict) and not hooks):
        raise Refused("tensors with backward hooks are not loaded (torch.save never writes hooks)")


def _plain_state(state: Any) -> None:
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict) or not all(type(k) is str and not k.startswith("_") for k in part):
            raise Refused("tensor state must be a dict of plain (public) attribute names")


def _rebuild_view(position_of_dtype: int | None = None, hooks_at: int | None = 5) -> Callable:
    """The guard of a rebuild function taking (storage, offset, size, stride, …)."""

    def guard(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs or len(args) < 4:
            raise Refused(f"{type_name(f)} with unexpected arguments")
        dtype = args[position_of_dtype] if position_of_dtype is not None and len(args) > position_of_dtype else None
        check_view(args[0], args[1], args[2], args[3], dtype, where=f"{u.where}: ")
        if hooks_at is not None and len(args) > hooks_at:
            _no_hooks(args[hooks_at])
        u.charge(len(args[2]) * 2, type_name(f))
        return f(*args)

    return guard


def _qtensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """``_rebuild_qtensor(storage, offset, size, stride, qparams, requires_grad, hooks)``: the view inside its
    storage and per-channel parameters that fit its size; the tensor it allocates is charged."""
    torch = _torch()
    if kwargs or len(args) != 7 or not isinstance(args[4], tuple) or not args[4]:
        raise Refused("_rebuild_qtensor with unexpected arguments")
    dense, nbytes = check_view(*args[:4], where=f"{u.where}: ")
    _no_hooks(args[6])
    scheme, size = args[4][0], args[2]
    if scheme not in (torch.per_tensor_affine, torch.per_channel_affine, torch.per_channel_affine_float_qparams):
        raise Refused(f"{u.where}: a quantized tensor of scheme {type_name(scheme)}, which torch.save doesn't write")
    if scheme is not torch.per_tensor_affine:
        _per_channel(args[4], size, f"{u.where}: ")
    if storage_device(args[0]).type == "meta" or any(isinstance(p, torch.Tensor) and p.is_meta for p in args[4]):
        raise NeedsValues(f"{u.where}: a quantized tensor can't be built on meta")
    u.charge(len(size) * 2 + max(0, dense - nbytes), "_rebuild_qtensor")
    return f(*args)


def _per_channel(qparams: tuple, size: tuple, where: str) -> None:
    """(scheme, scales, zero_points, axis): one scale and zero point for each index of ``size[axis]``."""
    torch = _torch()
    if len(qparams) != 4 or type(qparams[3]) is not int or not 0 <= qparams[3] < len(size) \
            or not all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == size[qparams[3]]
                       for t in qparams[1:3]):
        raise Refused(f"{where}a per-channel quantized tensor whose scales, zero points or axis don't fit its size")


def _nested(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """``_rebuild_nested_tensor(buffer, sizes, strides, offsets)``: each component a view inside the buffer."""
    torch = _torch()
    if kwargs or len(args) != 4 or not all(isinstance(a, torch.Tensor) for a in args):
        raise Refused("_rebuild_nested_tensor with unexpected arguments")
    buffer, sizes, strides, offsets = args
    if any(a.device.type == "meta" for a in args):
        raise NeedsValues(f"{u.where}: a nested tensor can't be built on meta")
    if buffer.dim() != 1 or buffer.stride() != (1,) or sizes.dim() != 2 or strides.shape != sizes.shape \
            or offsets.shape != sizes.shape[:1] or any(t.dtype != torch.int64 for t in (sizes, strides, offsets)):
        raise Refused(f"{u.where}: a nested tensor with malformed sizes, strides or offsets")
    u.charge(sizes.numel() * 3, "_rebuild_nested_tensor")
    rows = zip(sizes.tolist(), strides.tolist(), offsets.tolist())
    for i, (size, stride, offset) in enumerate(rows):
        where = f"{u.where}: nested component {i}: "
        if offset < 0 or any(n < 0 for n in (*size, *stride)):
            raise Refused(f"{where}a tensor view has a negative offset, size or stride")
        if view_bytes(offset, tuple(size), tuple(stride), 1, "") > buffer.numel():
            raise Refused(f"{where}a tensor view reaches outside its buffer of {buffer.numel()} elements (out of bounds)")
    return f(*args)


def _empty_tensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """A tensor class called as a legacy pickle calls it, ``torch.FloatTensor()``, then given its view by BUILD."""
    if args or kwargs:
        raise Refused(f"calling {type_name(f)} with arguments would create uninitialised memory; only "
                      f"{type_name(f)}() (then BUILD), as legacy pickles write it, is allowed")
    return f()


def build_tensor(u: Unpickler, inst: Any, state: Any) -> None:
    """Legacy BUILD of a tensor: ``set_(storage, offset, size, stride)``, inside the storage."""
    if not isinstance(state, tuple) or len(state) != 4:
        raise Refused("BUILD of a tensor: only the legacy (storage, offset, size, stride) state is read")
    check_view(*state, where=f"{u.where}: ")
    if storage_device(state[0]) != inst.device:
        raise NeedsValues(f"{u.where}: a legacy tensor can't be built on {storage_device(state[0])}")
    inst.set_(*state)


def _rebuild_parameter(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    torch = _torch()
    if kwargs or len(args) not in (3, 4) or not isinstance(args[0], torch.Tensor):
        raise Refused("_rebuild_parameter with unexpected arguments")
    _no_hooks(args[2])
    if len(args) == 4:
        _plain_state(args[3])
    return f(*args)


def _parameter(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    torch = _torch()
    if kwargs or len(args) > 2 or args and not isinstance(args[0], torch.Tensor) or len(args) == 2 and type(args[1]) is not bool:
        raise Refused("Parameter(data, requires_grad) with unexpected arguments")
    return f(*args)


def _rebuild_from_type(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    torch = _torch()
    if kwargs or len(args) != 4:
        raise Refused("_rebuild_from_type_v2 with unexpected arguments")
    func, new_type, inner_args, state = args
    if isinstance(new_type, subclasses.SubclassName):  # torchao's: a record of its inner tensors
        return subclasses.from_type(u, func, new_type, inner_args, state)
    if new_type not in (torch.Tensor, torch.nn.Parameter) or not isinstance(inner_args, tuple):
        raise Refused(f"_rebuild_from_type_v2 to {type_name(new_type)}: only plain tensors are rebuilt")
    _plain_state(state)
    built = u.call(func, inner_args, None, "REDUCE")  # through func's own guard
    return f(lambda: built, new_type, (), state)


def _sparse_tensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """A sparse tensor, its indices checked against its size at once: torch validates them only under
    ``weights_only=True`` (ckptfix's loads pass its own unpickler instead), and an index out of range
    makes a later ``to_dense()`` read or write out of bounds: when the load ends (:func:`check_made`; a legacy file's
    storages are filled after its pickle), on ``meta`` (structure reads) by the reader, from the indices' bytes."""
    import warnings

    import torch

    if kwargs or len(args) != 2:
        raise Refused("_rebuild_sparse_tensor with unexpected arguments")
    u.charge(sizes_of(args[1:]), "_rebuild_sparse_tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Sparse CSR tensor support is in beta state", on every verb's stderr
        result = f(*args)
    pending = torch._utils._sparse_tensors_to_validate
    pending[:] = [t for t in pending if t is not result]  # (checked by this load, not left for a later load's check)
    if getattr(_made, "sparse", None) is None:
        _made.sparse = []
    _made.sparse.append((result, u.where))
    return result


#: the sparse tensors this thread's load has rebuilt, with where: checked when the load ends (:func:`check_made`)
_made = threading.local()


def start_load() -> None:
    """Forget the sparse tensors of an earlier load that failed half-way."""
    _made.sparse = []


def check_made() -> None:
    """Check the indices of each sparse tensor the load rebuilt, now that its storages hold their bytes (a legacy
    file's are read after its pickle, as torch checks them after the load); those on meta are the structure reader's
    to check (:func:`check_sparse` with the indices read from the file)."""
    made, _made.sparse = getattr(_made, "sparse", None) or [], []
    for t, where in made:
        if t.device.type != "meta":
            check_sparse(t, list(sparse_parts(t)[:-1]), where)


def check_sparse(t: Any, indices: list[Any], where: str) -> None:
    """The sparse tensor ``t``'s ``indices`` (its index parts as :func:`sparse_parts` orders them, with values on the
    CPU; ``t`` itself may be on meta) fit its size, by torch's own validators (what ``torch.load(weights_only=True)``
    runs on a loaded one; its values' shape and dtype only, no values); else Refused, naming ``where``."""
    import warnings

    import torch

    values = sparse_parts(t)[-1]
    fake = torch.zeros((), dtype=values.dtype).expand(values.shape)  # (no memory: the validators read no value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch notes that validating costs a scan of the indices
            if t.layout == torch.sparse_coo:
                torch._validate_sparse_coo_tensor_args(indices[0], fake, t.shape, t.is_coalesced())
            else:
                torch._validate_sparse_compressed_tensor_args(indices[0], indices[1], fake, t.shape, t.layout)
    except (RuntimeError, ValueError, IndexError, NotImplementedError) as e:
        raise Refused(f"{where}: a sparse tensor's indices do not fit its size ({str(e).splitlines()[0]}): refused "
                      "(densifying it would read or write out of bounds)") from None


def _device_tensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kwargs or len(args) != 4 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.dtype):
        raise Refused("_rebuild_device_tensor_from_cpu_tensor with unexpected arguments")
    data = args[0]  # copied to the device: a view larger than its storage is charged
    u.charge(max(0, data.numel() * args[1].itemsize - data.untyped_storage().nbytes()),
             "_rebuild_device_tensor_from_cpu_tensor")
    return f(*args)


#: ``Rule.call`` → guard, for the tensor rebuilds (:func:`ckptfix.safety.guards` adds the others)
GUARDS: dict[str, Callable[..., Any]] = {
    "view v1": _rebuild_view(hooks_at=None), "view": _rebuild_view(), "view v3": _rebuild_view(position_of_dtype=6),
    "qtensor": _qtensor, "nested tensor": _nested, "empty tensor": _empty_tensor, "parameter": _parameter,
    "rebuild parameter": _rebuild_parameter, "sparse tensor": _sparse_tensor, "device tensor": _device_tensor,
    "from type": _rebuild_from_type, "wrapper subclass": subclasses.wrapper_subclass,
}
