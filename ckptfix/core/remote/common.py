"""What every remote backend shares: the timeout, pace and retry settings, the lazy import of a client library,
retries with backoff, a response body read under a :class:`Pace`, the check of a URL's path segments, and the error
for a file whose validator changed mid-read.

``CKPTFIX_REMOTE_RETRIES`` (default 3) more tries after a transient failure (a timeout, a reset, 429 or 5xx), each
waiting ``CKPTFIX_REMOTE_TIMEOUT`` seconds (default 30) at most for each socket read. A body that arrives slower than
``CKPTFIX_REMOTE_MIN_RATE`` bytes/s (default 1024; 0: no minimum) over the last ``CKPTFIX_REMOTE_STALL_WINDOW``
seconds (default 30) has stalled, and a request that takes more than ``CKPTFIX_REMOTE_DEADLINE`` seconds (default 0:
none) has run out of time: both end the read with a RemoteError, not retried (a server that drips would only drip
again).
"""

from __future__ import annotations

import importlib
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ...errors import RemoteError

#: what installs the client libraries (boto3, huggingface_hub)
EXTRA = "pip install 'ckptfix[remote]'"


def timeout() -> float:
    """Seconds one request may wait (``CKPTFIX_REMOTE_TIMEOUT``)."""
    return float(os.environ.get("CKPTFIX_REMOTE_TIMEOUT", "30"))


def retries() -> int:
    """More tries after a transient failure (``CKPTFIX_REMOTE_RETRIES``)."""
    return int(os.environ.get("CKPTFIX_REMOTE_RETRIES", "3"))


def _number(name: str, default: str) -> float:
    value = os.environ.get(name, default)
    try:
        return float(value)
    except ValueError:
        raise RemoteError(f"{name}={value!r} is not a number of seconds or bytes/s") from None


class Pace:
    """One request's clock: its body must keep up ``CKPTFIX_REMOTE_MIN_RATE`` bytes/s over the last
    ``CKPTFIX_REMOTE_STALL_WINDOW`` seconds, and the request end within ``CKPTFIX_REMOTE_DEADLINE`` seconds. A slow
    link that keeps moving passes however long the body (a multi-GB range); a server that drips does not.

    >>> pace = Pace(url); response = get(url); pace.body(); ...; pace.check(bytes_so_far)   # doctest: +SKIP
    """

    def __init__(self, name: str) -> None:
        self.name, self.start = name, time.monotonic()
        self.rate = _number("CKPTFIX_REMOTE_MIN_RATE", "1024")
        self.window = _number("CKPTFIX_REMOTE_STALL_WINDOW", "30")
        self.deadline = _number("CKPTFIX_REMOTE_DEADLINE", "0")
        self._samples: deque[tuple[float, int]] = deque([(self.start, 0)])  # (when, bytes so far), coarse

    def body(self) -> None:
        """The headers are in: the rate is measured from now (waiting for them is the socket timeout's)."""
        self._samples = deque([(time.monotonic(), 0)])
        self.check(0)

    def overdue(self) -> bool:
        """Whether the request is past ``CKPTFIX_REMOTE_DEADLINE``."""
        return self.deadline > 0 and time.monotonic() - self.start > self.deadline

    def late(self, got: int | None = None, want: int | None = None) -> RemoteError:
        """The error of a request past its deadline, ``got`` of ``want`` body bytes in."""
        received = "" if got is None else f" ({got} of {want} bytes received)" if want else f" ({got} bytes received)"
        return RemoteError(f"{self.name}: the request took more than CKPTFIX_REMOTE_DEADLINE ({self.deadline:g} s)"
                           f"{received}; raise CKPTFIX_REMOTE_DEADLINE (0: no deadline)")

    def check(self, got: int, want: int | None = None) -> None:
        """``got`` body bytes are in: RemoteError if the request is past its deadline or its body has stalled."""
        now = time.monotonic()
        if self.overdue():
            raise self.late(got, want)
        if self.rate <= 0 or self.window <= 0:
            return
        samples = self._samples
        if now - samples[-1][0] >= self.window / 16:  # (a few samples a window, not one a chunk)
            samples.append((now, got))
        while len(samples) > 1 and samples[1][0] <= now - self.window:
            samples.popleft()
        since, before = samples[0]
        if now - since >= self.window and got - before < self.rate * self.window:
            raise RemoteError(f"{self.name}: the transfer stalled: {got - before} bytes in the last {now - since:.1f} s, "
                              f"under CKPTFIX_REMOTE_MIN_RATE ({self.rate:g} bytes/s over CKPTFIX_REMOTE_STALL_WINDOW, "
                              f"{self.window:g} s); on a slow link lower CKPTFIX_REMOTE_MIN_RATE (0: no minimum)")


#: the most bytes one read of a response body asks for
READ_CHUNK = 1 << 20


def read_body(read: Callable[[int], bytes], want: int, pace: Pace) -> bytes:
    """Up to ``want`` bytes of a response body (fewer if it ends early), ``read(n)`` returning what one socket read
    brings (``read1``: a read that waits for all ``n`` would hide a drip from the pace), checked after each."""
    parts: list[bytes] = []
    got = 0
    while got < want:
        chunk = read(min(READ_CHUNK, want - got))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
        pace.check(got, want)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def plain_segments(location: str, path: str, what: str, empty: bool = False) -> None:
    """Refuse a ``what`` (a Hub path, an S3 key) with a ``.`` or ``..`` segment, or an empty one unless ``empty``
    (an S3 key may hold ``//``): a URL names one file as written, never one a client or server resolves elsewhere."""
    bad = [s for s in path.split("/") if s in (".", "..") or (s == "" and not empty)]
    if bad:
        shown = "an empty" if bad[0] == "" else f"a {bad[0]!r}"
        raise RemoteError(f"{location}: {shown} segment in the {what}: refused (a URL names a file by its own "
                          "path, without '.', '..' or empty segments)")


def import_client(module: str, what: str) -> Any:
    """Import an optional client library when a URL first needs it, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RemoteError(f"reading {what} needs the {module} package: {EXTRA}") from None


class Transient(Exception):
    """A failure worth another try (timeout, reset, 429/5xx)."""


def with_retries(name: str, attempt: Any) -> Any:
    """``attempt()`` again after a :class:`Transient` failure, waiting 0.2 s, 0.4 s, … between tries."""
    tries = retries() + 1
    for i in range(tries):
        try:
            return attempt()
        except Transient as e:
            if i == tries - 1:
                raise RemoteError(f"{name}: {e} ({tries} tries); check the URL and the network, "
                                  "or raise CKPTFIX_REMOTE_TIMEOUT / CKPTFIX_REMOTE_RETRIES") from None
            time.sleep(0.2 * 2**i)
    raise AssertionError("unreachable")


def changed(name: str, before: Any, after: Any) -> RemoteError:
    """The error for a file whose validator (ETag, Last-Modified, size) is not the first fetch's."""
    return RemoteError(f"{name}: the file changed while it was being read (validator {before!r}, now {after!r}): "
                       "refused rather than mixing two versions; run the command again")
