"""The allow-list: harmless globals real training checkpoints carry, beyond torch's own defaults.

torch's ``weights_only`` unpickler builds only tensors, storages, dtypes, ``OrderedDict``,
``Counter``, ``set``, ``complex`` and friends. Training checkpoints also hold hyper-parameters
(``argparse.Namespace``), numpy scalars, paths, timestamps and torch's version string. Each entry
below constructs plain data and runs no code taken from the file; ``classify`` names a global
``safe`` (torch's own), ``allowed`` (this list) or ``unsafe`` (anything else).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import os
import pathlib
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import standins

SAFE, ALLOWED, UNSAFE = "safe", "allowed", "unsafe"

_pending = threading.local()  # stand-ins made during the current load, to restore afterwards


class _FactoryType:
    """A builtin type named in a pickle, accepted only as a defaultdict's ``default_factory``.

    The token itself can't be called, so a pickle can't use ``builtins.str`` etc. as a function.
    """

    def __init__(self, type_: type):
        self.type = type_

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.type.__name__} is allowed only as a defaultdict's default factory")


_FACTORY_TYPES = (list, dict, set, int, float, str, tuple, bool, collections.OrderedDict, collections.Counter)


def _defaultdict(default_factory: Any = None, *rest: Any) -> dict:
    """Stands in for ``collections.defaultdict`` while torch's unpickler fills it (it fills only
    exact dicts); the plain dict becomes a real defaultdict once loading ends."""
    factory = default_factory.type if isinstance(default_factory, _FactoryType) else default_factory
    if rest or not (factory is None or factory in _FACTORY_TYPES):
        raise pickle.UnpicklingError(f"defaultdict with default factory {default_factory!r} is not allowed")
    d: dict = {}
    _remember(d, factory)
    return d


class _Deque(list):
    """Stands in for ``collections.deque`` while torch's unpickler appends to it (it appends only
    to lists); it becomes a real deque once loading ends."""

    def __init__(self, iterable: Any = (), maxlen: int | None = None):
        super().__init__(iterable)
        self.maxlen = maxlen
        _remember(self, None)


class _ClassToken:
    """A class named in a pickle only to be handed to one constructor that checks for it (numpy's
    ``_reconstruct``); the token itself can't be called or instantiated."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.name} is allowed only as the subtype numpy's _reconstruct is given")


_NDARRAY = _ClassToken("numpy.ndarray")


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> Any:
    """numpy's ``_reconstruct`` only as ``ndarray.__reduce__`` calls it: an empty plain ndarray, which
    the pickle's BUILD (``ndarray.__setstate__``: shape, dtype, raw bytes, all checked by numpy) fills."""
    import numpy as np
    from numpy._core import multiarray

    if subtype is not _NDARRAY or shape != (0,) or dtype_code != b"b":
        raise pickle.UnpicklingError("numpy _reconstruct is allowed only as numpy pickles an array: "
                                     "_reconstruct(numpy.ndarray, (0,), b'b'); subclasses such as memmap are refused")
    return multiarray._reconstruct(np.ndarray, (0,), b"b")


def _remember(stand_in: Any, factory: Any) -> None:
    if getattr(_pending, "items", None) is None:
        _pending.items = []
    _pending.items.append((stand_in, factory))


def _path_classes() -> list[tuple[str, Any]]:
    # A path object is a tuple of strings. The concrete class of the other OS can't be
    # instantiated here, so it loads as its pure counterpart, which holds the same parts.
    posix = pathlib.PosixPath if os.name != "nt" else pathlib.PurePosixPath
    windows = pathlib.WindowsPath if os.name == "nt" else pathlib.PureWindowsPath
    out = []
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 pickles pathlib._local.PosixPath
        out += [(f"{module}.PosixPath", posix), (f"{module}.WindowsPath", windows),
                (f"{module}.PurePosixPath", pathlib.PurePosixPath),
                (f"{module}.PureWindowsPath", pathlib.PureWindowsPath)]
    return out


