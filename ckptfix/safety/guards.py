"""The executing policy: what each allowed global may be called with, and turning stand-ins into objects.

:func:`torch_policy` is the :class:`ckptfix.parse.unpickler.Policy` for torch checkpoints, read from the
allow-list (:data:`ckptfix.safety.allowlist.RULES`). Each rule's ``call`` names a guard here that checks
the arguments before the real call: tensor views inside their storage, ``bytearray`` and copies within
``max_alloc_bytes``, Parameters and rebuilt tensors without hooks; torch's tensor and storage classes
get no guard at all (uninitialised memory). BUILD reaches only the types a rule's ``build`` names.
"""

from __future__ import annotations

import builtins
import collections
import functools
import importlib
from collections.abc import Callable
from typing import Any

from . import numpy_policy, standins
from .allowlist import (INERT_DATA, NEW, PICKLE_CODECS, RULES, ckptfix_names, numpy_dtype_classes, numpy_names,
                        refused_names, rule)
from ..parse.inert import InertGlobal, build as inert_build
from ..parse.unpickler import Policy, Refused, Unpickler, build_attributes, build_setstate, type_name

Guard = Callable[[Unpickler, Any, tuple[Any, ...], dict[str, Any]], Any]


def _sizes(args: Any) -> int:
    return sum(len(a) for a in args if isinstance(a, (str, bytes, bytearray, tuple, list, dict, set, frozenset)))


