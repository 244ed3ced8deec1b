"""numpy inside checkpoints: arrays, scalars and dtypes rebuilt from bytes, plain numeric kinds only.

numpy pickles a dtype as ``numpy.dtype('f4', False, True)`` + BUILD ``(3, '<', None, None, None, -1,
-1, 0)``, an array as ``_reconstruct(numpy.ndarray, (0,), b'b')`` + BUILD ``(1, shape, dtype,
fortran, raw bytes)`` and a scalar as ``scalar(dtype, raw bytes)``. numpy's own ``__setstate__``
trusts those tuples: a dtype state can declare object fields while its flags claim none, and
an array then takes PyObject pointers from the file. Here the dtype and the array are stand-ins
whose ``__setstate__`` accepts only plain numeric/bool dtypes (no fields, no objects, no
subarrays) and raw bytes of exactly the right length; the finished load replaces each stand-in
with the real numpy object (``real()``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..parse.pickle_ops import Refused
from .allowlist import CODECS_ENCODE, NDARRAY, NUMPY_DTYPE, NUMPY_DTYPE_CLASSES, is_plain_dtype
from .standins import note_made, short_args
from ..parse.unpickler import type_name

_NUMPY_CODE = re.compile(r"^[<>|=]?(b1|\?|[iu][1248]|f[248]|c(8|16))$")
_NUMPY_ENDIAN = frozenset("<>|=")


def _refuse(message: str) -> Exception:
    return Refused(message)


def _is_plain_dtype_state(state: Any) -> bool:
    """numpy's dtype state ``(3, '<', None, None, None, -1, -1, 0)``: no fields, objects, subarrays or metadata."""
    return (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4) and state[1] in _NUMPY_ENDIAN
            and state[2:5] == (None, None, None) and state[5:8] == (-1, -1, 0) and state[8:] in ((), (None,)))


class NumpyDType:
    """``numpy.dtype(code, align, copy=True)`` of a plain numeric/bool code (a fresh copy, never numpy's
    shared one), given numpy's own ``__setstate__`` once the state is checked to describe a plain dtype."""

    def __init__(self, code: str, align: bool):
        import numpy as np

        # Any: numpy's stubs leave out the dtype's __setstate__, which BUILD calls
        self.dtype: Any = np.dtype(code, align, True)
        note_made()

    def __setstate__(self, state: Any) -> None:
        if not _is_plain_dtype_state(state):
            raise _refuse(f"numpy dtype state {state!r:.100}: only plain numeric/bool dtypes "
                          "(no fields, objects, subarrays or metadata) are loaded")
        self.dtype.__setstate__(state)

    def real(self) -> Any:
        return self.dtype


class NumpyArray:
    """``_reconstruct(numpy.ndarray, (0,), b'b')``: an array filled by BUILD from checked raw bytes."""

    def __init__(self) -> None:
        self.value: Any = None
        note_made()

    def __setstate__(self, state: Any) -> None:
        import numpy as np

        ok = isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and isinstance(state[1], tuple)
        dtype = _plain_dtype(state[2]) if ok else None
        shape = state[1] if ok else ()
        if not ok or dtype is None or type(state[3]) is not bool or not isinstance(state[4], bytes) or not all(
                type(n) is int and n >= 0 for n in shape) or self.value is not None:
            raise _refuse("numpy array state: only (1, shape, plain numeric dtype, fortran, raw bytes) is loaded; "
                          "object arrays and arrays of structured dtypes are refused")
        count = 1
        for n in shape:
            count *= n
        if count * dtype.itemsize != len(state[4]):
            raise _refuse(f"numpy array of shape {shape} {dtype} needs {count * dtype.itemsize} bytes, "
                          f"the pickle holds {len(state[4])}")
        from numpy._core import multiarray

        array: Any = multiarray._reconstruct(np.ndarray, (0,), b"b")  # its __setstate__ isn't in numpy's stubs
        array.__setstate__((1, shape, dtype, state[3], state[4]))  # numpy's own, on checked plain data
        self.value = array

    def real(self) -> Any:
        if self.value is None:
            raise _refuse("a numpy array is created but never filled (uninitialised memory): refused")
        return self.value


NUMPY_STAND_INS = (NumpyDType, NumpyArray)


def _plain_dtype(d: Any) -> Any:
    """A plain numeric/bool numpy dtype from a stand-in or a real dtype, else None."""
    real = d.dtype if isinstance(d, NumpyDType) else d
    return real if is_plain_dtype(real) else None


