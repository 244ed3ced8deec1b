"""The executing policy: what each allowed global may be called with, and turning stand-ins into objects.

:func:`torch_policy` is the :class:`ckptfix.parse.unpickler.Policy` for torch checkpoints, read from the
allow-list (:data:`ckptfix.safety.allowlist.RULES`). Each rule's ``call`` names a guard that checks the
arguments before the real call: here ``bytearray`` and copies within ``max_alloc_bytes``; the tensor
rebuilds' guards (views inside their storage, quantized, nested and legacy tensors, Parameters without
hooks) in :mod:`ckptfix.safety.tensor_guards`. torch's storage classes get no guard at all (uninitialised
memory). BUILD reaches only the types a rule's ``build`` names.
"""

from __future__ import annotations

import builtins
import collections
import functools
import importlib
from collections.abc import Callable
from typing import Any

from . import numpy_policy, standins, subclasses, tensor_guards
from .tensor_guards import GUARDS as TENSOR_GUARDS, build_tensor, sizes_of
from .allowlist import (INERT_DATA, NEW, PICKLE_CODECS, RULES, SUBCLASS, ckptfix_names, numpy_dtype_classes,
                        numpy_names, refused_names, rule)
from ..parse.inert import InertGlobal, build as inert_build
from ..parse.unpickler import Policy, Refused, Unpickler, build_attributes, build_setstate, type_name

Guard = Callable[[Unpickler, Any, tuple[Any, ...], dict[str, Any]], Any]


def plain(u: Unpickler, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The guard of a callable that only builds data: what the call copies is charged to max_alloc_bytes."""
    u.charge(sizes_of(args) + sizes_of(tuple(kwargs.values())), type_name(f))
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


@functools.lru_cache(maxsize=1)
def _guards() -> dict[str, Guard]:
    """``Rule.call`` → the guard a call goes through."""
    return {
        "plain": plain, "empty": _no_args, "empty bytes": _no_args, "defaultdict": plain, "getattr": plain,
        "bytearray": _bytearray, "codecs encode": _codecs_encode, "enum value": subclasses.enum_value,
        **TENSOR_GUARDS, **numpy_policy.GUARDS,
    }


#: ``Rule.build`` → how BUILD gives state (numpy's: :data:`ckptfix.safety.numpy_policy.BUILDS`)
_BUILDS: dict[str, Callable[[Unpickler, Any, Any], None]] = {
    "attributes": build_attributes, "setstate": build_setstate, "tensor": build_tensor,
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
    SUBCLASS: subclasses.SubclassName,  # torchao's tensor classes: a name for the wrapper-subclass rebuild
    "enum": subclasses.EnumName,  # torchao's enums: a name, called only by the "enum value" guard
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
    tensor_guards.check_made()
    obj = subclasses.flatten(obj)
    items, made = standins.take_pending()
    if not items and not made:
        return obj  # nothing to replace: the common case costs nothing
    return _Restorer({id(o): f for o, f in items}).fix(obj)


def start_load() -> None:
    """Forget what an earlier load that failed half-way left pending (stand-ins, sparse tensors to check)."""
    standins.start_load()
    tensor_guards.start_load()


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
