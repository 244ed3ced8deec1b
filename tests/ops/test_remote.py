"""Remote checkpoints (issue 19): ``describe`` and ``scan`` of https:// and s3:// sources read header bytes only,
through real servers started here on 127.0.0.1 (a Range-honouring HTTP server and moto's S3 server), and give
exactly what the same calls give for the local file.

The fixtures ``http_server`` and ``s3_server`` are each a base URL and the directory they serve (for S3: the
files in it uploaded under that prefix); tests/cli/test_cli_remote.py imports them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.safety.scanner import scan

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class HttpServer:
    """``url``: the base URL of ``root``. Other behaviours under sibling prefixes of ``files/``: ``norange/``
    (ignores Range), ``loop/`` (redirects to itself), ``forbidden/`` (403), ``slow/`` (answers after
    ``delay`` seconds), ``changing/`` (a new ETag on every response), ``flaky/`` (a 503 the first time each
    range is asked for)."""

    root: Path
    base: str
    bytes_sent: int = 0
    requests: int = 0
    delay: float = 2.0
    listed: int = 0  # of bytes_sent: the Hub's tree listings (huggingface_hub's requests, not file bytes)
    lock: threading.Lock = field(default_factory=threading.Lock)
    asked: set = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.base + "/files"

    def mode(self, name: str) -> str:
        return f"{self.base}/{name}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HttpServer

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        s = self.state
        with s.lock:
            s.requests += 1
            count = s.requests
        mode, _, rel = self.path.lstrip("/").partition("/")
        if mode == "loop":
            return self._empty(302, {"Location": self.path})
        if mode == "forbidden":
            return self._empty(403)
        if mode == "flaky":
            with s.lock:
                first = (self.path, self.headers.get("Range")) not in s.asked
                s.asked.add((self.path, self.headers.get("Range")))
            if first:
                return self._empty(503)
        if mode == "slow":
            time.sleep(s.delay)
        file = s.root / rel
        if not rel or ".." in rel.split("/") or not file.is_file():
            return self._empty(404)
        data = file.read_bytes()
        st = file.stat()
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}' + (f"-{count}" if mode == "changing" else "") + '"'
        m = _RANGE.fullmatch(self.headers.get("Range", ""))
        if m is None or mode == "norange":
            return self._send(200, data, {"ETag": etag})
        start = int(m.group(1))
        end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
        if start >= len(data):
            return self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
        self._send(206, data[start : end + 1], {"ETag": etag, "Content-Range": f"bytes {start}-{end}/{len(data)}"})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        with self.state.lock:  # (counted first: the client may have everything before write() returns here)
            self.state.bytes_sent += len(body)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client refused the body (a 200 to a Range request) or timed out

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self._send(status, b"", headers or {})


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up mid-answer is what the error tests do


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[HttpServer]:
    root = tmp_path / "served"
    root.mkdir()
    handler = type("Handler", (_Handler,), {})
    server = _Quiet(("127.0.0.1", 0), handler)
    state = HttpServer(root, f"http://127.0.0.1:{server.server_address[1]}")
    handler.state = state
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


COMMIT = "c0ffee" * 6 + "abcd"  # the one commit the hub server has


class _HubHandler(_Handler):
    """The Hub's file and tree routes over ``root/ORG/REPO/…`` (one commit, any revision name):
    ``/ORG/REPO/resolve/REV/PATH`` (HEAD: metadata; GET: Range) and ``/api/models/ORG/REPO/tree/REV[/PATH]``."""

    def do_HEAD(self) -> None:
        self._hub(head=True)

    def do_GET(self) -> None:
        self._hub(head=False)

    def _hub(self, head: bool) -> None:
        parts = self.path.split("?")[0].lstrip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            folder = self.state.root.joinpath(parts[2], parts[3], *parts[6:])
            if not folder.is_dir():
                return self._empty(404, {"X-Error-Code": "EntryNotFound"})
            items = [{"type": "directory" if p.is_dir() else "file", "oid": "0" * 40,
                      "path": "/".join([*parts[6:], p.name]), **({} if p.is_dir() else {"size": p.stat().st_size})}
                     for p in sorted(folder.iterdir())]
            body = json.dumps(items).encode()
            with self.state.lock:
                self.state.listed += len(body)
            return self._send(200, body, {"Content-Type": "application/json"})
        if len(parts) < 5 or parts[2] != "resolve":
            return self._empty(404, {"X-Error-Code": "RepoNotFound"})
        file = self.state.root.joinpath(parts[0], parts[1], *parts[4:])
        if not self.state.root.joinpath(parts[0], parts[1]).is_dir():
            return self._empty(404, {"X-Error-Code": "RepoNotFound"})
        if not file.is_file():
            return self._empty(404, {"X-Error-Code": "EntryNotFound"})
        extra = {"X-Repo-Commit": COMMIT}
        if head:
            self.send_response(200)
            for k, v in {**extra, "ETag": f'"{file.stat().st_size:x}"', "Content-Length": str(file.stat().st_size)}.items():
                self.send_header(k, v)
            self.end_headers()
            return None
        self.path = "/files/" + "/".join(parts[:2] + parts[4:])  # then served as a plain file, with Range
        return _Handler.do_GET(self)


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    """``url`` is ``hf://`` (``HF_ENDPOINT`` points at the server); ``root/ORG/REPO`` are its repositories."""
    root = tmp_path / "hub"
    root.mkdir()
    handler = type("HubHandler", (_HubHandler,), {})
    server = _Quiet(("127.0.0.1", 0), handler)
    state = HttpServer(root, f"http://127.0.0.1:{server.server_address[1]}")
    handler.state = state
    monkeypatch.setenv("HF_ENDPOINT", state.base)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@dataclass
