"""Resource limits for reading untrusted files: how much a small file may make ckptfix allocate or do.

A 1 KB pickle can ask for a 2.5 GB ``bytearray``, a compressed member can inflate a thousandfold,
a tensor view with stride 0 can stand for gigabytes of output, and a million nested tuples can
exhaust the C stack of code that walks them. Each limit below bounds one of these; a file beyond a
limit is refused with a :class:`~ckptfix.errors.LimitError` that names the limit and how to raise it.

Every limit is read from its environment variable when a read starts, so a user can raise one for
a file they know (``CKPTFIX_MAX_DEPTH=2000 ckptfix inspect deep.pth``); the library can also use
:func:`override`. ``--trust`` does not lift them: they guard ckptfix's own reader.

>>> with ckptfix.core.limits.override(max_depth=2000):        # doctest: +SKIP
...     ckptfix.load("deep.pth")
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from ..errors import LimitError

_MIB = 2**20


@dataclass(frozen=True)
class Limits:
    """The limits in force; see the "Limits" table in docs/security.md for what each one means."""

    #: the largest pickle (a zip's data.pkl inflated, a legacy file's pickles, DCP's .metadata) read
    max_pickle_bytes: int = 1024 * _MIB
    #: how deeply containers (tuples, lists, dicts, objects) may nest in a pickle
    max_depth: int = 1000
    #: elements or bytes the calls in one pickle may create beyond the pickle's own size
    #: (``bytearray(n)``, ``set(...)`` of a memoized list repeated, …)
    max_alloc_bytes: int = 64 * _MIB
    #: bytes a tensor view may cover beyond its storage when it is written out contiguously
    #: (a stride-0 view of one element standing for a large tensor)
    max_expand_bytes: int = 64 * _MIB


ENV = {f.name: f"CKPTFIX_{f.name.upper()}" for f in fields(Limits)}
_local = threading.local()


def current() -> Limits:
    """The limits for a read starting now: ``override``'s, else the environment's, else the defaults."""
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced
    values = {}
    for name, var in ENV.items():
        raw = os.environ.get(var)
        if raw is None or not raw.strip():
            continue
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            raise LimitError(f"{var}={raw!r} is not a whole number") from None
        if value < 0:
            raise LimitError(f"{var}={raw!r} must be 0 or more")
        values[name] = value
    return replace(Limits(), **values)


@contextlib.contextmanager
def override(**values: int) -> Iterator[Limits]:
    """Use these limits (the rest from the environment) for reads in this thread inside the block."""
    unknown = set(values) - set(ENV)
    if unknown:
        raise TypeError(f"unknown limit(s): {', '.join(sorted(unknown))}; known: {', '.join(ENV)}")
    previous = getattr(_local, "forced", None)
    _local.forced = None
    limits = replace(current(), **values)
    _local.forced = limits
    try:
        yield limits
    finally:
        _local.forced = previous


def exceeded(name: str, what: str, value: int | None = None, where: str = "") -> LimitError:
    """The error for ``what`` in ``where`` going past the limit ``name`` (``value``: how far, if known)."""
    limit = getattr(current(), name)
    got = f" ({value:,})" if value is not None else ""
    return LimitError(
        f"{where + ': ' if where else ''}{what}{got} exceeds the limit {name} = {limit:,}: "
        "refused as a possible resource-exhaustion attack. "
        f"If you trust the file's size, raise it: {ENV[name]}={max(limit * 4, (value or 0) + 1)} "
        f"(library: ckptfix.core.limits.override({name}=...))",
        name,
    )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off (as it was after). A read builds some 25 objects per tensor, none in
    a cycle, so each full collection only re-walks every object the process holds: in a caller that has imported
    torch (200,000 of them) that made ``convert()`` of 20,000 tensors 20 % slower than the whole CLI command, and
    ``describe()`` of them 2× slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

