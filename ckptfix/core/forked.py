"""A function run in a forked child: its JSON result comes back; a crash, an exit or a timeout ends the child, not
the caller, and is named.

``verify --exact`` observes the serving loader this way (:mod:`ckptfix.model.observe`): a forked child starts with
torch already imported and ckptfix's read of the file in its memory, so the observation costs the loader's call
and nothing else — run beside the parent's own work on another core, not after it. A child started with
``subprocess`` (a fresh interpreter) is the fallback wherever forking is unsafe (:func:`can_fork`).

>>> child = start(lambda: {"answer": 42})                  # doctest: +SKIP
>>> child.wait(timeout=10)                                 # doctest: +SKIP
({'answer': 42}, None)
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .units import shown

#: threads of ckptfix's own that hold no lock a forked child would need (the read's SHA-256 thread)
QUIET_THREADS = ("ckptfix-sha256",)


def can_fork() -> bool:
    """Whether a forked child is safe here: Linux (``os.fork``), and no thread beyond the main one and ckptfix's
    own hashing thread — another thread may hold a lock (an import, stdio, a library's mutex) the child would wait
    on forever."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False
    return all(t is threading.main_thread() or t.name in QUIET_THREADS for t in threading.enumerate())


def exit_reason(what: str, returncode: int, stderr: str) -> str:
    """``"the loader's process killed by SIGABRT (its last stderr line)"``: why a child gave no answer."""
    last = (stderr.strip().splitlines() or [""])[-1]
    how = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with status {returncode}")
    return f"{what} {how}" + (f" ({shown(last)})" if last else "")


class Child:
    """A forked child running one function; :meth:`wait` collects its result, :meth:`close` ends it."""

    def __init__(self, pid: int, tmp: str):
        self.pid, self.tmp = pid, tmp
        self.done: tuple[Any, str | None] | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # Python or kernel without pidfds: poll waitpid instead
            self._pidfd = None

    def wait(self, timeout: float, what: str = "the child process") -> tuple[Any, str | None]:
        """``(result, None)``, or ``(None, why)``: a crash, an exit status, or killed past ``timeout`` seconds."""
        if self.done is None:
            status = self._reap(timeout)
            if status is None:
                self.done = None, f"{what} ran past its {timeout:.0f} s limit and was killed"
            elif status != 0:
                self.done = None, exit_reason(what, status, self._read("stderr"))
            else:
                try:
                    self.done = json.loads(self._read("result.json")), None
                except ValueError:  # exit 0 without its answer (an os._exit inside the work): no verdict, named
                    self.done = None, f"{what} exited without writing its answer"
            self.close()
        return self.done

    def _reap(self, timeout: float) -> int | None:
        """The child's exit code (negative: the signal), or None after killing it at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return None
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], left)  # readable once the child has exited
            else:
                time.sleep(min(left, 0.005))

    def _read(self, name: str) -> str:
        try:
            with open(os.path.join(self.tmp, name), encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def close(self) -> None:
        """End the child if it still runs (the caller gave up on it), and remove its files."""
        if self.done is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.done = None, "not waited for"
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def start(work: Callable[[], Any]) -> Child:
    """Fork; the child runs ``work()`` with its stdout and stderr in a private file, writes the result as JSON, and
    leaves with ``os._exit`` (never returning into the caller's stack, running none of its exit handlers)."""
    tmp = tempfile.mkdtemp(prefix="ckptfix-child-")  # mode 0700
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # nothing buffered is written twice
    pid = os.fork()
    if pid:
        return Child(pid, tmp)
    code = 1
    try:
        fd = os.open(os.path.join(tmp, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # new stream objects: a lock another thread held in the parent's at the fork would never be released
        sys.stdout = sys.stderr = open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
        if faulthandler.is_enabled():  # a crash's traceback goes with the rest of the child's stderr
            faulthandler.enable(file=sys.stderr)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        result = work()
        with open(os.path.join(tmp, "result.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
        code = 0
    except BaseException:  # the child's failure is its exit status and stderr, never the parent's exception
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)
    raise AssertionError("unreachable")  # pragma: no cover