def _numpy_entries() -> list[tuple[str, Any]]:
    try:
        import numpy as np
        from numpy._core import multiarray
    except ImportError:  # pragma: no cover - numpy is optional
        return []
    # scalar(dtype, raw_bytes) rebuilds a numpy scalar from its bytes; numpy 1.x pickles it
    # under numpy.core, 2.x under numpy._core (no numpy.core import is ever needed).
    out: list[tuple[str, Any]] = [
        ("numpy.core.multiarray.scalar", multiarray.scalar),
        ("numpy._core.multiarray.scalar", multiarray.scalar),
        ("numpy.dtype", np.dtype),  # dtype(spec) plus __setstate__ of byte order/fields: data only
    ]
    # Arrays (mmengine's HistoryBuffer histories): _reconstruct(ndarray, (0,), b'b') + BUILD. The name
    # numpy.ndarray is a token only _reconstruct accepts; the class itself is listed under a name no
    # pickle can spell (GLOBAL names end at a newline) because torch's BUILD needs it among the values.
    out += [("numpy.core.multiarray._reconstruct", _reconstruct), ("numpy._core.multiarray._reconstruct", _reconstruct),
            ("numpy.ndarray", _NDARRAY), ("numpy.ndarray\n(BUILD target of _reconstruct only)", np.ndarray)]
    dtypes = getattr(np, "dtypes", None)  # the DType classes (numpy >= 1.25): dtype constructors
    for name in dir(dtypes) if dtypes is not None else []:
        if name.endswith("DType") and isinstance(getattr(dtypes, name), type):
            out.append((f"numpy.dtypes.{name}", getattr(dtypes, name)))
    return out


@functools.lru_cache(maxsize=1)
def allowed_table() -> dict[str, Any]:
    """Name as pickled (``module.qualname``) → the object torch's unpickler may use for it."""
    from torch.torch_version import TorchVersion

    table: dict[str, Any] = {
        # Hyper-parameters from argparse: NEWOBJ + BUILD of a plain attribute dict.
        "argparse.Namespace": argparse.Namespace,
        # Containers of already-unpickled values (torch allows OrderedDict and Counter itself).
        "collections.defaultdict": _defaultdict,
        "collections.deque": _Deque,
        # Timestamps: constructed from bytes, numbers and a fixed-offset timezone.
        "datetime.datetime": datetime.datetime,
        "datetime.date": datetime.date,
        "datetime.time": datetime.time,
        "datetime.timedelta": datetime.timedelta,
        "datetime.timezone": datetime.timezone,
        # torch.__version__ as saved by Lightning and others: a str subclass.
        "torch.torch_version.TorchVersion": TorchVersion,
    }
    # A defaultdict's default_factory (defaultdict(list) pickles builtins.list): tokens only.
    for t in (list, dict, int, float, str, tuple, bool):
        table[f"builtins.{t.__name__}"] = _FactoryType(t)
    table.update(_path_classes())
    table.update(_numpy_entries())
    # mmengine's message_hub: HistoryBuffer loads as an inert stand-in (attributes only; mmengine's
    # __setstate__ never runs, mmengine is never imported) and getattr only as the getattr(HistoryBuffer,
    # 'min'|'max'|'current'|'mean') a protocol-2 pickle writes for its statistics_methods: an inert token.
    table[standins.HISTORY_BUFFER] = standins.HistoryBuffer
    table["builtins.getattr"] = standins.getattr_method
    return table


def refused_call(name: str, args: Any) -> str | None:
    """Why calling the allowed global ``name`` with ``args`` (as walked statically: globals are
    objects with ``.full``) would be refused by the loader, or None. For the scanner."""

    def global_name(x: Any) -> str | None:
        return getattr(x, "full", None)

    if name == "builtins.getattr":
        ok = (isinstance(args, tuple) and len(args) == 2 and global_name(args[0]) == standins.HISTORY_BUFFER
              and args[1] in standins.STATISTICS_METHODS)
        return None if ok else f"getattr{_short(args)} reaches an attribute; only getattr({standins.HISTORY_BUFFER}, " \
                               "'min'|'max'|'current'|'mean') is allowed"
    if name.endswith("multiarray._reconstruct") and not (isinstance(args, tuple) and len(args) == 3
                                                         and global_name(args[0]) == "numpy.ndarray" and args[1] == (0,)):
        return f"numpy _reconstruct{_short(args)} is not how numpy pickles an array: _reconstruct(numpy.ndarray, (0,), b'b')"
    if name == "numpy.ndarray":
        return "numpy.ndarray is called; it is allowed only as the subtype numpy's _reconstruct is given"
    return None


