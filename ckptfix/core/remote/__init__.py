"""URL schemes as a table: one :class:`~.backend.Backend` per scheme, looked up by the URL's scheme.

``http``/``https`` (:mod:`.http`: Range requests), ``s3`` (:mod:`.s3`: boto3) and ``hf`` (:mod:`.hub`:
huggingface_hub) are registered here; :func:`register` adds another (public as ``ckptfix.register_url_scheme``).
Every scheme question — is this a URL (:func:`ckptfix.core.locations.is_remote`), how to open, list or write it —
is answered from this table, so a new scheme is one module and one :func:`register` call. Client libraries are
imported by a backend when a URL of its scheme is first used, never here.

>>> ckptfix.register_url_scheme("gs", GcsBackend())           # doctest: +SKIP
>>> ckptfix.describe("gs://bucket/model.safetensors")         # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import KeysView

from .backend import Backend
from .http import HttpBackend
from .hub import HubBackend
from ..positional import ByteSource
from .s3 import S3Backend

__all__ = ["SCHEMES", "Backend", "ByteSource", "backend_for", "open_remote", "register", "unregister"]

_TABLE: dict[str, Backend] = {}
#: the registered schemes (a live view of the table: a scheme registered later is in it)
SCHEMES: KeysView[str] = _TABLE.keys()
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")  # RFC 3986's scheme, lower case


def register(scheme: str, backend: Backend) -> None:
    """Read (and, where ``backend`` writes, write) ``SCHEME://`` URLs through ``backend``: from then on every verb that
    takes a URL takes this scheme's. ``backend`` implements :class:`ckptfix.core.remote.Backend` (only ``open`` is
    required: it returns a ``ByteSource`` whose ``_fetch(offset, n)`` returns those bytes). A scheme already
    registered is refused (ValueError): :func:`unregister` it first.

    >>> ckptfix.register_url_scheme("gs", GcsBackend())       # doctest: +SKIP
    """
    key = scheme.lower()
    if not _SCHEME.fullmatch(key) or len(key) < 2:  # (one letter would be a Windows drive)
        raise ValueError(f"{scheme!r} is not a URL scheme (a letter, then letters, digits, '+', '-' or '.')")
    if not isinstance(backend, Backend):
        raise TypeError(f"{backend!r} is not a ckptfix.core.remote.Backend")
    if key in _TABLE:
        raise ValueError(f"{key}:// URLs are read by {_TABLE[key]!r} already; unregister it first")
    _TABLE[key] = backend


def unregister(scheme: str) -> Backend:
    """Undo :func:`register`: ``SCHEME://`` is a local path again; the backend that served it (KeyError if none)."""
    return _TABLE.pop(scheme.lower())


def backend_for(location: object) -> Backend | None:
    """The backend of ``location``'s scheme; None for a local path (or a URL of a scheme nothing registered)."""
    if not isinstance(location, str):
        return None
    scheme, sep, _ = location.partition("://")
    return _TABLE.get(scheme.lower()) if sep else None


def open_remote(location: str) -> ByteSource:
    """The source of a URL of a registered scheme."""
    backend = backend_for(location)
    if backend is None:
        raise ValueError(f"{location}: not a URL of a registered scheme ({', '.join(SCHEMES)})")
    return backend.open(location)


register("http", HttpBackend())
register("https", HttpBackend())
register("s3", S3Backend())
register("hf", HubBackend())
