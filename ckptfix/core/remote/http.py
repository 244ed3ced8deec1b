"""``http://`` and ``https://``: Range requests with the standard library's client.

Every fetch is a Range request checked three ways: the server honoured the Range (a 200 with the whole body is
refused before its body is read), the bytes are the ones asked for, and the file's validator (ETag or
Last-Modified) is the first fetch's. The body is read under a :class:`~.common.Pace` (a stall or a deadline ends
it). Redirects are followed as huggingface_hub's and requests' clients follow them: credentials (``Authorization``,
``Cookie``, ``Proxy-Authorization``: the Hub's token) go only where the request itself went (the same scheme, host
and port), and an https URL is never followed to http. An opener installed with ``urllib.request.install_opener`` (a
proxy, a CA, a user agent) carries every request, its redirect handlers replaced by this policy and its credential
headers sent as the request's own (so dropped off their origin too). A web server lists nothing: a URL whose last segment has no
extension is a directory, its files asked for by name. Nothing is written over HTTP (it has no standard upload).
"""

from __future__ import annotations

import copy
import re
import socket
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from ...errors import DestinationError, MissingFileError, RemoteError
from ..positional import BLOCK, ByteSource
from .backend import Backend
from .common import Pace, Transient, changed, read_body, timeout, with_retries

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RETRY_STATUS = {429, 500, 502, 503, 504}


class HttpBackend(Backend):
    """``http(s)://HOST/PATH``: read with Range requests, never listed or written."""

    def open(self, location: str) -> ByteSource:
        return HttpSource(location)

    def is_dir(self, location: str) -> bool:
        return "." not in location.rstrip("/").rsplit("/", 1)[-1] or location.endswith("/")

    def check_writable(self, location: str, directory: bool = False) -> None:
        raise DestinationError(f"{location}: an http(s) URL can't be written (HTTP has no standard upload); write a "
                               "local file, or an s3://BUCKET/KEY destination")