def _short(args: Any) -> str:
    text = repr(tuple(getattr(a, "full", a) for a in args)) if isinstance(args, tuple) else f"({args!r})"
    return text if len(text) <= 80 else text[:77] + "..."


def allowed_globals() -> list[Any]:
    """The allow-list in the form ``torch.serialization.safe_globals`` takes: ``(object, name)``."""
    return [(obj, name) for name, obj in allowed_table().items()]


@functools.lru_cache(maxsize=1)
def _torch_safe_names() -> frozenset[str]:
    from torch._weights_only_unpickler import _get_allowed_globals

    return frozenset(_get_allowed_globals())


def classify(module: str, name: str) -> str:
    """``safe`` (torch's weights_only defaults), ``allowed`` (this list) or ``unsafe``.

    Only exact names count, and a dotted attribute path never does: ``pathlib PosixPath.touch``
    reaches a method through an allowed class, and ``torch _utils.x`` is not how torch pickles.
    """
    full = f"{module}.{name}"
    if "." in name or not module:
        return UNSAFE
    if full in _torch_safe_names():
        return SAFE
    if full in allowed_table():
        return ALLOWED
    return UNSAFE


@contextlib.contextmanager
def safe_unpickling() -> Iterator[Callable[[Any], Any]]:
    """torch's weights_only unpickler with the allow-list; yields ``finish(obj)``, which turns the
    defaultdict/deque stand-ins of a finished load into the real thing.

    >>> with safe_unpickling() as finish:                    # doctest: +SKIP
    ...     obj = finish(torch.load(path, weights_only=True))
    """
    import torch

    _pending.items = []
    with torch.serialization.safe_globals(allowed_globals()):
        yield _finish


def _finish(obj: Any) -> Any:
    items, _pending.items = getattr(_pending, "items", []), []
    if not items:
        return obj
    factories = {id(o): f for o, f in items}
    return _Restorer(factories).fix(obj)


class _Restorer:
    """Replace stand-ins everywhere they sit (dict values, list items, tuples, attributes)."""

    def __init__(self, factories: dict[int, Any]):
        self.factories = factories
        self.done: dict[int, Any] = {}

    def fix(self, x: Any) -> Any:
        import torch

        if isinstance(x, (str, bytes, int, float, complex, torch.Tensor)) or x is None:
            return x
        if id(x) in self.done:
            return self.done[id(x)]
        if isinstance(x, _Deque):
            out: Any = collections.deque(maxlen=x.maxlen)
            self.done[id(x)] = out
            out.extend(self.fix(v) for v in x)
        elif isinstance(x, dict) and id(x) in self.factories:
            out = collections.defaultdict(self.factories[id(x)])
            self.done[id(x)] = out
            out.update((k, self.fix(v)) for k, v in x.items())
        elif isinstance(x, dict):
            self.done[id(x)] = out = x
            for k, v in list(x.items()):
                x[k] = self.fix(v)
        elif isinstance(x, list):
            self.done[id(x)] = out = x
            x[:] = [self.fix(v) for v in x]
        elif isinstance(x, tuple):
            items = tuple(self.fix(v) for v in x)
            out = x if all(a is b for a, b in zip(items, x)) else items
            self.done[id(x)] = out
        else:
            self.done[id(x)] = out = x
            if isinstance(getattr(x, "__dict__", None), dict):
                for k, v in list(vars(x).items()):
                    vars(x)[k] = self.fix(v)
        return out