class S3Server:
    """``url`` (``s3://bucket``) holds what ``upload()`` copies from ``root``."""

    root: Path
    url: str
    client: Any

    def upload(self) -> None:
        bucket = self.url[len("s3://"):]
        for path in sorted(self.root.rglob("*")):
            if path.is_file():
                self.client.upload_file(str(path), bucket, path.relative_to(self.root).as_posix())


@pytest.fixture(scope="module")
def _moto() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_server(_moto: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    boto3 = pytest.importorskip("boto3")
    for k, v in {"AWS_ENDPOINT_URL": _moto, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    client = boto3.session.Session().client("s3")
    bucket = f"ckpt-{os.getpid()}-{time.monotonic_ns()}"
    client.create_bucket(Bucket=bucket)
    root = tmp_path / "bucket"
    root.mkdir()
    return S3Server(root, f"s3://{bucket}", client)


# -- checkpoints, written by the real code paths ------------------------------------------------------------

def _state_dict(n: int = 12, width: int = 64 * 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"module.layers.{i}.weight": torch.randn(width, generator=g) for i in range(n)}


def write_checkpoints(root: Path) -> dict[str, str]:
    """Each kind of remote checkpoint under ``root``: name → its path relative to root."""
    sd = _state_dict()
    torch.save({"state_dict": sd, "epoch": 3}, root / "model.pth")
    save_file({k: v.clone() for k, v in sd.items()}, str(root / "model.safetensors"))
    ckptfix.convert(root / "model.safetensors", root / "sharded", max_shard_size=1_000_000)
    torch.save(sd, root / "legacy.pth", _use_new_zipfile_serialization=False)
    return {"zip": "model.pth", "safetensors": "model.safetensors", "sharded": "sharded",
            "sharded index": "sharded/model.safetensors.index.json", "legacy": "legacy.pth"}


def write_dcp(root: Path) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, as intended
        dcp.save({"model": _state_dict(4), "step": 7}, checkpoint_id=str(root / "dcp"))
    return "dcp"


def _same(remote: dict, local: dict) -> None:
    fetched = remote.pop("bytes_fetched")
    assert isinstance(fetched, int) and fetched > 0
    remote.pop("path"), local.pop("path")
    assert remote == local


KINDS = ["zip", "safetensors", "sharded", "sharded index", "dcp"]


@pytest.mark.parametrize("kind", KINDS)
def test_http_describe_is_the_local_describe_from_headers_only(http_server: HttpServer, kind: str) -> None:
    names = write_checkpoints(http_server.root)
    if kind == "dcp":  # (a web server lists nothing: the directory's .metadata is asked for by name)
        names["dcp"] = write_dcp(http_server.root)
    local = http_server.root / names[kind]
    info = ckptfix.describe(f"{http_server.url}/{names[kind]}")
    assert info.bytes_fetched == http_server.bytes_sent  # every byte the server sent is counted, none twice
    whole = local.parent if kind == "sharded index" else local
    size = sum(p.stat().st_size for p in ([whole] if whole.is_file() else whole.iterdir()))
    assert info.bytes_fetched < size / 4, (info.bytes_fetched, size)
    want = ckptfix.describe(local).to_dict()
    got = info.to_dict()
    got["notes"] = [n.replace(http_server.url + f"/{names[kind]}".removesuffix("/model.safetensors.index.json"),
                              str(local.parent if kind == "sharded index" else local)) for n in got["notes"]]
    _same(got, want)


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded"])
def test_http_scan_is_the_local_scan(http_server: HttpServer, kind: str) -> None:
    names = write_checkpoints(http_server.root)
    report = scan(f"{http_server.url}/{names[kind]}")
    assert report.ok and report.bytes_fetched == http_server.bytes_sent
    _same(report.to_dict(), scan(http_server.root / names[kind], check_crc=False).to_dict())


def test_a_large_remote_zip_costs_kilobytes(http_server: HttpServer) -> None:
    """A 100-tensor zip of 26 MiB: describe fetches under 2 MiB, one request per local header (sent 16 at a time),
    a few more for the end records, the central directory and data.pkl; each block once."""
    torch.save({f"w{i}": torch.full((65_536,), float(i)) for i in range(100)}, http_server.root / "big.pth")
    info = ckptfix.describe(f"{http_server.url}/big.pth")
    assert info.num_tensors == 100 and info.bytes_fetched < 2 * 2**20
    assert http_server.requests <= 100 + 5


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


def test_remote_scan_finds_what_the_local_scan_finds(http_server: HttpServer) -> None:
    """Safety unchanged: an unsafe global in a remote file is the same finding; nothing runs."""
    torch.save({"state_dict": _state_dict(2), "hook": _Payload()}, http_server.root / "evil.pth")
    report = scan(f"{http_server.url}/evil.pth")
    assert not report.ok and report.unsafe_globals == ["posix.system"]
    _same(report.to_dict(), scan(http_server.root / "evil.pth", check_crc=False).to_dict())


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded", "dcp"])
def test_s3_describe_and_scan_are_the_local_ones(s3_server: S3Server, kind: str) -> None:
    names = write_checkpoints(s3_server.root)
    if kind == "dcp":
        names["dcp"] = write_dcp(s3_server.root)
    s3_server.upload()
    url, local = f"{s3_server.url}/{names[kind]}", s3_server.root / names[kind]
    info = ckptfix.describe(url).to_dict()
    want = ckptfix.describe(local).to_dict()
    info["notes"] = [n.replace(url, str(local)) for n in info["notes"]]
    _same(info, want)
    _same(scan(url).to_dict(), scan(local, check_crc=False).to_dict())


def test_remote_torch_path_is_refused_not_downloaded(http_server: HttpServer) -> None:
    names = write_checkpoints(http_server.root)
    with pytest.raises(errors.RemoteError, match="needs a local copy"):
        ckptfix.describe(f"{http_server.url}/{names['legacy']}")
    for verb in (ckptfix.read, ckptfix.inspect, ckptfix.load):
        with pytest.raises(errors.RemoteError, match="needs a local copy"):
            verb(f"{http_server.url}/{names['zip']}")
    assert http_server.bytes_sent < 64 * 1024


ERRORS = [  # (mode, file, error, message)
    ("files", "nope.pth", errors.MissingFileError, "no such file \\(HTTP 404\\)"),
    ("forbidden", "model.pth", errors.RemoteError, "access denied \\(HTTP 403"),
    ("loop", "model.pth", errors.RemoteError, "redirects in a loop"),
    ("norange", "model.pth", errors.RemoteError, "ignores Range requests"),
    ("changing", "model.pth", errors.RemoteError, "changed while it was being read"),
    ("slow", "model.pth", errors.RemoteError, "tries\\)"),
]


@pytest.mark.parametrize("mode, file, error, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_http_failures_are_one_clear_error(http_server: HttpServer, monkeypatch: pytest.MonkeyPatch, mode: str,
                                           file: str, error: type, message: str) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    http_server.delay = 1.0
    write_checkpoints(http_server.root)
    for call in (ckptfix.describe, scan):
        with pytest.raises(error, match=message):
            call(f"{http_server.mode(mode)}/{file}")


def test_transient_server_errors_are_retried(http_server: HttpServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each range's first request fails with a 503: it is tried again (after 0.2 s) and the describe completes."""
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    names = write_checkpoints(http_server.root)
    info = ckptfix.describe(f"{http_server.mode('flaky')}/{names['zip']}")
    assert info.num_tensors == 12 and http_server.requests == 2 * len(http_server.asked)


def test_s3_missing_object_and_bad_credentials(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(errors.MissingFileError, match="no such object"):
        ckptfix.describe(f"{s3_server.url}/nope.pth")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with pytest.raises(errors.RemoteError, match="AWS_ENDPOINT_URL"):
        ckptfix.describe(f"{s3_server.url}/model.pth")


def test_remote_needs_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without boto3, an s3:// URL says which extra installs it."""
    monkeypatch.setitem(sys.modules, "boto3", None)  # (what an import of a package not installed raises)
    with pytest.raises(errors.RemoteError, match=re.escape("pip install 'ckptfix[remote]'")):
        ckptfix.describe("s3://bucket/model.pth")


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded"])
def test_hub_describe_and_scan_are_the_local_ones(hub_server: HttpServer, kind: str) -> None:
    repo = hub_server.root / "org" / "repo"
    repo.mkdir(parents=True)
    names = write_checkpoints(repo)
    name = "" if kind == "sharded" else names[kind]  # the repository itself: its sharded index found in it
    local = repo / "sharded" if kind == "sharded" else repo / name
    if kind == "sharded":
        shutil.rmtree(repo / "legacy.pth", ignore_errors=True)
        for f in (repo / "sharded").iterdir():
            f.rename(repo / f.name)
        local = repo
    for url in (f"hf://org/repo/{name}".rstrip("/"), f"hf://org/repo@main/{name}".rstrip("/")):
        info = ckptfix.describe(url)
        assert 0 < info.bytes_fetched == hub_server.bytes_sent - hub_server.listed
        got = info.to_dict()
        got["notes"] = [n.replace(url, str(local)) for n in got["notes"]]
        _same(got, ckptfix.describe(local).to_dict())
        _same(scan(url).to_dict(), scan(local, check_crc=False).to_dict())
        hub_server.bytes_sent = hub_server.listed = 0


def test_hub_file_in_the_local_cache_is_read_from_there(hub_server: HttpServer) -> None:
    from huggingface_hub import hf_hub_download

    repo = hub_server.root / "org" / "repo"
    repo.mkdir(parents=True)
    names = write_checkpoints(repo)
    hf_hub_download("org/repo", names["zip"], endpoint=hub_server.base, cache_dir=os.environ["HF_HUB_CACHE"])
    before = hub_server.requests
    info = ckptfix.describe(f"hf://org/repo/{names['zip']}")
    assert info.bytes_fetched == 0 and hub_server.requests == before
    assert info.to_dict()["keys"] == ckptfix.describe(repo / names["zip"]).to_dict()["keys"]


def test_hub_missing_file_and_repo(hub_server: HttpServer) -> None:
    (hub_server.root / "org" / "repo").mkdir(parents=True)
    with pytest.raises(errors.MissingFileError, match="no such file in org/repo"):
        ckptfix.describe("hf://org/repo/nope.safetensors")
    with pytest.raises(errors.MissingFileError, match="no such repository"):
        ckptfix.describe("hf://org/other/model.safetensors")