class HttpSource(ByteSource):
    """An http(s) URL read with Range requests; ``headers`` go with every request (the Hub's token)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, name: str | None = None):
        super().__init__()
        self.url, self.name, self.headers = url, name or url, dict(headers or {})
        self.validator: tuple[str, str] | None = None
        self.size = 1  # until the first response says
        data = self._get(0, BLOCK)  # one round trip: size, validator and the head sniffing reads
        with self._lock:
            self._blocks[0] = data[:BLOCK]

    def _fetch(self, offset: int, n: int) -> bytes:
        return with_retries(self.name, lambda: self._request(offset, n))

    def _request(self, offset: int, n: int) -> bytes:
        opener, credentials = _opener()
        headers = {**credentials, **self.headers, "Range": f"bytes={offset}-{offset + n - 1}",
                   "Accept-Encoding": "identity"}
        req = urllib.request.Request(self.url, headers=headers)
        pace = Pace(self.name)
        wait = min(timeout(), pace.deadline) if pace.deadline > 0 else timeout()
        try:
            with opener.open(req, timeout=wait) as r:
                return self._answer(r, offset, n, pace)
        except urllib.error.HTTPError as e:
            raise self._status_error(e.code, e.reason) from None
        except _Downgrade as e:
            raise RemoteError(f"{self.name}: the server redirects {e.args[0]} to {e.args[1]}: refused (an https "
                              "URL is not followed to plain http, where anyone on the way reads and changes it)") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError, ConnectionError)):
                if pace.overdue():  # (a wait cut short by the deadline is the deadline's error)
                    raise pace.late() from None
                raise Transient(f"{type(e.reason).__name__}: {e.reason}") from None
            raise RemoteError(f"{self.name}: can't connect ({e.reason})") from None
        except (TimeoutError, ConnectionError) as e:
            if pace.overdue():
                raise pace.late() from None
            raise Transient(f"timed out or reset ({type(e).__name__}: {e})") from None

    def _status_error(self, code: int, reason: Any) -> Exception:
        reason = " ".join(str(reason).split())  # (one line)
        if code == 404 or code == 410:
            return MissingFileError(f"{self.name}: no such file (HTTP {code})", self.name)
        if code in (401, 403):
            return RemoteError(f"{self.name}: access denied (HTTP {code} {reason}); check the URL, or give credentials "
                               "(HF_TOKEN for the Hub, AWS_* for S3)")
        if 300 <= code < 400:
            return RemoteError(f"{self.name}: the server redirects in a loop (HTTP {code} back to a URL already "
                               "visited, or more than 10 redirects); check the URL in a browser")
        if code == 412:
            return changed(self.name, self.validator, "a failed If-Match")
        if code == 416 and self.validator is None:
            return RemoteError(f"{self.name}: the server refuses Range requests for this file (HTTP 416)")
        if code == 416:  # a range inside the size the first answer gave: the file is shorter now
            return changed(self.name, self.validator, f"a file shorter than its {self.size} bytes (HTTP 416)")
        if code in _RETRY_STATUS:
            return Transient(f"the server failed (HTTP {code} {reason})")
        return RemoteError(f"{self.name}: the server answered HTTP {code} {reason}")

    def _answer(self, r: Any, offset: int, n: int, pace: Pace) -> bytes:
        validator = _validator(r.headers)
        if r.status == 200:  # the whole body: refuse before reading it
            length = r.headers.get("Content-Length")
            raise RemoteError(
                f"{self.name}: the server ignores Range requests (it answered 200 with the whole file"
                f"{f', {int(length)} bytes' if length and length.isdigit() else ''}): ckptfix reads a remote file's "
                "headers only and does not download it whole; download it and give the local path")
        if r.status != 206:
            raise RemoteError(f"{self.name}: unexpected HTTP {r.status} to a Range request")
        m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
        if m is None or int(m.group(1)) != offset:
            raise RemoteError(f"{self.name}: the server sent bytes {r.headers.get('Content-Range')!r} for "
                              f"bytes={offset}-{offset + n - 1}: refused")
        total = int(m.group(3)) if m.group(3) != "*" else None
        if self.validator is None:
            self.validator = validator
            if total is not None:
                self.size = total
        elif validator != self.validator or total is not None and total != self.size:
            raise changed(self.name, self.validator, validator if validator != self.validator else f"size {total}")
        want = min(n, self.size - offset)
        pace.body()
        try:
            data = read_body(r.read1, want, pace)
        except (TimeoutError, ConnectionError) as e:
            if pace.overdue():
                raise pace.late() from None
            raise Transient(f"timed out or reset while reading ({e})") from None
        if len(data) != want:
            raise Transient(f"the connection ended after {len(data)} of {want} bytes")
        return data


class _Downgrade(Exception):
    """A redirect from https to http: (from, to), each without its query or credentials."""


#: the request headers that carry credentials, dropped when a redirect leaves the request's origin
CREDENTIALS = ("authorization", "cookie", "proxy-authorization")


def _origin(url: str) -> tuple[str, str, int | None]:
    """``url``'s scheme, host and port (a default port spelled out): where a credential may go."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def _shown(url: str) -> str:
    """``url`` without credentials, query or fragment (a CDN's signed query string is a credential too)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, which copy every request header to the next URL, made safe for a token: a redirect that
    leaves the request's scheme, host and port loses its credentials, and https → http is refused."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        before, after = _origin(req.full_url), _origin(new.full_url)
        if before[0] == "https" and after[0] != "https":
            fp.close()
            raise _Downgrade(_shown(req.full_url), _shown(new.full_url))
        if before != after:
            for key in [k for k in new.headers if k.lower() in CREDENTIALS]:
                del new.headers[key]
        return new


#: (the installed opener an opener was built from, that opener, the installed one's credential headers)
_built: tuple[Any, urllib.request.OpenerDirector, dict[str, str]] | None = None


def _opener() -> tuple[urllib.request.OpenerDirector, dict[str, str]]:
    """The opener every request goes through, and the credential headers it adds: urllib's installed one
    (``urlopen``'s own, ``install_opener``'s) or its default, with :class:`_Redirects`; rebuilt when another is
    installed (urllib keeps it in ``urllib.request._opener``, and has no public getter)."""
    global _built
    installed = urllib.request._opener  # type: ignore[attr-defined]
    if _built is None or _built[0] is not installed:
        _built = (installed, *_build(installed))
    return _built[1], _built[2]


def _build(installed: urllib.request.OpenerDirector | None) -> tuple[urllib.request.OpenerDirector, dict[str, str]]:
    """``installed``'s handlers (copies: the user's opener keeps its own) but its redirect handlers, then
    :class:`_Redirects`; its ``addheaders`` but the credentials, which go with each request instead (where a redirect
    to another origin drops them)."""
    if installed is None:
        return urllib.request.build_opener(_Redirects()), {}
    opener = urllib.request.OpenerDirector()
    opener.addheaders = [(k, v) for k, v in installed.addheaders if k.lower() not in CREDENTIALS]
    for handler in installed.handlers:  # type: ignore[attr-defined]  # (urllib's own list, not in its stubs)
        if not any(hasattr(handler, f"http_error_{code}") for code in (301, 302, 303, 307, 308)):
            opener.add_handler(copy.copy(handler))
    opener.add_handler(_Redirects())
    return opener, {k: v for k, v in installed.addheaders if k.lower() in CREDENTIALS}


def _validator(headers: Any) -> tuple[str, str] | None:
    for name in ("ETag", "Last-Modified"):
        value = headers.get(name)
        if value:
            return name, value
    return None
