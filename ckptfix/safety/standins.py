"""Inert stand-ins for the few classes of other libraries that real training checkpoints pickle,
a pickler that writes them back under the original names, and the stand-ins the unpickler fills in
place of ``defaultdict``, ``deque`` and ``bytes`` (turned into the real objects once a load ends).

mmengine's ``message_hub`` holds ``mmengine.logging.history_buffer.HistoryBuffer`` objects (numpy
histories of the logged scalars). Unpickling the real class runs mmengine's ``__setstate__``; the
stand-in only stores the attributes, so loading runs nothing from mmengine (mmengine need not be
installed). Its ``__getstate__`` adds the class's ``statistics_methods``, which a protocol-2
pickle names as ``getattr(HistoryBuffer, 'min')``: ``getattr`` is accepted for exactly those
four names on that class, and gives back an inert token, never an attribute.

Writing a converted checkpoint with ``--keep-extra`` puts the same opcodes back (GLOBAL
``mmengine.logging.history_buffer HistoryBuffer``, NEWOBJ, BUILD; ``getattr`` REDUCE for the
tokens), so mmengine resumes from the output as from the input. The C pickler can't name a class
whose module it can't import, so those writes use :class:`NamePickler` (pure Python), and only
when :func:`contains_stand_ins` finds one.
"""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
import threading
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..parse.pickle_ops import Refused, type_name
from .allowlist import HISTORY_BUFFER

_made = [0]  # stand-ins unpickled in this process: none, and no object can hold one (writers skip the walk)
#: getattr(HistoryBuffer, name) in a HistoryBuffer's statistics_methods: its four default statistics
STATISTICS_METHODS = frozenset({"min", "max", "current", "mean"})


class HistoryBuffer:
    """Data-only stand-in for mmengine's HistoryBuffer: ``max_length``, ``_log_history`` and
    ``_count_history`` (numpy arrays) as saved, plus ``statistics_methods`` when the file has it."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _refused(f"{HISTORY_BUFFER}: state must be a dict of attributes")
        _made[0] += 1
        self.__dict__.update(state)

    @property
    def data(self) -> tuple[Any, Any]:
        """(log history, count history), as mmengine's ``HistoryBuffer.data``."""
        return self.__dict__.get("_log_history"), self.__dict__.get("_count_history")

    def __repr__(self) -> str:
        return f"<{HISTORY_BUFFER} stand-in: {len(self.data[0]) if self.data[0] is not None else 0} values>"


# Named as the original, so a writer that doesn't know stand-ins (the C pickler) fails loudly
# instead of writing ckptfix's own name, which no loader would accept.
HistoryBuffer.__module__, HistoryBuffer.__qualname__ = HISTORY_BUFFER.rsplit(".", 1)


class StatisticsMethod:
    """``getattr(HistoryBuffer, name)`` as loaded: a name, not a function; calling it is refused."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{HISTORY_BUFFER}.{self.name} is a loaded name, not mmengine's method")

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return getattr, (HistoryBuffer, self.name)

    def __repr__(self) -> str:
        return f"<{HISTORY_BUFFER}.{self.name}>"


_METHODS = {name: StatisticsMethod(name) for name in sorted(STATISTICS_METHODS)}


def getattr_method(obj: Any, name: Any, *default: Any) -> StatisticsMethod:
    """Stands in for ``builtins.getattr`` while unpickling: only ``getattr(HistoryBuffer, <statistic>)``."""
    if obj is not HistoryBuffer or default or name not in _METHODS:
        raise _refused(
            f"getattr is allowed only as getattr({HISTORY_BUFFER}, {'|'.join(sorted(STATISTICS_METHODS))!r}); "
            f"the pickle asks for getattr({getattr(obj, '__name__', type(obj).__name__)}, {name!r})"
        )
    _made[0] += 1
    return _METHODS[name]


#: stand-in class → the (module, qualname) it is pickled under
ORIGINAL_NAMES: dict[type, tuple[str, str]] = {HistoryBuffer: (HistoryBuffer.__module__, HistoryBuffer.__qualname__)}
_STAND_IN_TYPES = (HistoryBuffer, StatisticsMethod)


def contains_stand_ins(obj: Any) -> bool:
    """Whether ``obj`` holds a stand-in (in containers, attribute dicts or object arrays)."""
    if not _made[0]:
        return False
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if isinstance(x, (str, bytes, int, float, complex)) or x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, _STAND_IN_TYPES):
            return True
        if isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            stack.extend(x)
        elif type(x).__name__ == "ndarray" and getattr(getattr(x, "dtype", None), "hasobject", False):
            stack.extend(x.ravel().tolist())
        if isinstance(getattr(x, "__dict__", None), dict):
            stack.extend(vars(x).values())
    return False


if TYPE_CHECKING:
    class _PurePickler(pickle._Pickler):
        """pickle's pure-Python pickler with the undocumented internals NamePickler uses (typeshed leaves
        them out)."""

        proto: int

        def save(self, obj: Any) -> None: ...
        def save_global(self, obj: Any, name: str | None = None) -> None: ...
        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: Any) -> None: ...
else:
    _PurePickler = pickle._Pickler


class NamePickler(_PurePickler):
    """Python's own pickler, writing each stand-in class as a global under its original name."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        original = ORIGINAL_NAMES.get(obj) if isinstance(obj, type) else None
        if original is None:
            super().save_global(obj, name)
            return
        module, qualname = original
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


