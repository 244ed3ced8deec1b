"""A real HTTP file server on 127.0.0.1 (or another loopback address: ``host``) for remote-checkpoint tests and
bench/remote.py (issue 19): serves a directory, honours ``Range: bytes=a-b`` (206 + Content-Range), sends ETag
and Last-Modified, answers HEAD, counts the body bytes it sends and the requests it answers per path, and has
switches for the failures a client must survive. Needs nothing but the standard library (bench/remote.py
imports it without pytest).

    with FileServer(tmp_path) as server:             # or the ``http_server`` fixture (tests/remote_servers.py)
        url = server.url("model.safetensors")        # http://127.0.0.1:PORT/model.safetensors
        requests.get(url, headers={"Range": "bytes=0-7"})
        server.counts.bytes_sent["/model.safetensors"]  # 8
        server.ignore_range = True                   # 200 with the whole body, whatever the Range
        server.status["/model.safetensors"] = 403    # or 404
        server.delay["/model.safetensors"] = 5.0     # seconds before the status line: a client's read timeout
        server.drip["/model.safetensors"] = 2        # the body sent at 2 bytes/s: a stall
        server.redirects["/a"] = other.url("b")      # 302 to another server (FileServer(root, host="127.0.0.2"))
        server.request_headers                       # [(path, {header (lower case): value})], each request's
        server.redirect_loop.add("/loop")            # 302 to itself, for ever
        server.flaky["/model.safetensors"] = 2       # each (path, Range) asked for: 503 twice, then answered
        server.change_after("model.safetensors", 1, new_bytes)  # replaced (new ETag, Last-Modified) after 1 request

``FileServer(root, tls=self_signed_cert(folder))`` serves https (that certificate needs ``cryptography``).
"""

from __future__ import annotations

import email.utils
import ipaddress
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass
class Counts:
    """What the server sent, per URL path (no query): body bytes (a HEAD sends none; a client that hangs
    up early is counted up to what was written), requests answered, and every request's Range header in
    order (None without one). :meth:`reset` between the steps of a test."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        with self.lock:
            return sum(self.bytes_sent.values())

    @property
    def total_requests(self) -> int:
        with self.lock:
            return sum(self.requests.values())

    def reset(self) -> None:
        with self.lock:
            self.bytes_sent.clear()
            self.requests.clear()
            self.ranges.clear()

    def _request(self, path: str, range_header: str | None) -> int:
        with self.lock:
            self.requests[path] = self.requests.get(path, 0) + 1
            self.ranges.append((path, range_header))
            return self.requests[path]

    def _sent(self, path: str, n: int) -> None:
        with self.lock:
            self.bytes_sent[path] = self.bytes_sent.get(path, 0) + n


def etag_of(path: Path | os.stat_result) -> str:
    """A strong ETag from size and mtime (as nginx makes one): it changes whenever the file is replaced. ``path``:
    a file, or the ``stat`` of an open one."""
    st = path.stat() if isinstance(path, Path) else path
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``Range: bytes=a-b`` / ``a-`` / ``-n`` → (first, last) inclusive, clipped to ``size``; None to send
    the whole body (no header, several ranges, another unit); ``"unsatisfiable"`` for a 416."""
    if header is None or "," in header:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None or m.group(1) == m.group(2) == "":
        return None
    if m.group(1) == "":  # suffix: the last n bytes
        n = int(m.group(2))
        return (max(size - n, 0), size - 1) if n and size else "unsatisfiable"
    first = int(m.group(1))
    last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
    if first >= size or last < first:
        return "unsatisfiable"
    return first, last


