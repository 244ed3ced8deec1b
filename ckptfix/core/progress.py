"""A progress line on stderr for long copies, a line per phase where stderr is not a terminal, and the run's
resource figures for reports."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from . import bytecopy
from .units import human_size


class Progress:
    """Counts bytes and tensors moved through ``rawcopy``; draws a bar after ``DELAY`` (1 s) on a terminal.

    ``total_bytes`` is what will be written (after a dtype cast). A run that finishes ends on a full
    line (``100%``, every tensor) even where a writer reports its bytes otherwise (tied tensors
    written once, cast tensors the torch-zip writer adds without ``rawcopy``). ``label`` starts the line
    (``verify``'s: what it is checking); callers other than a copy call ``advance`` and ``tensor_done`` themselves.
    """

    #: seconds before the first draw: a short run prints nothing
    DELAY = 1.0

    def __init__(self, total_bytes: int, total_tensors: int, enabled: bool, stream: TextIO | None = None,
                 label: str = ""):
        self.label = label
        self.total_bytes = total_bytes
        self.total_tensors = total_tensors
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.bytes = 0
        self.tensors = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False

    def __enter__(self) -> Progress:
        bytecopy.progress = self
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        bytecopy.progress = None
        if et is None and self.enabled and (self._drawn or time.perf_counter() - self.start >= self.DELAY):
            self.bytes, self.tensors = self.total_bytes, self.total_tensors  # done: all of it is written
            self._draw(force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def advance(self, nbytes: int) -> None:
        self.bytes += nbytes
        self._draw()

    def tensor_done(self) -> None:
        self.tensors += 1
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if not force and (elapsed < self.DELAY or now - self._last_draw < 0.2):
            return
        self._last_draw = now
        self._drawn = True
        pct = min(100, 100 * self.bytes / self.total_bytes) if self.total_bytes else 100
        rate = self.bytes / elapsed if elapsed > 0 else 0
        label = f"{self.label}: " if self.label else ""
        self.stream.write(
            f"\r  {label}{human_size(self.bytes, 'GiB')} / {human_size(self.total_bytes, 'GiB')} ({pct:3.0f}%)  "
            f"{self.tensors}/{self.total_tensors} tensors  {human_size(rate, 'GiB')}/s   "
        )
        self.stream.flush()


class Phases:
    """One line per phase of a long verb, written as the phase ends — ``ckptfix verify: read (1.2 s)`` — where the
    stream (stderr) is not a terminal: a CI log sees the gate advance (a terminal draws :class:`Progress` instead).
    A phase that raises writes nothing: the error line follows."""

    def __init__(self, verb: str, enabled: bool, stream: TextIO | None = None):
        self.verb = verb
        self.stream = stream or sys.stderr
        self.enabled = enabled and not self.stream.isatty()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.enabled:
            self.stream.write(f"ckptfix {self.verb}: {name} ({time.perf_counter() - start:.1f} s)\n")
            self.stream.flush()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
