"""Inert placeholders: what a global outside the allow-list becomes when the reader may keep it as data.

A checkpoint often holds, beside its weights, objects of classes the reading process can't or
mustn't import: a project's ``RunConfig`` dataclass, an OmegaConf ``DictConfig``, an enum. The
restricted unpickler (:mod:`ckptfix.parse.unpickler`), given a policy with an ``inert`` hook, gives
such a global as an :class:`InertGlobal` (its name, never looked up) and whatever REDUCE, NEWOBJ,
OBJ or INST would have made of it as an :class:`InertObject` (the name, the arguments and the BUILD
state, as the pickle holds them). Nothing is imported and nothing is called: not the class, not
its ``__new__``/``__setstate__``, not a payload nested in the state (a nested ``os.system`` is one
more InertObject). Whether a placeholder may stay where it sits is the reader's decision
(:func:`ckptfix.ops.reading.summarise`: never inside the selected state dict unless allowed).

>>> obj.config                                  # doctest: +SKIP
<inert myproj.config.RunConfig (not imported)>
>>> obj.config.state                            # doctest: +SKIP
{'lr': 0.001, 'layers': 4}
"""

from __future__ import annotations

from typing import Any

from ..core.units import shown
from .pickle_ops import Refused

_made = [0]  # placeholders made in this process: none, and no object can hold one (walks are skipped)
_COPYREG_RECONSTRUCTOR = "copyreg._reconstructor"  # protocol 0/1: _reconstructor(cls, base, state)


class InertGlobal:
    """A global named by the pickle, kept as its name: ``module.qualname``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name
        _made[0] += 1

    def __repr__(self) -> str:
        return f"<inert global {shown(self.name)} (not imported)>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"{shown(self.name)} was read as an inert placeholder (never imported); it can't be written back")


class InertObject:
    """What calling (REDUCE/NEWOBJ/OBJ/INST) the global ``name`` would have made: never made.

    ``args``: the call's arguments; ``state``: what BUILD would have given it (a dict of attributes for a
    plain class or dataclass); ``listitems`` / ``dictitems``: what APPEND / SETITEM put into it (a list
    or dict subclass); ``op``: the opcode that made it.
    """

    def __init__(self, name: str, args: tuple[Any, ...], op: str):
        self.name, self.args, self.op = name, args, op
        self.state: Any = None
        self.listitems: list[Any] = []
        self.dictitems: list[tuple[Any, Any]] = []
        _made[0] += 1

    # what the unpickler's APPEND(S) / SETITEM(S) call on their target
    def extend(self, items: list[Any]) -> None:
        self.listitems.extend(items)

    def append(self, item: Any) -> None:
        self.listitems.append(item)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems.append((key, value))

    def __repr__(self) -> str:
        return f"<inert {shown(self.name)} (not imported)>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"{shown(self.name)} was read as an inert placeholder (never imported); it can't be written back")


def call(func: InertGlobal, args: Any, op: str) -> InertObject:
    """The placeholder for ``func(*args)`` (or ``func.__new__(func, *args)``); nothing is called.
    ``copyreg._reconstructor(cls, base, state)`` (how protocols 0 and 1 pickle an object) is named by ``cls``."""
    if not isinstance(args, tuple):
        raise Refused(f"{op} of {shown(func.name)}: arguments must be a tuple")
    if func.name == _COPYREG_RECONSTRUCTOR and args and isinstance(args[0], InertGlobal):
        return InertObject(args[0].name, args[1:], op)
    return InertObject(func.name, args, op)


def build(u: Any, inst: InertObject, state: Any) -> None:
    """BUILD on a placeholder: the state is recorded, never applied (charged to max_alloc_bytes)."""
    u.charge(len(state) if isinstance(state, (dict, tuple, list)) else 1, f"BUILD of {shown(inst.name)}")
    if inst.state is not None:
        raise Refused(f"BUILD gives {shown(inst.name)} state twice")
    inst.state = state


def any_made() -> bool:
    """Whether any placeholder was ever made in this process (else no object can hold one)."""
    return bool(_made[0])


def find(obj: Any) -> list[tuple[str, str]]:
    """Every placeholder in ``obj`` as (where, global name), where is a path of keys (``config``,
    ``hparams.mode``); in containers, placeholders' own arguments and state, and object attributes.
    Iterative; shared objects are visited once."""
    if not _made[0]:
        return []
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        x, where = stack.pop()
        if isinstance(x, (str, bytes, int, float, complex)) or x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (InertGlobal, InertObject)):
            found.append((where, x.name))
            if isinstance(x, InertGlobal):
                continue
            children: list[tuple[Any, str]] = [(a, where) for a in x.args] + [(x.state, where)]
            children += [(v, where) for v in x.listitems] + [(v, where) for kv in x.dictitems for v in kv]
        elif isinstance(x, dict):
            children = [(k, where) for k in x] + [(v, f"{where}.{k}" if where else str(k)) for k, v in x.items()]
        elif isinstance(x, (list, tuple, set, frozenset)):
            children = [(v, where) for v in x]
        else:
            state = getattr(x, "__dict__", None)
            children = [(v, where) for v in state.values()] if type(state) is dict else []
        stack.extend(reversed(children))
    return found


def names(found: list[tuple[str, str]]) -> list[str]:
    """The distinct global names of :func:`find`'s answer, sorted."""
    return sorted({name for _, name in found})