class FileServer:
    """Serves ``root`` on 127.0.0.1 (a free port) from a thread; a context manager, or :meth:`start` /
    :meth:`stop`. The switches are plain attributes, read at each request."""

    def __init__(self, root: str | os.PathLike[str], tls: tuple[Path, Path] | None = None, host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        self.tls = tls  # (certificate, key) files: serve https (:func:`self_signed_cert` makes a pair)
        self.host = host  # 127.0.0.2 is another loopback host on Linux (a redirect to another origin)
        self.request_headers: list[tuple[str, dict[str, str]]] = []
        self.drip: dict[str, int] = {}  # path → bytes/s: its body sent that slowly (a server that stalls a client)
        self.counts = Counts()
        self.ignore_range = False
        self.status: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.redirect_loop: set[str] = set()
        self.redirects: dict[str, str] = {}
        self.flaky: dict[str, int] = {}  # path → N: the first N requests for each of its Ranges get a 503
        self._flaky_seen: dict[tuple[str, str | None], int] = {}
        self._changes: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- life -------------------------------------------------------------------------------------
    def start(self) -> FileServer:
        handler = type("Handler", (FileHandler,), {"server_state": self})
        self._httpd = _Server((self.host, 0), handler)
        if self.tls is not None:
            self._httpd.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._httpd.tls.load_cert_chain(*self.tls)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="file-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "start() first"
        host, port = self._httpd.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"

    def url(self, name: str = "") -> str:
        """The URL of ``name`` (a path relative to root, or a switch's path such as ``/loop``)."""
        return f"{self.base_url}/{name.lstrip('/')}"

    # -- switches ---------------------------------------------------------------------------------
    def change_after(self, name: str, requests: int, content: bytes) -> None:
        """Once ``requests`` requests for ``name`` have been answered, the next one finds the file replaced
        by ``content`` with a later mtime (so a new ETag and Last-Modified): a file that changes between a
        client's requests."""
        with self._lock:
            self._changes[name.lstrip("/")] = (requests, content)

    def flaky_fails(self, path: str, range_header: str | None) -> bool:
        """Whether this request for ``path`` (with this Range, or None) is one of the ``flaky[path]`` that fail."""
        fails = self.flaky.get(path)
        if fails is None:
            return False
        with self._lock:
            seen = self._flaky_seen.get((path, range_header), 0)
            self._flaky_seen[(path, range_header)] = seen + 1
        return seen < fails

    def apply_change(self, name: str, served: int) -> None:
        """Called before a request for the file ``name`` (relative to root) is answered, the ``served``-th."""
        with self._lock:
            pending = self._changes.get(name)
            if pending is None or served <= pending[0]:
                return
            del self._changes[name]
        file = self.file_for(name)
        assert file is not None, name
        old = file.stat().st_mtime_ns
        fresh = file.with_name(file.name + ".replacing")
        fresh.write_bytes(pending[1])
        later = old + 2_000_000_000  # Last-Modified has whole seconds
        os.utime(fresh, ns=(later, later))
        os.replace(fresh, file)  # (as a deploy replaces a file: a request already answering keeps the old one)

    def file_for(self, path: str) -> Path | None:
        """The file a URL path names under root, or None (outside root, or not a file)."""
        file = (self.root / path.lstrip("/")).resolve()
        if not file.is_relative_to(self.root.resolve()) or not file.is_file():
            return None
        return file

    def route(self, handler: FileHandler, method: str, path: str, served: int) -> bool:
        """A subclass's own endpoints: answer through ``handler`` and return True, or return False to serve
        ``path`` as a file. ``served``: this request is the served-th for ``path``."""
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64  # fsspec and huggingface_hub open several connections at once
    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[Any, Any]:
        sock, address = self.socket.accept()
        if self.tls is not None:  # the handshake runs in the request's thread (FileHandler.setup), not here
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, 127.0.0.2 and localhost, its own CA (so it is also the CA bundle a client trusts:
    SSL_CERT_FILE, REQUESTS_CA_BUNDLE), and its key, written to ``folder``; needs ``cryptography``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.2")),
                                                        x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "server.crt", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


class FileHandler(BaseHTTPRequestHandler):
    """One request: its headers recorded, the switches in order (delay, flaky 503, redirect loop, redirect, forced
    status), the subclass's routes, then the file (HEAD, or GET with or without Range; dripped if asked)."""

    server_state: FileServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect; every response has a Content-Length

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(30)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet in tests
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self.handle_method("HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self.handle_method("GET")

    def do_POST(self) -> None:  # noqa: N802
        self.handle_method("POST")

    @property
    def url_path(self) -> str:
        return unquote(urlsplit(self.path).path)

    def handle_method(self, method: str) -> None:
        try:
            self.answer(method)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout, or it read enough)
            self.close_connection = True

    def answer(self, method: str) -> None:
        state = self.server_state
        path = self.url_path
        served = state.counts._request(path, self.headers.get("Range"))
        with state._lock:
            state.request_headers.append((path, {key.lower(): value for key, value in self.headers.items()}))
        if (wait := state.delay.get(path)) is not None:
            time.sleep(wait)
        if state.flaky_fails(path, self.headers.get("Range")):
            return self.send_simple(HTTPStatus.SERVICE_UNAVAILABLE, f"503 for {path} (flaky)\n".encode())
        if path in state.redirect_loop:
            return self.send_simple(HTTPStatus.FOUND, headers={"Location": path})
        if path in state.redirects:
            return self.send_simple(HTTPStatus.FOUND, headers={"Location": state.redirects[path]})
        if (code := state.status.get(path)) is not None:
            return self.send_simple(code, f"{code} for {path}\n".encode())
        if state.route(self, method, path, served):
            return None
        state.apply_change(path.lstrip("/"), served)
        folder = (state.root / path.lstrip("/")).resolve()
        if method == "GET" and folder.is_dir() and folder.is_relative_to(state.root.resolve()):
            return self.send_index(path, folder)
        file = state.file_for(path)
        if file is None or method == "POST":
            return self.send_simple(HTTPStatus.NOT_FOUND, f"no file {path}\n".encode())
        return self.send_file(method, path, file)

    def send_simple(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                    content_type: str = "text/plain") -> None:
        """A whole small body (an error, a redirect, a JSON answer), counted like a file's."""
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.server_state.counts._sent(self.url_path, len(body))  # before the write: a client that has read the
            self.wfile.write(body)  # last byte may look at the count before this thread runs again

    def send_index(self, path: str, folder: Path) -> None:
        """A directory as an HTML page of links (what fsspec's HTTPFileSystem.ls reads)."""
        base = "/" + path.strip("/") + "/" if path.strip("/") else "/"
        links = "".join(f'<a href="{base}{p.name}{"/" if p.is_dir() else ""}">{p.name}</a>\n' for p in sorted(folder.iterdir()))
        self.send_simple(HTTPStatus.OK, f"<html><body>\n{links}</body></html>\n".encode(), content_type="text/html")

    def send_file(self, method: str, path: str, file: Path, headers: dict[str, str] | None = None) -> None:
        """The file as it was when opened, as nginx serves one: its size, ETag and bytes from the open file, so a
        file replaced while this answers (``change_after``, another request's thread) is sent whole as it was."""
        try:
            f = open(file, "rb")
        except FileNotFoundError:
            return self.send_simple(HTTPStatus.NOT_FOUND, f"no file {path}\n".encode())
        with f:
            return self._send_open(method, path, f, headers)

    def _send_open(self, method: str, path: str, f: Any, headers: dict[str, str] | None) -> None:
        state = self.server_state
        st = os.fstat(f.fileno())
        size = st.st_size
        etag = etag_of(st)
        common = {"ETag": etag, "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                  "Accept-Ranges": "none" if state.ignore_range else "bytes", **(headers or {})}
        if (match := self.headers.get("If-Match")) is not None and match not in ("*", etag):
            return self.send_simple(HTTPStatus.PRECONDITION_FAILED, f"{path} changed: ETag {etag}\n".encode(), common)
        wanted = None if state.ignore_range else parse_range(self.headers.get("Range"), size)
        if_range = self.headers.get("If-Range")
        if wanted is not None and if_range is not None and if_range != etag:
            wanted = None  # RFC 9110: a changed file is sent whole
        if wanted == "unsatisfiable":
            return self.send_simple(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, b"",
                                    {**common, "Content-Range": f"bytes */{size}"})
        first, last = wanted if isinstance(wanted, tuple) else (0, size - 1)
        self.send_response(HTTPStatus.PARTIAL_CONTENT if isinstance(wanted, tuple) else HTTPStatus.OK)
        for key, value in common.items():
            self.send_header(key, value)
        if isinstance(wanted, tuple):
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(last - first + 1))
        self.end_headers()
        if method == "HEAD":
            return None
        rate = state.drip.get(path)
        step = CHUNK if rate is None else max(1, rate // 10)  # (a drip: a tenth of a second's bytes at a time)
        f.seek(first)
        left = last - first + 1
        while left > 0:
            chunk = f.read(min(step, left))
            if not chunk:
                break
            state.counts._sent(path, len(chunk))  # (counted first: see above)
            self.wfile.write(chunk)
            left -= len(chunk)
            if rate is not None:
                time.sleep(len(chunk) / rate)
        return None
