"""The allow-list and what each allowed global may do: the policy of ckptfix's unpickler and scanner.

torch's ``weights_only`` defaults name tensors, storages, dtypes, ``OrderedDict``, ``Counter``,
``set``, ``complex`` and friends; training checkpoints also hold hyper-parameters
(``argparse.Namespace``), numpy scalars and arrays, paths, timestamps and torch's version string.
Every global here constructs plain data and runs no code taken from the file; ``classify`` names a
global ``safe`` (torch's own), ``allowed`` (ckptfix's additions) or ``unsafe`` (anything else).

Being named is not enough to be called: :func:`torch_policy` gives each callable a guard that checks
its arguments (``torch.ByteTensor(n)`` is never called: uninitialised memory; a tensor view must lie
inside its storage; ``bytearray(n)`` stays within the limits), and BUILD only reaches instances of
the types listed. :func:`refused_call` and :func:`refused_build` are the same rules for the static
scanner, which sees arguments only as far as they are constants.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import pathlib
import re
from typing import Any

from ..core import limits as _limits
from . import numpy_policy as numpy_safe, standins
from ..parse.pickle_ops import Refused, type_name
from .standins import short_args
from ..core.torch_tables import torch_safe_names

SAFE, ALLOWED, UNSAFE = "safe", "allowed", "unsafe"

#: torch's weights_only defaults that ckptfix does not call at all: tensors without bounds checks
#: (nested offsets), storage-less wrapper subclasses, tensors from numpy arrays.
REFUSED_REBUILDS = frozenset({"torch._utils._rebuild_nested_tensor", "torch._utils._rebuild_wrapper_subclass",
                              "torch._utils._rebuild_device_tensor_from_numpy"})
_VIEW_REBUILDS = frozenset({"torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2",
                            "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_qtensor"})
_CODEC_NAMES = frozenset({"latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"})


class _FactoryType:
    """A builtin type named in a pickle, accepted only as a defaultdict's ``default_factory``.

    The token itself can't be called, so a pickle can't use ``builtins.str`` etc. as a function.
    """

    def __init__(self, type_: type):
        self.type = type_

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise Refused(f"{self.type.__name__} is allowed only as a defaultdict's default factory")


_FACTORY_TYPES = (list, dict, set, int, float, str, tuple, bool, collections.OrderedDict, collections.Counter)


def _defaultdict(default_factory: Any = None, *rest: Any) -> dict:
    """Stands in for ``collections.defaultdict`` while the unpickler fills it (it fills only exact
    dicts); the plain dict becomes a real defaultdict once loading ends."""
    factory = default_factory.type if isinstance(default_factory, _FactoryType) else default_factory
    if rest or not (factory is None or factory in _FACTORY_TYPES):
        raise Refused(f"defaultdict with default factory {type_name(factory)} is not allowed "
                      "(only builtin containers and numbers)")
    d: dict = {}
    standins.remember(d, factory)
    return d


class _Deque(list):
    """Stands in for ``collections.deque`` while the unpickler appends to it; a real deque afterwards."""

    def __init__(self, iterable: Any = (), maxlen: int | None = None):
        super().__init__(iterable)
        self.maxlen = maxlen
        standins.remember(self, None)


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` — how protocol 2 pickles ``b""`` (other bytes go through ``_codecs.encode``)."""
    if args:
        raise Refused("builtins.bytes is allowed only as bytes(), how pickle writes b''")
    return b""


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


