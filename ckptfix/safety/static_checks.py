"""The allow-list's rules as the static scanner applies them: what a call or BUILD would be refused for.

:mod:`ckptfix.safety.guards` checks arguments as the loader runs; the scanner sees arguments only as far
as they are constants (as walked by :mod:`ckptfix.parse.pickle_walk`: globals are objects with ``.full``,
persistent ids ``.pid``), and applies the same rules, chosen by the same ``Rule.call`` and ``Rule.build``
of :data:`ckptfix.safety.allowlist.RULES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import limits as _limits
from ..core.torch_tables import STORAGE_DTYPES
from ..core.units import shown
from ..parse.unpickler import is_dunder
from . import numpy_policy
from .allowlist import HISTORY_BUFFER, INERT_DATA, PICKLE_CODECS, SUBCLASS, VALUE_ONLY, Rule, rule
from .subclasses import static_wrapper
from .standins import FACTORY_TYPES, STATISTICS_METHODS, short_args
from .tensor_guards import view_bytes

_STORAGE_ITEMSIZE = {"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
                     "Char": 1, "Byte": 1, "Bool": 1, "ComplexDouble": 16, "ComplexFloat": 8, "QInt8": 1,
                     "QUInt8": 1, "QInt32": 4, "QUInt4x2": 1, "QUInt2x4": 1, "Untyped": 1}
#: what a defaultdict's default factory may be named (as the loader's FACTORY_TYPES)
_FACTORY_NAMES = frozenset({f"builtins.{t.__name__}" for t in FACTORY_TYPES}
                           | {f"{t.__module__}.{t.__qualname__}" for t in FACTORY_TYPES})

Check = Callable[[str, Any, str, Rule | None], str | None]


def refused_call(name: str, args: Any, op: str = "REDUCE") -> str | None:
    """Why calling the safe/allowed global ``name`` with ``args`` would be refused by the loader, or None."""
    r = rule(name)
    if VALUE_ONLY.match(name) and r is None:
        return (f"{op} calls {name}, which would create uninitialised memory (ckptfix allows it only as a "
                "value, as torch.save writes it)")
    kind = (r.call or r.stand_in) if r is not None else None
    check = _CALLS.get(kind) if kind is not None else None
    return check(name, args, op, r) if check is not None else _refused_new(name, op, r)


def _refused_new(name: str, op: str, r: Rule | None) -> str | None:
    if op in ("NEWOBJ", "NEWOBJ_EX") and (r is None or r.new is None):
        return f"{op} creates a {name}, which ckptfix never creates that way"
    return None


def _empty_bytes(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    return None if args == () else "builtins.bytes is allowed only as bytes(), how pickle writes b''"


def _factory_token(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    return f"{name} is allowed only as a defaultdict's default factory, not called"


def _getattr(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if (isinstance(args, tuple) and len(args) == 2 and getattr(args[0], "full", None) == HISTORY_BUFFER
            and args[1] in STATISTICS_METHODS):
        return None
    return (f"getattr{short_args(args)} reaches an attribute; only getattr({HISTORY_BUFFER}, "
            "'min'|'max'|'current'|'mean') is allowed")


def _defaultdict(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if isinstance(args, tuple) and args and args[0] is not None and getattr(args[0], "full", None) not in _FACTORY_NAMES:
        return f"defaultdict{short_args(args)}: only builtin containers and numbers may be its default factory"
    return _refused_new(name, op, r)


def _bytearray(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if isinstance(args, tuple) and args and type(args[0]) is int:
        limit = _limits.current().max_alloc_bytes
        if args[0] > limit:
            return f"bytearray({args[0]}) asks for more than the limit max_alloc_bytes = {limit:,}"
    return _refused_new(name, op, r)


def _codecs_encode(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if isinstance(args, tuple) and len(args) == 2 and str(args[1]).lower() not in PICKLE_CODECS:
        return f"_codecs.encode with encoding {args[1]!r}: only latin1/utf-8 (as pickle writes bytes) is allowed"
    return _refused_new(name, op, r)


def _view(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if isinstance(args, tuple) and len(args) >= 4:
        return _static_view(args)
    return _refused_new(name, op, r)


def _empty_tensor(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if op == "REDUCE" and args == ():
        return None
    return (f"{op} calls {name}{short_args(args)}, which would create uninitialised memory (ckptfix calls a "
            f"tensor class only as a legacy pickle does: {name}() then BUILD)")


def _inert_data(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if op in ("NEWOBJ", "NEWOBJ_EX") and args == () and r is not None and r.new is not None:
        return None
    return (f"{op} of {name}{short_args(args)}: ckptfix reads it as data only as pickle writes it "
            "(NEWOBJ with no arguments, then BUILD)" if r is not None and r.new is not None
            else f"{op} calls {name}, which ckptfix reads only as a value")


def _enum_value(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    if op == "REDUCE" and isinstance(args, tuple) and len(args) == 1 and type(args[0]) in (str, int):
        return None
    return f"{op} of {name}{short_args(args)}: ckptfix reads an enum only as pickle writes it (REDUCE of one value)"


def _subclass(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    return f"{op} calls {name}, which ckptfix reads only as the class of torch's wrapper-subclass rebuild"


def _numpy(name: str, args: Any, op: str, r: Rule | None) -> str | None:
    reason = _refused_new(name, op, r)
    if reason is None and r is not None:
        reason = numpy_policy.STATIC_CALLS[r.call or r.stand_in or ""](name, args)
    return reason


#: ``Rule.call`` (or, for tokens never called, ``Rule.stand_in``) → the scanner's check
_CALLS: dict[str, Check] = {
    "empty bytes": _empty_bytes, "factory token": _factory_token, "getattr": _getattr,
    "defaultdict": _defaultdict, "bytearray": _bytearray, "codecs encode": _codecs_encode,
    "view": _view, "view v1": _view, "view v3": _view, "qtensor": _view, "empty tensor": _empty_tensor,
    INERT_DATA: _inert_data, "enum value": _enum_value, SUBCLASS: _subclass, "wrapper subclass": static_wrapper,
    **{kind: _numpy for kind in numpy_policy.STATIC_CALLS},
}


def storage_itemsize(name: str) -> int | None:
    """Bytes per element of a legacy storage type named ``FloatStorage`` etc., None if unknown."""
    return _STORAGE_ITEMSIZE.get(name[: -len("Storage")] if name.endswith("Storage") else "")


def _static_view(args: tuple[Any, ...]) -> str | None:
    """The view bounds check on constants: storage size from its persistent id (a sub-byte quantized
    storage's size is in bytes, as :func:`ckptfix.safety.tensor_guards.view_bytes` counts)."""
    pid = getattr(args[0], "pid", None)
    offset, size, stride = args[1], args[2], args[3]
    if not (isinstance(pid, tuple) and len(pid) >= 5 and isinstance(size, tuple) and isinstance(stride, tuple)
            and all(type(i) is int for i in (offset, *size, *stride, pid[4]))):
        return None  # not constants: the loader checks when it runs
    storage_name = getattr(pid[1], "name", "")
    itemsize = storage_itemsize(storage_name)
    if offset < 0 or any(n < 0 for n in (*size, *stride)) or len(size) != len(stride):
        return "a tensor view has a negative offset, size or stride"
    if itemsize is None or 0 in size:
        return None
    reach = view_bytes(offset, size, stride, itemsize, STORAGE_DTYPES.get(storage_name, ""))
    if reach > pid[4] * itemsize:
        return f"a tensor view reaches byte {reach} of a storage of {pid[4] * itemsize} bytes (out of bounds)"
    return None


def refused_build(name: str, state: Any) -> str | None:
    """Why BUILD on the result of calling ``name`` with ``state`` would be refused, or None."""
    r = rule(name)
    kind = r.build if r is not None else None
    if kind is None:
        return f"BUILD gives state to the result of {name}, which ckptfix never does"
    if kind == "attributes":
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        if not all(p is None or isinstance(p, dict) for p in parts):
            return f"BUILD of a {name}: state must be a dict of attribute names"
        dunder = next((k for p in parts if p for k in p if isinstance(k, str) and is_dunder(k)), None)
        if dunder is not None:
            return f"BUILD of a {name} sets its attribute {shown(dunder)}, which no checkpoint sets"
    check = numpy_policy.STATIC_BUILDS.get(kind)
    return check(state) if check is not None else None