def plain(u: Unpickler, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The guard of a callable that only builds data: what the call copies is charged to max_alloc_bytes."""
    u.charge(_sizes(args) + _sizes(tuple(kwargs.values())), type_name(f))
    return f(*args, **kwargs)


def _no_args(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    if args or kwargs:
        raise Refused(f"{type_name(f)} is created empty and filled by BUILD; the pickle passes arguments")
    return f()


def _bytearray(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) > 2 or args and isinstance(args[0], bool):
        raise Refused("bytearray is allowed only as pickle writes it: bytearray(bytes) or bytearray(str, encoding)")
    if args and isinstance(args[0], int):
        u.charge(args[0], f"bytearray({args[0]})")
    elif args and not isinstance(args[0], (bytes, bytearray, str, list)):
        raise Refused(f"bytearray of a {type_name(args[0])} is not allowed")
    return plain(u, f, args, {})


def _codecs_encode(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs or not 1 <= len(args) <= 2 or not isinstance(args[0], str) or (
            len(args) == 2 and str(args[1]).lower() not in PICKLE_CODECS):
        raise Refused("_codecs.encode is allowed only as pickle writes bytes: encode(str, 'latin1')")
    return plain(u, f, args, {})


def check_view(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any = None,
               where: str = "") -> tuple[int, int, int]:
    """A tensor view must lie inside its storage: non-negative offset, sizes and strides, and its
    furthest element within the storage (torch would *resize* the storage instead: uninitialised
    memory, or on ``meta`` another record's bytes). Returns (elements, element size, storage bytes)."""
    torch = _torch()
    if type(storage) is torch.storage.TypedStorage:
        itemsize, nbytes = storage.dtype.itemsize, storage._untyped_storage.nbytes()
    elif isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        itemsize = 1 if isinstance(storage, torch.UntypedStorage) else storage.dtype.itemsize
        nbytes = storage.nbytes() if isinstance(storage, torch.UntypedStorage) else storage._untyped_storage.nbytes()
    else:
        raise Refused(f"{where}a tensor is rebuilt from a {type_name(storage)}, not a storage")
    if dtype is not None:
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or type(offset) is not int:
        raise Refused(f"{where}a tensor view has malformed offset/size/stride")
    if len(size) != len(stride) or len(size) > 64 or itemsize <= 0:
        raise Refused(f"{where}a tensor view has malformed offset/size/stride")
    reach, numel = offset, 1
    empty = False
    for n, s in zip(size, stride):
        if type(n) is not int or type(s) is not int:
            raise Refused(f"{where}a tensor view has malformed offset/size/stride")
        if n < 0 or s < 0:
            raise Refused(f"{where}a tensor view has a negative offset, size or stride")
        if n == 0:
            empty = True
        reach += (n - 1) * s
        numel *= n
    if offset < 0:
        raise Refused(f"{where}a tensor view has a negative offset, size or stride")
    if not empty and (reach + 1) * itemsize > nbytes:
        raise Refused(f"{where}a tensor view reaches element {reach + 1} of a storage of "
                      f"{nbytes // itemsize} elements (out of bounds)")
    return numel, itemsize, nbytes


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


def _rebuild_view(position_of_dtype: int | None = None, hooks_at: int | None = 5, allocates: bool = False) -> Callable:
    """The guard of a rebuild function taking (storage, offset, size, stride, …); ``allocates``: it
    first allocates a tensor of ``size`` (quantized tensors), so a view larger than its storage is
    charged to max_alloc_bytes."""

    def guard(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs or len(args) < 4:
            raise Refused(f"{type_name(f)} with unexpected arguments")
        dtype = args[position_of_dtype] if position_of_dtype is not None and len(args) > position_of_dtype else None
        numel, itemsize, nbytes = check_view(args[0], args[1], args[2], args[3], dtype, where=f"{u.where}: ")
        if hooks_at is not None and len(args) > hooks_at:
            _no_hooks(args[hooks_at])
        u.charge(len(args[2]) * 2 + (max(0, numel * itemsize - nbytes) if allocates else 0), type_name(f))
        return f(*args)

    return guard


def _rebuild_parameter(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kwargs or len(args) not in (3, 4) or not isinstance(args[0], torch.Tensor):
        raise Refused("_rebuild_parameter with unexpected arguments")
    _no_hooks(args[2])
    if len(args) == 4:
        _plain_state(args[3])
    return f(*args)


def _parameter(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kwargs or len(args) > 2 or args and not isinstance(args[0], torch.Tensor) or len(args) == 2 and type(args[1]) is not bool:
        raise Refused("Parameter(data, requires_grad) with unexpected arguments")
    return f(*args)


def _rebuild_from_type(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kwargs or len(args) != 4:
        raise Refused("_rebuild_from_type_v2 with unexpected arguments")
    func, new_type, inner_args, state = args
    if new_type not in (torch.Tensor, torch.nn.Parameter) or not isinstance(inner_args, tuple):
        raise Refused(f"_rebuild_from_type_v2 to {type_name(new_type)}: only plain tensors are rebuilt")
    _plain_state(state)
    built = u.call(func, inner_args, None, "REDUCE")  # through func's own guard
    return f(lambda: built, new_type, (), state)


def _sparse_tensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """A sparse tensor, its indices checked against its size at once: torch validates them only under
    ``weights_only=True`` (ckptfix's loads pass its own unpickler instead), and an index out of range
    makes a later ``to_dense()`` read or write out of bounds. On ``meta`` (structure reads) there is
    no data to check, or to read."""
    import warnings

    import torch

    if kwargs or len(args) != 2:
        raise Refused("_rebuild_sparse_tensor with unexpected arguments")
    u.charge(_sizes(args[1:]), "_rebuild_sparse_tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Sparse CSR tensor support is in beta state", on every verb's stderr
        result = f(*args)
    pending = torch._utils._sparse_tensors_to_validate
    if result.device.type == "meta":
        if any(t is result for t in pending):
            pending[:] = [t for t in pending if t is not result]
        return result
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch notes that validating costs a scan of the indices
            torch._utils._validate_loaded_sparse_tensors(weights_only=True)
    except (RuntimeError, ValueError, IndexError, NotImplementedError) as e:
        raise Refused(f"{u.where}: a sparse tensor's indices do not fit its size ({str(e).splitlines()[0]}): refused "
                      "(densifying it would read or write out of bounds)") from None
    return result


def _device_tensor(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    if kwargs or len(args) != 4 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.dtype):
        raise Refused("_rebuild_device_tensor_from_cpu_tensor with unexpected arguments")
    data = args[0]  # copied to the device: a view larger than its storage is charged
    u.charge(max(0, data.numel() * args[1].itemsize - data.untyped_storage().nbytes()),
             "_rebuild_device_tensor_from_cpu_tensor")
    return f(*args)


def _build_tensor(u: Unpickler, inst: Any, state: Any) -> None:
    """Legacy BUILD of a tensor: ``set_(storage, offset, size, stride)``, inside the storage."""
    if not isinstance(state, tuple) or len(state) != 4:
        raise Refused("BUILD of a tensor: only the legacy (storage, offset, size, stride) state is read")
    check_view(*state, where=f"{u.where}: ")
    inst.set_(*state)


@functools.lru_cache(maxsize=1)
def _guards() -> dict[str, Guard]:
    """``Rule.call`` → the guard a call goes through."""
    return {
        "plain": plain, "empty": _no_args, "empty bytes": _no_args, "defaultdict": plain, "getattr": plain,
        "bytearray": _bytearray, "codecs encode": _codecs_encode, "parameter": _parameter,
        "view v1": _rebuild_view(hooks_at=None), "view": _rebuild_view(), "view v3": _rebuild_view(position_of_dtype=6),
        "qtensor": _rebuild_view(hooks_at=6, allocates=True), "rebuild parameter": _rebuild_parameter,
        "sparse tensor": _sparse_tensor, "device tensor": _device_tensor, "from type": _rebuild_from_type,
        **numpy_policy.GUARDS,
    }


#: ``Rule.build`` → how BUILD gives state (numpy's: :data:`ckptfix.safety.numpy_policy.BUILDS`)
_BUILDS: dict[str, Callable[[Unpickler, Any, Any], None]] = {
    "attributes": build_attributes, "setstate": build_setstate, "tensor": _build_tensor,
    INERT_DATA: inert_build,  # (the unpickler's own handler for every placeholder: state recorded, never applied)
}


def _fixed(obj: Any) -> Callable[[str], Any]:
    return lambda name: obj


#: ``Rule.stand_in`` → what the unpickler gives for the name (made from the name)
_STAND_INS: dict[str, Callable[[str], Any]] = {
    "defaultdict": _fixed(standins.defaultdict_stand_in),
    "deque": _fixed(standins.Deque),
    "empty bytes": _fixed(standins.empty_bytes),
    "factory token": lambda name: standins.FactoryToken(getattr(builtins, name.rpartition(".")[2])),
    "path": standins.path_class,
    "getattr": _fixed(standins.getattr_method),
    "history buffer": _fixed(standins.HistoryBuffer),
    INERT_DATA: InertGlobal,  # made into a placeholder by NEWOBJ and BUILD, never imported
    **{kind: _fixed(obj) for kind, obj in numpy_policy.STAND_INS.items()},
}


@functools.lru_cache(maxsize=1)
def ckptfix_objects() -> dict[str, Any]:
    """ckptfix's additions to torch's defaults: name as pickled (``module.qualname``) → the object the
    unpickler gives (the real class, or a stand-in); numpy's only where numpy is installed."""
    names = ckptfix_names() | numpy_names()
    table: dict[str, Any] = {}
    for name, r in RULES.items():
        if name not in names:
            continue
        if r.stand_in is not None:
            table[name] = _STAND_INS[r.stand_in](name)
        else:  # one of the table's own names, never one from a file
            module, _, qualname = name.rpartition(".")
            table[name] = getattr(importlib.import_module(module), qualname)
    table.update(numpy_dtype_classes())
    return table


@functools.lru_cache(maxsize=2)
def torch_policy(placeholders: bool = False) -> Policy:
    """The policy for torch checkpoints (zip, legacy and tar pickles, DCP records). ``placeholders``: a global
    outside the allow-list becomes an inert placeholder (:mod:`ckptfix.parse.inert`) instead of a refusal,
    for a torch file's own pickle, whose reader refuses placeholders inside the state dict."""
    import torch
    from torch._weights_only_unpickler import _get_allowed_globals

    refused = refused_names()
    table = {k: v for k, v in _get_allowed_globals().items() if k not in refused}
    table.update(ckptfix_objects())
    guards = _guards()
    calls: dict[int, Callable[..., Any]] = {}
    newobj: set[int] = set()
    build: dict[type, Callable[..., Any]] = {}
    for name, obj in table.items():
        r = rule(name)
        if r is None or r.stand_in == INERT_DATA:
            continue  # torch's values (classes, dtypes); inert data, which the unpickler makes placeholders of
        if r.call is not None:
            calls[id(obj)] = guards[r.call]
        if r.new == NEW:
            newobj.add(id(obj))
        if r.build in numpy_policy.BUILDS:
            build[numpy_policy.BUILDS[r.build]] = build_setstate
        elif r.build is not None:
            made = obj if isinstance(obj, type) else torch.Tensor  # the rebuild functions make tensors
            build[made] = _BUILDS[r.build]
    return Policy(table, calls, newobj, build, append=(list, standins.Deque),
                  setitem=(dict, collections.OrderedDict, collections.Counter), finish=_finish,
                  inert=InertGlobal if placeholders else None)


def _finish(obj: Any) -> Any:
    items, made = standins.take_pending()
    if not items and not made:
        return obj  # nothing to replace: the common case costs nothing
    return _Restorer({id(o): f for o, f in items}).fix(obj)


start_load = standins.start_load


class _Restorer:
    """Replace stand-ins everywhere they sit (dict values, list items, tuples, attributes).

    Iterative (post-order with an explicit stack), so nesting as deep as the limit max_depth allows
    can't exhaust the interpreter's stack; shared objects are replaced once, cycles kept.
    """

    def __init__(self, factories: dict[int, Any]):
        self.factories = factories
        self.done: dict[int, Any] = {}

    def fix(self, root: Any) -> Any:
        import torch

        atoms = (str, bytes, int, float, complex, torch.Tensor)
        done, busy = self.done, set()
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            x, expanded = stack.pop()
            if x is None or isinstance(x, atoms) or id(x) in done:
                continue
            if not expanded:
                if id(x) in busy:
                    continue  # a cycle: x is rebuilt (in place) when its own turn comes
                busy.add(id(x))
                stack.append((x, True))
                stack.extend((child, False) for child in self._children(x))
                continue
            done[id(x)] = self._rebuild(x)
        return done.get(id(root), root)

    def _children(self, x: Any) -> list[Any]:
        if isinstance(x, numpy_policy.NUMPY_STAND_INS):
            return []
        if isinstance(x, dict):
            return list(x.values())
        if isinstance(x, (list, tuple)):
            return list(x)
        state = getattr(x, "__dict__", None)
        return list(state.values()) if isinstance(state, dict) else []

    def _rebuild(self, x: Any) -> Any:
        done = self.done

        def get(v: Any) -> Any:
            return done.get(id(v), v)

        if isinstance(x, numpy_policy.NUMPY_STAND_INS):
            return x.real()
        if isinstance(x, standins.Deque):
            out: Any = collections.deque((get(v) for v in x), maxlen=x.maxlen)
        elif isinstance(x, dict) and id(x) in self.factories:
            out = collections.defaultdict(self.factories[id(x)])
            out.update((k, get(v)) for k, v in x.items())
        elif isinstance(x, dict):
            for k, v in list(x.items()):
                x[k] = get(v)
            out = x
        elif isinstance(x, list):
            x[:] = [get(v) for v in x]
            out = x
        elif isinstance(x, tuple):
            items = tuple(get(v) for v in x)
            out = x if all(a is b for a, b in zip(items, x)) else items
        else:
            if isinstance(getattr(x, "__dict__", None), dict):
                for k, v in list(vars(x).items()):
                    vars(x)[k] = get(v)
            out = x
        return out