@functools.lru_cache(maxsize=1)
def allowed_table() -> dict[str, Any]:
    """ckptfix's additions to torch's defaults: name as pickled (``module.qualname``) → object."""
    from torch.torch_version import TorchVersion

    table: dict[str, Any] = {
        "argparse.Namespace": argparse.Namespace,  # hyper-parameters: NEWOBJ + BUILD of an attribute dict
        "collections.defaultdict": _defaultdict,
        "collections.deque": _Deque,
        "datetime.datetime": datetime.datetime,  # timestamps: built from bytes, numbers, fixed offsets
        "datetime.date": datetime.date,
        "datetime.time": datetime.time,
        "datetime.timedelta": datetime.timedelta,
        "datetime.timezone": datetime.timezone,
        "torch.torch_version.TorchVersion": TorchVersion,  # torch.__version__: a str subclass
    }
    for t in (list, dict, int, float, str, tuple, bool):  # a defaultdict's default_factory: tokens only
        table[f"builtins.{t.__name__}"] = _FactoryType(t)
    table["builtins.bytes"] = _empty_bytes  # protocol 2 pickles b"" as bytes()
    table.update(_path_classes())
    table.update(numpy_safe.numpy_entries())
    # mmengine's message_hub: HistoryBuffer as an inert stand-in, getattr only as getattr(HistoryBuffer,
    # 'min'|'max'|'current'|'mean') (a protocol-2 pickle of its statistics_methods): an inert token.
    table[standins.HISTORY_BUFFER] = standins.HistoryBuffer
    table["builtins.getattr"] = standins.getattr_method
    return table


@functools.lru_cache(maxsize=1)
def _torch_safe_names() -> frozenset[str]:
    """torch's weights_only defaults (less the rebuilds ckptfix refuses): the frozen table for the
    installed torch series (no torch import), else torch's own list."""
    names = torch_safe_names()
    if names is None:
        from torch._weights_only_unpickler import _get_allowed_globals

        names = frozenset(_get_allowed_globals())
    return names - REFUSED_REBUILDS


def classify(module: str, name: str) -> str:
    """``safe`` (torch's weights_only defaults), ``allowed`` (ckptfix's additions) or ``unsafe``.

    Only exact names count, and a dotted attribute path never does: ``pathlib PosixPath.touch``
    reaches a method through an allowed class, and ``torch _utils.x`` is not how torch pickles.
    """
    full = f"{module}.{name}"
    if "." in name or not module:
        return UNSAFE
    if full in _torch_safe_names():
        return SAFE
    if _is_allowed_name(full):
        return ALLOWED
    return UNSAFE


_FACTORY_NAMES = frozenset(f"builtins.{t.__name__}" for t in (list, dict, int, float, str, tuple, bool))


@functools.lru_cache(maxsize=1)
def _plain_allowed_names() -> frozenset[str]:
    return frozenset({"argparse.Namespace", "collections.defaultdict", "collections.deque", "datetime.datetime",
                      "datetime.date", "datetime.time", "datetime.timedelta", "datetime.timezone",
                      "torch.torch_version.TorchVersion", *_FACTORY_NAMES, "builtins.bytes",
                      *(name for name, _ in _path_classes()), standins.HISTORY_BUFFER, "builtins.getattr"})


def allowed_names() -> frozenset[str]:
    """The names :func:`allowed_table` holds, without importing torch (numpy only for a numpy name)."""
    return _plain_allowed_names() | _numpy_names()


@functools.lru_cache(maxsize=1)
def _numpy_names() -> frozenset[str]:
    return frozenset(name for name, _ in numpy_safe.numpy_entries())


def _is_allowed_name(full: str) -> bool:
    return full in _plain_allowed_names() or full.startswith("numpy.") and full in _numpy_names()


def allowed_globals() -> list[Any]:
    """The allow-list in the form ``torch.serialization.safe_globals`` takes: ``(object, name)``."""
    return [(obj, name) for name, obj in allowed_table().items()]


# -- the same rules for the static scanner ------------------------------------------------------------

_STORAGE_ITEMSIZE = {"Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
                     "Char": 1, "Byte": 1, "Bool": 1, "ComplexDouble": 16, "ComplexFloat": 8, "QInt8": 1,
                     "QUInt8": 1, "QInt32": 4, "QUInt4x2": 1, "QUInt2x4": 1, "Untyped": 1}
_VALUE_ONLY = re.compile(r"^torch\.(cuda\.)?(sparse\.)?\w*Tensor$|^torch\.(cuda\.)?\w*Storage$|"
                         r"^torch\.storage\.(Typed|Untyped)Storage$")