class _NamePickleModule:
    """What ``torch.save(pickle_module=...)`` uses of a pickle module: its ``Pickler``."""

    Pickler = NamePickler
    Unpickler = pickle.Unpickler


def pickle_module_for(obj: Any) -> Any:
    """The ``pickle_module`` for ``torch.save(obj, …)``: ``pickle`` unless ``obj`` holds stand-ins."""
    return _NamePickleModule if contains_stand_ins(obj) else pickle


def pickler_base_for(obj: Any) -> type:
    """The pickler class to subclass for writing ``obj``: the C one unless it holds stand-ins."""
    return NamePickler if contains_stand_ins(obj) else pickle.Pickler


# -- defaultdict, deque and bytes while the unpickler fills them --------------------------------------

#: what a defaultdict's default_factory may be: builtin containers and numbers
FACTORY_TYPES = (list, dict, set, int, float, str, tuple, bool, collections.OrderedDict, collections.Counter)


class FactoryToken:
    """A builtin type named in a pickle, accepted only as a defaultdict's ``default_factory``.

    The token itself can't be called, so a pickle can't use ``builtins.str`` etc. as a function.
    """

    def __init__(self, type_: type):
        self.type = type_

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise Refused(f"{self.type.__name__} is allowed only as a defaultdict's default factory")


def defaultdict_stand_in(default_factory: Any = None, *rest: Any) -> dict[Any, Any]:
    """Stands in for ``collections.defaultdict`` while the unpickler fills it (it fills only exact
    dicts); the plain dict becomes a real defaultdict once loading ends."""
    factory = default_factory.type if isinstance(default_factory, FactoryToken) else default_factory
    if rest or not (factory is None or factory in FACTORY_TYPES):
        raise Refused(f"defaultdict with default factory {type_name(factory)} is not allowed "
                      "(only builtin containers and numbers)")
    d: dict[Any, Any] = {}
    remember(d, factory)
    return d


class Deque(list[Any]):
    """Stands in for ``collections.deque`` while the unpickler appends to it; a real deque afterwards."""

    def __init__(self, iterable: Any = (), maxlen: int | None = None):
        super().__init__(iterable)
        self.maxlen = maxlen
        remember(self, None)


def path_class(name: str, pure: bool = False) -> type:
    """The class a pickled ``pathlib`` class name loads as: a path object is a tuple of strings, and
    the concrete class of the other OS can't be instantiated here, so it (or any, with ``pure``) loads
    as its pure counterpart, which holds the same parts."""
    qualname = name.rpartition(".")[2]
    posix = "Posix" in qualname
    counterpart = pathlib.PurePosixPath if posix else pathlib.PureWindowsPath
    native = (os.name != "nt") == posix
    if pure or qualname.startswith("Pure") or not native:
        return counterpart
    return pathlib.PosixPath if posix else pathlib.WindowsPath


def empty_bytes(*args: Any) -> bytes:
    """``bytes()`` — how protocol 2 pickles ``b""`` (other bytes go through ``_codecs.encode``)."""
    if args:
        raise Refused("builtins.bytes is allowed only as bytes(), how pickle writes b''")
    return b""


# -- what one load made, to be turned into the real objects when it finishes ---------------------------

_pending = threading.local()


def start_load() -> None:
    """Forget stand-ins of an earlier load that failed half-way (each load restores its own)."""
    _pending.items, _pending.made = [], 0


def remember(stand_in: Any, factory: Any) -> None:
    """A defaultdict/deque stand-in (plain dict/list while loading) and its default factory."""
    if getattr(_pending, "items", None) is None:
        _pending.items = []
    _pending.items.append((stand_in, factory))


def note_made() -> None:
    """A stand-in that replaces itself when the load finishes (numpy's) was made."""
    _pending.made = getattr(_pending, "made", 0) + 1


def take_pending() -> tuple[list[tuple[Any, Any]], int]:
    """(defaultdict/deque stand-ins with their factories, count of other stand-ins) of this load; reset."""
    items, made = getattr(_pending, "items", None) or [], getattr(_pending, "made", 0)
    start_load()
    return items, made


def short_args(args: Any) -> str:
    """Call arguments as walked statically (globals by name), cut to 80 characters, for messages."""
    text = repr(tuple(getattr(a, "full", a) for a in args)) if isinstance(args, tuple) else f"({args!r})"
    return text if len(text) <= 80 else text[:77] + "..."


def _refused(message: str) -> Exception:
    return Refused(message)
