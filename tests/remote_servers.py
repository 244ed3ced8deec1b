"""Real servers on 127.0.0.1 for remote-checkpoint tests (issue 19), as pytest fixtures: no mock of a client
library, each client talks to a real server over a socket. A test module registers them by importing them
(tests/conftest.py stays the only conftest), and names them once so that ruff sees the import used (else
F811 flags each test's argument of the same name as a redefinition of an unused import):

    from tests.remote_servers import http_server, https_server, hub_server, s3_server
    SERVERS = (http_server, https_server, hub_server, s3_server)

- ``http_server``: :class:`file_server.FileServer` on the test's own directory (``http_server.root``): Range,
  ETag/Last-Modified, HEAD, byte and request counts, each request's headers, and the switches (ignore Range,
  404/403, delay, drip, 503 N times per Range, redirect loop, redirect, a file that changes after N requests).
- ``https_server``: the same over TLS, with a self-signed certificate the clients trust through the
  environment (SSL_CERT_FILE, REQUESTS_CA_BUNDLE), valid for 127.0.0.1, 127.0.0.2 and localhost.
- ``hub_server``: :class:`hub_server.HubServer` (the Hub endpoints huggingface_hub uses) on its own
  directory as repo ``org/name``; ``HF_ENDPOINT`` and huggingface_hub's import-time copies of it point there,
  its cache is under the test's tmp_path.
- ``s3_server``: moto's ``ThreadedMotoServer`` (one per session, its state reset for each test) with the
  bucket ``ckpt`` made by boto3, AWS_ENDPOINT_URL / keys / region set for the test, and byte counts of
  what the server sent (:class:`S3Server`, a WSGI wrapper around moto's app).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

from tests.file_server import Counts, FileServer
from tests.hub_server import HubServer

BUCKET = "ckpt"
REGION = "us-east-1"


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[FileServer]:
    """A :class:`FileServer` on ``tmp_path / "http"`` (``http_server.root``): put files there, fetch
    ``http_server.url(name)``."""
    root = tmp_path / "http"
    root.mkdir()
    with FileServer(root) as server:
        yield server


@pytest.fixture
def https_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FileServer]:
    """:func:`http_server` over TLS (``https://127.0.0.1:PORT``), with a self-signed certificate made for the
    test that SSL_CERT_FILE and REQUESTS_CA_BUNDLE name, so Python's ssl, requests, aiohttp and httpx trust
    it with no argument (and nothing else: a test needs no other host). aiohttp (fsspec's HTTPFileSystem) makes
    its default context once, at import: give it ``ssl=ssl.create_default_context(cafile=https_server.tls[0])``
    when it may have been imported before the test."""
    from tests.file_server import self_signed_cert

    root = tmp_path / "https"
    root.mkdir()
    (tmp_path / "tls").mkdir()
    cert, key = self_signed_cert(tmp_path / "tls")
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.setenv(name, str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with FileServer(root, tls=(cert, key)) as server:
        yield server


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A :class:`HubServer` serving ``tmp_path / "hub"`` as repo ``org/name``. huggingface_hub reads
    ``HF_ENDPOINT`` once, at import (its constants and the module-level ``HfApi`` behind
    ``get_safetensors_metadata``): the environment is set for child processes, the copies patched for this
    one; downloads are cached under tmp_path; HfFileSystem's instance cache is cleared either side."""
    import huggingface_hub
    from huggingface_hub import constants, hf_api

    root = tmp_path / "hub"
    root.mkdir()
    cache = tmp_path / "hf-cache"
    with HubServer(root) as hub:
        endpoint = hub.base_url
        for key, value in {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
                           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
        huggingface_hub.HfFileSystem.clear_instance_cache()
        try:
            yield hub
        finally:
            huggingface_hub.HfFileSystem.clear_instance_cache()


class S3Server:
    """moto's S3 server on 127.0.0.1 (a free port), its WSGI app wrapped to count the body bytes each
    request's path was sent (``counts``, keyed ``/bucket/key``; :class:`file_server.Counts`), with switches by path:
    ``status`` (403 → S3's AccessDenied, any other code → its own XML error), ``head_status`` (the same for HEAD
    requests only: a write-only policy, without s3:ListBucket, gets a 403 for a HEAD of a missing key), ``delay``
    (seconds before answering: a client's read timeout) and ``drip`` (bytes/s: a GET's body sent that slowly, a
    stall). A changed object: upload it again (new ETag)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.counts = Counts()
        self.status: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.drip: dict[str, int] = {}
        self.head_status: dict[str, int] = {}
        counts = self.counts
        server = self

        class Counting(ThreadedMotoServer):
            def _server_entry(self) -> None:
                # ThreadedMotoServer._server_entry (moto 5.2.5) with the app wrapped: the server is moto's own
                from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                                           create_backend_app)
                from werkzeug.serving import make_server

                app = _count_bytes(DomainDispatcherApplication(create_backend_app), counts, server)
                self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._moto = Counting(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = BUCKET

    def stop(self) -> None:
        self._moto.stop()

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset endpoint), and the counts."""
        import requests

        requests.post(f"{self.endpoint}/moto-api/reset", timeout=10).raise_for_status()
        self.counts.reset()
        self.status.clear()
        self.delay.clear()
        self.drip.clear()
        self.head_status.clear()

    def client(self) -> Any:
        """A boto3 S3 client for this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def upload(self, path: str | os.PathLike[str], key: str | None = None) -> list[str]:
        """Upload a file (as ``key``, default its name) or a directory's files (under ``key/``, default its
        name, keeping relative paths); the keys, sorted. Counts are reset after, so they hold only reads."""
        path = Path(path)
        prefix = path.name if key is None else key
        files: Iterable[tuple[Path, str]] = (
            [(path, prefix)] if path.is_file()
            else ((p, f"{prefix}/{p.relative_to(path).as_posix()}".lstrip("/")) for p in sorted(path.rglob("*")) if p.is_file()))
        client = self.client()
        keys = []
        for file, name in files:
            client.upload_file(str(file), self.bucket, name)
            keys.append(name)
        self.counts.reset()
        return sorted(keys)


_S3_ERRORS = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


def _count_bytes(app: Any, counts: Counts, server: S3Server) -> Any:
    """A WSGI middleware: every request counted, and every body byte the app returns for it, by path; the
    server's ``delay`` and ``status`` switches applied first, its ``drip`` to the body."""

    def counted(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        counts._request(path, environ.get("HTTP_RANGE"))
        if (wait := server.delay.get(path)) is not None:
            time.sleep(wait)
        code = server.status.get(path)
        if code is None and environ.get("REQUEST_METHOD") == "HEAD":
            code = server.head_status.get(path)
        if code is not None:
            reason = _S3_ERRORS.get(code, "Error")
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{reason}</Code>'
                    f"<Message>{reason} (switch)</Message><Resource>{path}</Resource></Error>").encode()
            start_response(f"{code} {HTTPStatus(code).phrase}", [("Content-Type", "application/xml"),
                                                                ("Content-Length", str(len(body)))])
            chunks: Iterable[bytes] = [body]
        else:
            chunks = app(environ, start_response)
        rate = server.drip.get(path) if environ.get("REQUEST_METHOD") == "GET" else None
        for chunk in chunks if rate is None else _dripped(chunks, rate):
            if environ.get("REQUEST_METHOD") != "HEAD":
                counts._sent(path, len(chunk))
            yield chunk

    return counted


def _dripped(chunks: Iterable[bytes], rate: int) -> Iterator[bytes]:
    """``chunks`` again, a tenth of a second's bytes at ``rate`` bytes/s at a time (werkzeug writes each at once)."""
    step = max(1, rate // 10)
    for chunk in chunks:
        for i in range(0, len(chunk), step):
            piece = chunk[i:i + step]
            yield piece
            time.sleep(len(piece) / rate)


_S3: list[S3Server] = []  # one moto server for the session (it takes a second to start), reset per test
_S3_LOCK = threading.Lock()


def _moto_s3() -> S3Server:
    with _S3_LOCK:
        if not _S3:
            _S3.append(S3Server())
            atexit.register(_S3[0].stop)
        return _S3[0]


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """moto's S3 server, reset, with the bucket ``ckpt`` and the AWS environment pointing at it: boto3,
    s3fs and ckptfix's S3 source find it with no argument. ``s3_server.upload(path)`` puts files there."""
    server = _moto_s3()
    server.reset()
    for key, value in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ENDPOINT_URL_S3": server.endpoint,
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    server.client().create_bucket(Bucket=BUCKET)
    server.counts.reset()
    return server