def refused_call(name: str, args: Any, op: str = "REDUCE") -> str | None:
    """Why calling the safe/allowed global ``name`` with ``args`` (as walked statically: globals are
    objects with ``.full``, persistent ids ``.pid``) would be refused by the loader, or None."""
    if _VALUE_ONLY.match(name):
        return (f"{op} calls {name}, which would create uninitialised memory (ckptfix allows it only as a "
                "value, as torch.save writes it)")
    if name == "builtins.bytes":
        return None if args == () else "builtins.bytes is allowed only as bytes(), how pickle writes b''"
    if name in _FACTORY_NAMES:
        return f"{name} is allowed only as a defaultdict's default factory, not called"
    if name == "builtins.getattr":
        ok = (isinstance(args, tuple) and len(args) == 2 and getattr(args[0], "full", None) == standins.HISTORY_BUFFER
              and args[1] in standins.STATISTICS_METHODS)
        return None if ok else f"getattr{short_args(args)} reaches an attribute; only getattr({standins.HISTORY_BUFFER}, " \
                               "'min'|'max'|'current'|'mean') is allowed"
    if name == "collections.defaultdict" and isinstance(args, tuple) and args and args[0] is not None and getattr(
            args[0], "full", None) not in {f"builtins.{t.__name__}" for t in _FACTORY_TYPES} | {
            "collections.OrderedDict", "collections.Counter"}:
        return f"defaultdict{short_args(args)}: only builtin containers and numbers may be its default factory"
    if name == "builtins.bytearray" and isinstance(args, tuple) and args and type(args[0]) is int:
        limit = _limits.current().max_alloc_bytes
        if args[0] > limit:
            return f"bytearray({args[0]}) asks for more than the limit max_alloc_bytes = {limit:,}"
    if name == "_codecs.encode" and isinstance(args, tuple) and len(args) == 2 and str(args[1]).lower() not in _CODEC_NAMES:
        return f"_codecs.encode with encoding {args[1]!r}: only latin1/utf-8 (as pickle writes bytes) is allowed"
    if name in _VIEW_REBUILDS and isinstance(args, tuple) and len(args) >= 4:
        return _static_view(args)
    if op in ("NEWOBJ", "NEWOBJ_EX") and name not in ("argparse.Namespace", "torch.torch_version.TorchVersion",
                                                      standins.HISTORY_BUFFER, "torch.nn.parameter.Parameter"):
        return f"{op} creates a {name}, which ckptfix never creates that way"
    return numpy_safe.refused_numpy_call(name, args)


def storage_itemsize(name: str) -> int | None:
    """Bytes per element of a legacy storage type named ``FloatStorage`` etc., None if unknown."""
    return _STORAGE_ITEMSIZE.get(name[: -len("Storage")] if name.endswith("Storage") else "")


def _static_view(args: tuple) -> str | None:
    """The view bounds check on constants: storage size from its persistent id."""
    pid = getattr(args[0], "pid", None)
    offset, size, stride = args[1], args[2], args[3]
    if not (isinstance(pid, tuple) and len(pid) >= 5 and isinstance(size, tuple) and isinstance(stride, tuple)
            and all(type(i) is int for i in (offset, *size, *stride, pid[4]))):
        return None  # not constants: the loader checks when it runs
    itemsize = storage_itemsize(getattr(pid[1], "name", ""))
    if offset < 0 or any(n < 0 for n in (*size, *stride)) or len(size) != len(stride):
        return "a tensor view has a negative offset, size or stride"
    if itemsize is None or 0 in size:
        return None
    reach = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if reach > pid[4]:
        return f"a tensor view reaches element {reach} of a storage of {pid[4]} elements (out of bounds)"
    return None


#: names whose results BUILD may give state to (the scanner's view of the policy's ``build`` table)
BUILDABLE = frozenset({"collections.OrderedDict", "collections.Counter", "argparse.Namespace",
                       "torch.torch_version.TorchVersion", standins.HISTORY_BUFFER, "torch.nn.parameter.Parameter",
                       *(n for n in _VIEW_REBUILDS if n != "torch._utils._rebuild_qtensor")})


def refused_build(name: str, state: Any) -> str | None:
    """Why BUILD on the result of calling ``name`` with ``state`` would be refused, or None."""
    reason = numpy_safe.refused_numpy_build(name, state)
    if reason is not None or name in numpy_safe.NUMPY_BUILDABLE:
        return reason
    if name not in BUILDABLE:
        return f"BUILD gives state to the result of {name}, which ckptfix never does"
    return None


