"""Remote checkpoints (issue 19): ``describe`` and ``scan`` of https:// and s3:// sources read header bytes only,
through the real servers of tests/remote_servers.py on 127.0.0.1 (tests/file_server.py's Range-honouring HTTP
server with its failure switches, tests/hub_server.py's Hub, moto's S3 server), and give exactly what the same
calls give for the local file. tests/cli/test_cli_remote.py imports ERRORS and the checkpoint writers from here.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.safety.scanner import scan
from file_server import FileServer
from hub_server import COMMIT, REPO, HubServer
from remote_servers import S3Server, http_server, hub_server, s3_server

SERVERS = (http_server, hub_server, s3_server)  # the fixtures, registered by being in this module's namespace


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


def _file_bytes(server: FileServer) -> int:
    """Body bytes the server sent of its files: not the bodies of its 404s (a client's probes for files that
    are not there, such as a directory's ``.metadata``), which no client counts as fetched."""
    with server.counts.lock:
        return sum(n for path, n in server.counts.bytes_sent.items() if server.file_for(path) is not None)


KINDS = ["zip", "safetensors", "sharded", "sharded index", "dcp"]


@pytest.mark.parametrize("kind", KINDS)
def test_http_describe_is_the_local_describe_from_headers_only(http_server: FileServer, kind: str) -> None:
    names = write_checkpoints(http_server.root)
    if kind == "dcp":  # (a web server lists nothing: the directory's .metadata is asked for by name)
        names["dcp"] = write_dcp(http_server.root)
    local = http_server.root / names[kind]
    info = ckptfix.describe(http_server.url(names[kind]))
    assert info.bytes_fetched == _file_bytes(http_server)  # every byte the server sent is counted, none twice
    whole = local.parent if kind == "sharded index" else local
    size = sum(p.stat().st_size for p in ([whole] if whole.is_file() else whole.iterdir()))
    assert info.bytes_fetched < size / 4, (info.bytes_fetched, size)
    want = ckptfix.describe(local).to_dict()
    got = info.to_dict()
    got["notes"] = [n.replace(http_server.url(names[kind]).removesuffix("/model.safetensors.index.json"),
                              str(local.parent if kind == "sharded index" else local)) for n in got["notes"]]
    _same(got, want)


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded"])
def test_http_scan_is_the_local_scan(http_server: FileServer, kind: str) -> None:
    names = write_checkpoints(http_server.root)
    report = scan(http_server.url(names[kind]))
    assert report.ok and report.bytes_fetched == _file_bytes(http_server)
    _same(report.to_dict(), scan(http_server.root / names[kind], check_crc=False).to_dict())


def test_a_large_remote_zip_costs_kilobytes(http_server: FileServer) -> None:
    """A 100-tensor zip of 26 MiB: describe fetches under 2 MiB, one request per local header (sent 16 at a time),
    a few more for the end records, the central directory and data.pkl; each block once."""
    torch.save({f"w{i}": torch.full((65_536,), float(i)) for i in range(100)}, http_server.root / "big.pth")
    info = ckptfix.describe(http_server.url("big.pth"))
    assert info.num_tensors == 100 and info.bytes_fetched < 2 * 2**20
    assert http_server.counts.total_requests <= 100 + 5


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


def test_remote_scan_finds_what_the_local_scan_finds(http_server: FileServer) -> None:
    """Safety unchanged: an unsafe global in a remote file is the same finding; nothing runs."""
    torch.save({"state_dict": _state_dict(2), "hook": _Payload()}, http_server.root / "evil.pth")
    report = scan(http_server.url("evil.pth"))
    assert not report.ok and report.unsafe_globals == ["posix.system"]
    _same(report.to_dict(), scan(http_server.root / "evil.pth", check_crc=False).to_dict())


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded", "dcp"])
def test_s3_describe_and_scan_are_the_local_ones(s3_server: S3Server, tmp_path: Path, kind: str) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    names = write_checkpoints(root)
    if kind == "dcp":
        names["dcp"] = write_dcp(root)
    objects = {f"/{s3_server.bucket}/{key}" for key in s3_server.upload(root, key="")}
    url, local = s3_server.url(names[kind]), root / names[kind]
    info = ckptfix.describe(url).to_dict()
    want = ckptfix.describe(local).to_dict()
    info["notes"] = [n.replace(url, str(local)) for n in info["notes"]]
    with s3_server.counts.lock:  # what moto sent, the objects and the listings' XML, no more, no less
        sent = dict(s3_server.counts.bytes_sent)
    assert info["bytes_fetched"] == sum(sent.values()) > sum(n for path, n in sent.items() if path in objects)
    _same(info, want)
    _same(scan(url).to_dict(), scan(local, check_crc=False).to_dict())


def test_remote_torch_path_is_refused_not_downloaded(http_server: FileServer) -> None:
    """What only torch.load of the whole file reads (a legacy file; any file trusted) is refused, not downloaded."""
    names = write_checkpoints(http_server.root)
    with pytest.raises(errors.RemoteError, match="needs a local copy"):
        ckptfix.describe(http_server.url(names["legacy"]))
    for verb in (ckptfix.read, ckptfix.inspect, ckptfix.load):
        with pytest.raises(errors.RemoteError, match="needs a local copy"):
            verb(http_server.url(names["legacy"]))
    with pytest.raises(errors.NeedsLocalCopy, match="with trust .*needs a local copy \\(torch.load reads the whole file"):
        ckptfix.inspect(http_server.url(names["zip"]), trust=True)
    # the sniff's first block per call (a 3 MB file), nothing for the trusted read
    assert http_server.counts.total_bytes <= 4 * 16 * 1024 and http_server.counts.requests == {"/legacy.pth": 4}


def _changing(server: FileServer, file: str) -> None:
    """The file replaced (same bytes, a later mtime: a new ETag and Last-Modified) once the next request for it
    is answered."""
    with server.counts.lock:
        served = server.counts.requests.get(f"/{file}", 0)
    server.change_after(file, served + 1, (server.root / file).read_bytes())


SWITCHES: dict[str, Callable[[FileServer, str], None]] = {  # mode → how the http_server is set for it, per call
    "files": lambda server, file: None,
    "forbidden": lambda server, file: server.status.__setitem__(f"/{file}", 403),
    "loop": lambda server, file: server.redirect_loop.add(f"/{file}"),
    "norange": lambda server, file: setattr(server, "ignore_range", True),
    "changing": _changing,
    "slow": lambda server, file: server.delay.__setitem__(f"/{file}", 1.0),
    "drip": lambda server, file: server.drip.__setitem__(f"/{file}", 20),  # (2 bytes each 0.1 s: no read waits 0.3 s)
}
ERRORS = [  # (mode, file, error, message); the mode is a switch of SWITCHES, set by failing()
    ("files", "nope.pth", errors.MissingFileError, "no such file \\(HTTP 404\\)"),
    ("forbidden", "model.pth", errors.RemoteError, "access denied \\(HTTP 403"),
    ("loop", "model.pth", errors.RemoteError, "redirects in a loop"),
    ("norange", "model.pth", errors.RemoteError, "ignores Range requests"),
    ("changing", "model.pth", errors.RemoteError, "changed while it was being read"),
    ("slow", "model.pth", errors.RemoteError, "tries\\)"),
    ("drip", "model.pth", errors.RemoteError, "stalled: .* CKPTFIX_REMOTE_MIN_RATE"),
]


def failing(server: FileServer, monkeypatch: pytest.MonkeyPatch, mode: str, file: str) -> str:
    """The checkpoints written, the client's timeout (0.3 s), stall window (1 s) and retries (1) set, ``mode``'s
    switch turned on for ``file``: its URL."""
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")
    monkeypatch.setenv("CKPTFIX_REMOTE_STALL_WINDOW", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    if not (server.root / "model.pth").exists():
        write_checkpoints(server.root)
    SWITCHES[mode](server, file)
    return server.url(file)


@pytest.mark.parametrize("mode, file, error, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_http_failures_are_one_clear_error(http_server: FileServer, monkeypatch: pytest.MonkeyPatch, mode: str,
                                           file: str, error: type, message: str) -> None:
    for call in (ckptfix.describe, scan):
        url = failing(http_server, monkeypatch, mode, file)  # (again: a changing file changes once per arming)
        with pytest.raises(error, match=message):
            call(url)


def test_transient_server_errors_are_retried(http_server: FileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each range's first request fails with a 503: it is tried again (after 0.2 s) and the describe completes."""
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    names = write_checkpoints(http_server.root)
    path = "/" + names["zip"]
    http_server.flaky[path] = 1
    info = ckptfix.describe(http_server.url(names["zip"]))
    asked = {r for p, r in http_server.counts.ranges if p == path}
    assert info.num_tensors == 12 and http_server.counts.requests[path] == 2 * len(asked)
    assert len(asked) > 1 and info.bytes_fetched == http_server.counts.total_bytes - len(asked) * len(
        f"503 for {path} (flaky)\n")  # the 503s' bodies are the server's, not the checkpoint's


def test_s3_missing_object_and_bad_credentials(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(errors.MissingFileError, match="no such object"):
        ckptfix.describe(s3_server.url("nope.pth"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    with pytest.raises(errors.RemoteError, match="AWS_ENDPOINT_URL"):
        ckptfix.describe(s3_server.url("model.pth"))


def test_remote_needs_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without boto3, an s3:// URL says which extra installs it."""
    monkeypatch.setitem(sys.modules, "boto3", None)  # (what an import of a package not installed raises)
    with pytest.raises(errors.RemoteError, match=re.escape("pip install 'ckptfix[remote]'")):
        ckptfix.describe("s3://bucket/model.pth")


def _hub_file(hub: HubServer, path: str) -> bool:
    return path.startswith((f"/{hub.repo}/resolve/", f"/cdn/{COMMIT}/"))


def _hub_file_bytes(hub: HubServer) -> int:
    """Body bytes the Hub sent of its files (resolve and CDN paths): not its API's JSON (huggingface_hub's listings)."""
    with hub.counts.lock:
        return sum(n for path, n in hub.counts.bytes_sent.items() if _hub_file(hub, path))


def _hub_bytes(hub: HubServer) -> int:
    """Body bytes the Hub sent, files and listings: all but the user-agent probe huggingface_hub makes once a process
    (``/api/agent-harnesses``), whoever triggers it first."""
    with hub.counts.lock:
        return sum(n for path, n in hub.counts.bytes_sent.items() if path != "/api/agent-harnesses")


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded"])
def test_hub_describe_and_scan_are_the_local_ones(hub_server: HubServer, kind: str) -> None:
    repo = hub_server.root  # the repository REPO
    names = write_checkpoints(repo)
    name = "" if kind == "sharded" else names[kind]  # the repository itself: its sharded index found in it
    local = repo / name
    if kind == "sharded":
        shutil.rmtree(repo / "legacy.pth", ignore_errors=True)
        for f in (repo / "sharded").iterdir():
            f.rename(repo / f.name)
        local = repo
    for url in (f"hf://{REPO}/{name}".rstrip("/"), f"hf://{REPO}@main/{name}".rstrip("/")):
        info = ckptfix.describe(url)
        assert _hub_file_bytes(hub_server) < info.bytes_fetched == _hub_bytes(hub_server)  # the listings counted
        got = info.to_dict()
        got["notes"] = [n.replace(url, str(local)) for n in got["notes"]]
        _same(got, ckptfix.describe(local).to_dict())
        _same(scan(url).to_dict(), scan(local, check_crc=False).to_dict())
        hub_server.counts.reset()


def test_hub_file_in_the_local_cache_is_read_from_there(hub_server: HubServer) -> None:
    from huggingface_hub import hf_hub_download

    names = write_checkpoints(hub_server.root)
    hf_hub_download(REPO, names["zip"], endpoint=hub_server.base_url, cache_dir=os.environ["HF_HUB_CACHE"])
    def file_requests() -> int:  # (the Hub's API, which huggingface_hub asks about the repo, is not the file)
        with hub_server.counts.lock:
            return sum(n for path, n in hub_server.counts.requests.items() if _hub_file(hub_server, path))

    assert file_requests() > 0
    hub_server.counts.reset()
    info = ckptfix.describe(f"hf://{REPO}/{names['zip']}")
    assert file_requests() == 0 and info.bytes_fetched == _hub_bytes(hub_server)  # (the API's listing: is it a folder?)
    assert info.to_dict()["keys"] == ckptfix.describe(hub_server.root / names["zip"]).to_dict()["keys"]


def test_hub_missing_file_and_repo(hub_server: HubServer) -> None:
    with pytest.raises(errors.MissingFileError, match=f"no such file in {REPO}"):
        ckptfix.describe(f"hf://{REPO}/nope.safetensors")
    with pytest.raises(errors.MissingFileError, match="no such repository"):
        ckptfix.describe("hf://org/other/model.safetensors")
