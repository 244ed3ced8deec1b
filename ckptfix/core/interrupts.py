"""SIGINT, SIGTERM and SIGHUP as exceptions while ckptfix works, so a temp output is always removed.

Python turns SIGINT into KeyboardInterrupt, but SIGTERM (``timeout``, a CI runner cancelling a job)
and SIGHUP (a closed terminal) kill the process outright, leaving a half-written temp file. Inside
``signals_as_interrupts()`` all three raise :class:`~ckptfix.errors.Interrupted` (a
KeyboardInterrupt), so one cleanup path serves them all. Only handlers still at their defaults are
replaced (an application's own handler is left alone), only in the main thread (Python delivers
signals there), and they are restored on leaving; the context nests. ``held()`` defers signals
over a cleanup or a final rename that must not be cut short; ``interruptible()`` inside it lets them
through again over work that can still be undone (``load_into``'s copies with their undo log).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import Interrupted

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class _State:
    depth = 0
    previous: dict[int, Any] = {}
    holding = 0
    pending: int | None = None
    raised: Interrupted | None = None
    said: list[Said] = []  # the held regions' own, innermost last


def _handler(signum: int, frame: Any) -> None:
    if _State.holding:
        said = _State.said[-1] if _State.said else None
        if said is None or said.cut is None or (signum == signal.SIGINT and _State.pending is None):
            if _State.pending is None:
                _State.pending = signum
            return
        _State.pending = None  # a region that can be cut short: SIGTERM/SIGHUP, or a second signal, cut it now
        _State.raised = Interrupted(signum, outcome=said.cut)
        raise _State.raised
    _State.raised = Interrupted(signum)
    raise _State.raised


def _is_default(signum: int, handler: Any) -> bool:
    return handler == signal.SIG_DFL or (signum == signal.SIGINT and handler is signal.default_int_handler)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Inside: SIGINT, SIGTERM and SIGHUP raise ``Interrupted`` (where their handlers are the defaults)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _State.depth == 0:
        _State.previous, _State.pending, _State.raised = {}, None, None
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            if _is_default(signum, current):
                _State.previous[signum] = current
                signal.signal(signum, _handler)
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if _State.depth == 0:
            for signum, handler in _State.previous.items():
                signal.signal(signum, handler)
            _State.previous = {}


class Said:
    """What an interrupt deferred by ``held()`` says of the work, by how the work inside ended; the work sets it as
    it learns (``outcome`` None: the output's words, :meth:`~ckptfix.errors.Interrupted.describe`). ``cut`` (None:
    never cut): the work can be cut short — SIGTERM or SIGHUP (the process is being ended), or a second SIGINT, raise
    at once, saying this."""

    def __init__(self, outcome: str | None, failed: str | None, cut: str | None = None) -> None:
        self.outcome = outcome
        self.failed = failed
        self.cut = cut


@contextlib.contextmanager
def held(written: bool = False, outcome: str | None = None, failed: str | None = None,
         cut: str | None = None) -> Iterator[Said]:
    """Signals arriving inside are deferred; on leaving, the first is raised as ``Interrupted``
    (``written``: the output is complete by then, e.g. after the final rename; ``outcome``: what the work
    inside did, said instead; ``failed``: the same where it raised, the error then the interrupt's context; ``cut``:
    see :class:`Said`, which is yielded). One arriving while an interrupt is already on its way out is folded into
    it."""
    said = Said(outcome, failed, cut)
    if threading.current_thread() is not threading.main_thread():
        yield said
        return
    _State.holding += 1
    _State.said.append(said)
    try:
        yield said
    except KeyboardInterrupt:
        _leave(said)
        if not _State.holding:
            _State.pending = None
        raise
    except BaseException:
        _leave(said)
        _raise_pending(written, said.failed)
        raise
    else:
        _leave(said)
        _raise_pending(written, said.outcome)


def _leave(said: Said) -> None:
    _State.holding -= 1
    if _State.said and _State.said[-1] is said:
        _State.said.pop()


def _raise_pending(written: bool, outcome: str | None) -> None:
    if not _State.holding and _State.pending is not None:
        signum, _State.pending = _State.pending, None
        _State.raised = Interrupted(signum, written=written, outcome=outcome)
        raise _State.raised


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside ``held()``: signals raise at once again (one deferred already, on entry); held again on leaving."""
    if threading.current_thread() is not threading.main_thread() or not _State.holding:
        yield
        return
    saved, _State.holding = _State.holding, 0
    try:
        _raise_pending(False, None)
        yield
    finally:
        _State.holding = saved


def cause(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt behind ``exc``: itself, one in its ``__cause__``/``__context__`` chain (torch's zip
    writer turns an interrupt inside ``torch.save`` into a RuntimeError on its way out), or the
    signal raised since signals were last turned into interrupts."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return _State.raised if _State.depth else None