class ClassToken:
    """A class named in a pickle only to be handed to one constructor that checks for it (numpy's
    ``_reconstruct``); the token itself can't be called or instantiated."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(f"{self.name} is allowed only as the subtype numpy's _reconstruct is given")


NDARRAY_TOKEN = ClassToken(NDARRAY)


def _dtype(code: Any, align: Any = False, copy: Any = True) -> NumpyDType:
    if not isinstance(code, str) or not _NUMPY_CODE.match(code) or type(align) is not bool or type(copy) is not bool:
        raise _refuse(f"numpy dtype {code!r:.40}: only plain numeric/bool dtypes are loaded")
    return NumpyDType(code, align)


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> NumpyArray:
    if subtype is not NDARRAY_TOKEN or shape != (0,) or dtype_code != b"b":
        raise _refuse("numpy _reconstruct is allowed only as numpy pickles an array: "
                      "_reconstruct(numpy.ndarray, (0,), b'b'); subclasses such as memmap are refused")
    return NumpyArray()


def _scalar(dtype: Any, raw: Any = None) -> Any:
    import numpy as np

    real = _plain_dtype(dtype)
    if real is None or not isinstance(raw, bytes) or len(raw) != real.itemsize:
        raise _refuse("numpy scalar: only a plain numeric dtype with exactly its bytes is loaded")
    return np.frombuffer(raw, dtype=real)[0]


#: the allow-list's numpy stand-in kinds (``Rule.stand_in``) → what the unpickler gives for the name
STAND_INS: dict[str, Any] = {"numpy dtype": _dtype, "ndarray token": NDARRAY_TOKEN, "numpy reconstruct": _reconstruct,
                             "numpy scalar": _scalar}


def _charged(u: Any, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    u.charge(sum(len(a) for a in args if isinstance(a, (bytes, str, tuple))), type_name(f))
    return f(*args, **kwargs)


def _dtype_class(u: Any, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """numpy's DType classes are called only without arguments."""
    if args or kwargs:
        raise _refuse(f"numpy.dtypes.{f.__name__} is called with arguments")
    return f()


#: the allow-list's numpy call kinds (``Rule.call``) → the loader's guard
GUARDS: dict[str, Any] = {"numpy dtype": _charged, "numpy reconstruct": _charged, "numpy scalar": _charged,
                          "numpy dtype class": _dtype_class}
#: the allow-list's numpy build kinds (``Rule.build``) → the stand-in type BUILD gives state to
BUILDS: dict[str, type] = {"numpy dtype": NumpyDType, "numpy array": NumpyArray}


# -- the same rules for the static scanner (arguments as walked: globals have ``.full``) ----------------

def _refused_ndarray_call(name: str, args: Any) -> str | None:
    return f"{name} is called; it is allowed only as the subtype numpy's _reconstruct is given"


def _refused_dtype_class_call(name: str, args: Any) -> str | None:
    return f"{name} is called with arguments" if args else None


def _refused_dtype_call(name: str, args: Any) -> str | None:
    if isinstance(args, tuple) and args and isinstance(args[0], str) and _NUMPY_CODE.match(args[0]):
        return None
    return f"numpy dtype{short_args(args)}: only plain numeric/bool dtypes are loaded"


def _refused_reconstruct_call(name: str, args: Any) -> str | None:
    if isinstance(args, tuple) and len(args) == 3 and getattr(args[0], "full", None) == NDARRAY and args[1] == (0,):
        return None
    return f"numpy _reconstruct{short_args(args)} is not how numpy pickles an array: _reconstruct(numpy.ndarray, (0,), b'b')"


def _refused_scalar_call(name: str, args: Any) -> str | None:
    dtype = args[0] if isinstance(args, tuple) and args else None
    func = getattr(getattr(dtype, "func", None), "full", None) or getattr(dtype, "full", None)
    if func != NUMPY_DTYPE and not str(func).startswith(NUMPY_DTYPE_CLASSES):
        return "numpy scalar of something other than a numpy dtype"
    return None


#: the scanner's view of the numpy calls, by call kind (``ndarray token``: by stand-in kind, never called)
STATIC_CALLS: dict[str, Callable[[str, Any], str | None]] = {
    "numpy dtype": _refused_dtype_call, "numpy reconstruct": _refused_reconstruct_call,
    "numpy scalar": _refused_scalar_call, "numpy dtype class": _refused_dtype_class_call,
    "ndarray token": _refused_ndarray_call,
}


def _refused_dtype_build(state: Any) -> str | None:
    if _is_plain_dtype_state(state):
        return None
    return f"numpy dtype state {short_args(state)}: only plain numeric/bool dtypes are loaded"


def _refused_array_build(state: Any) -> str | None:
    ok = isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and type(state[3]) is bool
    raw = state[4] if ok else None
    raw_ok = isinstance(raw, bytes) or getattr(getattr(raw, "func", None), "full", None) == CODECS_ENCODE
    return None if ok and raw_ok else "numpy array state: only (1, shape, dtype, fortran, raw bytes) is loaded"


#: why BUILD with a state on what a numpy name made would be refused, by build kind
STATIC_BUILDS: dict[str, Callable[[Any], str | None]] = {"numpy dtype": _refused_dtype_build,
                                                         "numpy array": _refused_array_build}
