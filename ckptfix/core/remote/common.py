"""What every remote backend shares: the timeout and retry settings, the lazy import of a client library, retries
with backoff, and the error for a file whose validator changed mid-read.

``CKPTFIX_REMOTE_RETRIES`` (default 3) more tries after a transient failure (a timeout, a reset, 429 or 5xx), each
waiting ``CKPTFIX_REMOTE_TIMEOUT`` seconds (default 30) at most.
"""

from __future__ import annotations

import importlib
import os
import time
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
