"""The servers of tests/remote_servers.py against the real clients (requests, boto3, fsspec's HTTPFileSystem,
s3fs, huggingface_hub), no mock anywhere: each server answers what the client asks, byte for byte, and
counts what it sent. The files are real checkpoints (safetensors' save_file, torch.save's zip)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.file_server import FileServer
from tests.hub_server import COMMIT, HubServer
from tests.remote_servers import S3Server, http_server, https_server, hub_server, s3_server

SERVERS = (http_server, https_server, hub_server, s3_server)  # the fixtures, registered by being in this module's namespace


def write_checkpoint(folder: Path, kind: str) -> Path:
    """A real checkpoint of a few MiB: ``model.safetensors`` (save_file) or ``model.pth`` (torch.save)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(256, 1024, generator=gen) for i in range(4)}
    state["layers.0.bias"] = torch.arange(7, dtype=torch.int64)
    if kind == "safetensors":
        path = folder / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
    else:
        path = folder / "model.pth"
        torch.save(state, path)
    return path


KINDS = ["safetensors", "pth"]
SPANS = [(0, 7), (100, 4195), (4 << 20, (4 << 20) + 99)]  # inclusive, as Range writes them


# -- http_server ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_http_range_head_and_counts(http_server: FileServer, kind: str) -> None:
    import requests

    path = write_checkpoint(http_server.root, kind)
    data = path.read_bytes()
    url = http_server.url(path.name)
    head = requests.head(url, timeout=10)
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == len(data)
    assert head.headers["ETag"] and head.headers["Last-Modified"] and head.headers["Accept-Ranges"] == "bytes"
    with requests.Session() as session:  # several ranges on one kept-alive connection
        for first, last in [*SPANS, (len(data) - 5, len(data) + 100)]:
            r = session.get(url, headers={"Range": f"bytes={first}-{last}"}, timeout=10)
            end = min(last, len(data) - 1)
            assert r.status_code == 206 and r.content == data[first:end + 1]
            assert r.headers["Content-Range"] == f"bytes {first}-{end}/{len(data)}"
        assert session.get(url, headers={"Range": "bytes=-8"}, timeout=10).content == data[-8:]
        assert session.get(url, headers={"Range": f"bytes={len(data)}-"}, timeout=10).status_code == 416
    spans = sum(min(b, len(data) - 1) - a + 1 for a, b in [*SPANS, (len(data) - 5, len(data) + 100)]) + 8
    assert http_server.counts.bytes_sent == {f"/{path.name}": spans}
    assert http_server.counts.requests == {f"/{path.name}": 2 + len(SPANS) + 1 + 1}
    assert http_server.counts.ranges[0] == (f"/{path.name}", None)
    http_server.counts.reset()
    assert requests.get(url, timeout=10).content == data
    assert http_server.counts.total_bytes == len(data) and http_server.counts.total_requests == 1


def test_http_ignore_range_sends_everything(http_server: FileServer) -> None:
    import requests

    data = write_checkpoint(http_server.root, "safetensors").read_bytes()
    http_server.ignore_range = True
    r = requests.get(http_server.url("model.safetensors"), headers={"Range": "bytes=0-7"}, timeout=10)
    assert r.status_code == 200 and "Content-Range" not in r.headers and r.content == data
    assert http_server.counts.total_bytes == len(data)


@pytest.mark.parametrize("code", [403, 404])
def test_http_forced_status(http_server: FileServer, code: int) -> None:
    import requests

    write_checkpoint(http_server.root, "pth")
    http_server.status["/model.pth"] = code
    assert requests.get(http_server.url("model.pth"), timeout=10).status_code == code
    assert requests.get(http_server.url("absent.pth"), timeout=10).status_code == 404


def test_http_delay_times_a_client_out(http_server: FileServer) -> None:
    import requests

    write_checkpoint(http_server.root, "pth")
    http_server.delay["/model.pth"] = 1.0
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(http_server.url("model.pth"), timeout=0.2)


@pytest.mark.parametrize("fails", [1, 2])
def test_http_flaky_fails_each_range_n_times(http_server: FileServer, fails: int) -> None:
    """``flaky[path] = N``: the first N requests for each Range of the path are 503s; a client that retries
    (requests with urllib3's Retry) gets the bytes, and one that does not gets the 503."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    data = write_checkpoint(http_server.root, "safetensors").read_bytes()
    url = http_server.url("model.safetensors")
    http_server.flaky["/model.safetensors"] = fails
    assert requests.get(url, headers={"Range": "bytes=0-7"}, timeout=10).status_code == 503
    with requests.Session() as session:
        session.mount("http://", HTTPAdapter(max_retries=Retry(total=fails, status_forcelist=[503], backoff_factor=0)))
        for first, last in SPANS:
            r = session.get(url, headers={"Range": f"bytes={first}-{last}"}, timeout=10)
            assert r.status_code == 206 and r.content == data[first:last + 1]
    # (the first request's 503 was one of bytes=0-7's: each Range failed N times, then was answered once)
    assert http_server.counts.requests["/model.safetensors"] == (fails + 1) * len(SPANS)
    error = len(b"503 for /model.safetensors (flaky)\n")
    assert http_server.counts.bytes_sent["/model.safetensors"] == sum(b - a + 1 for a, b in SPANS) + error * fails * len(SPANS)
    assert requests.get(http_server.url("absent.pth"), timeout=10).status_code == 404  # other paths unaffected


@pytest.mark.parametrize("via", ["requests", "boto3"])
def test_drip_sends_a_body_that_slowly(http_server: FileServer, s3_server: S3Server, via: str) -> None:
    """``drip[path] = N``: the body comes at about N bytes/s, in pieces (a client sees it move, slowly); a server on
    127.0.0.2 (another host to a client) records each request's headers."""
    import time

    import requests

    data = bytes(range(256)) * 8  # 2 KiB at 4 KiB/s: about half a second
    (http_server.root / "b.bin").write_bytes(data)
    start = time.monotonic()
    if via == "requests":
        with FileServer(http_server.root, host="127.0.0.2") as other:
            other.drip["/b.bin"] = 4096
            r = requests.get(other.url("b.bin"), headers={"Range": "bytes=0-2047", "X-Probe": "1"}, timeout=10)
            assert r.status_code == 206 and r.content == data and other.base_url.startswith("http://127.0.0.2:")
            assert [(p, h["x-probe"], h["range"]) for p, h in other.request_headers] == [("/b.bin", "1", "bytes=0-2047")]
    else:
        s3_server.upload(http_server.root / "b.bin")
        s3_server.drip[f"/{s3_server.bucket}/b.bin"] = 4096
        assert s3_server.client().get_object(Bucket=s3_server.bucket, Key="b.bin")["Body"].read() == data
    assert 0.4 < time.monotonic() - start < 5


def test_http_redirect_loop(http_server: FileServer) -> None:
    import requests

    http_server.redirect_loop.add("/loop")
    with pytest.raises(requests.exceptions.TooManyRedirects):
        requests.get(http_server.url("loop"), timeout=10)
    assert http_server.counts.requests["/loop"] > 1


def test_http_file_changes_between_requests(http_server: FileServer) -> None:
    import requests

    data = write_checkpoint(http_server.root, "safetensors").read_bytes()
    url = http_server.url("model.safetensors")
    http_server.change_after("model.safetensors", 1, b"changed" * 10)
    first = requests.get(url, headers={"Range": "bytes=0-7"}, timeout=10)
    assert first.content == data[:8]
    second = requests.get(url, headers={"Range": "bytes=0-7", "If-Match": first.headers["ETag"]}, timeout=10)
    assert second.status_code == 412 and second.headers["ETag"] != first.headers["ETag"]
    third = requests.get(url, headers={"Range": "bytes=0-6"}, timeout=10)
    assert third.content == b"changed" and third.headers["Last-Modified"] != first.headers["Last-Modified"]
    whole = requests.get(url, headers={"Range": "bytes=0-6", "If-Range": first.headers["ETag"]}, timeout=10)
    assert whole.status_code == 200 and whole.content == b"changed" * 10  # If-Range: a changed file comes whole


@pytest.mark.parametrize("kind", KINDS)
def test_http_fsspec_reads_a_range(http_server: FileServer, kind: str) -> None:
    from fsspec.implementations.http import HTTPFileSystem

    path = write_checkpoint(http_server.root, kind)
    data = path.read_bytes()
    fs = HTTPFileSystem(skip_instance_cache=True)
    assert fs.ls(http_server.url(), detail=False) == [http_server.url(path.name)]
    with fs.open(http_server.url(path.name), "rb", block_size=64 << 10, cache_type="none") as f:
        f.seek(100)
        assert f.read(4096) == data[100:4196]
        f.seek(-8, 2)
        assert f.read() == data[-8:]
    assert http_server.counts.bytes_sent[f"/{path.name}"] < len(data) // 10


def test_https_trusted_through_the_environment(https_server: FileServer) -> None:
    import ssl
    import urllib.request

    import requests
    from fsspec.implementations.http import HTTPFileSystem

    data = write_checkpoint(https_server.root, "safetensors").read_bytes()
    url = https_server.url("model.safetensors")
    assert url.startswith("https://127.0.0.1:")
    assert requests.get(url, headers={"Range": "bytes=8-99"}, timeout=10).content == data[8:100]
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=0-7"}), timeout=10) as r:
        assert r.status == 206 and r.read() == data[:8]
    trusted = ssl.create_default_context(cafile=str(https_server.tls[0]))  # aiohttp's default: made at its import
    with HTTPFileSystem(skip_instance_cache=True, ssl=trusted).open(url, "rb", block_size=1 << 16, cache_type="none") as f:
        f.seek(-16, 2)
        assert f.read() == data[-16:]
    with pytest.raises(requests.exceptions.SSLError):  # the server really speaks TLS with its own certificate
        requests.get(url, timeout=10, verify=requests.certs.where())


# -- s3_server -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_s3_boto3_range(s3_server: S3Server, tmp_path: Path, kind: str) -> None:
    import boto3

    path = write_checkpoint(tmp_path, kind)
    data = path.read_bytes()
    assert s3_server.upload(path) == [path.name]
    client = boto3.client("s3")  # the environment alone finds the server
    for first, last in SPANS:
        got = client.get_object(Bucket=s3_server.bucket, Key=path.name, Range=f"bytes={first}-{last}")
        assert got["ContentRange"] == f"bytes {first}-{last}/{len(data)}" and got["Body"].read() == data[first:last + 1]
    head = client.head_object(Bucket=s3_server.bucket, Key=path.name)
    assert head["ContentLength"] == len(data) and head["ETag"]
    assert s3_server.counts.bytes_sent[f"/{s3_server.bucket}/{path.name}"] == sum(b - a + 1 for a, b in SPANS)


def test_s3_s3fs_ls_and_range(s3_server: S3Server, tmp_path: Path) -> None:
    import s3fs

    folder = tmp_path / "ckpt-dir"
    (folder / "sub").mkdir(parents=True)
    st = write_checkpoint(folder, "safetensors")
    pth = write_checkpoint(folder / "sub", "pth")
    assert s3_server.upload(folder, "run") == ["run/model.safetensors", "run/sub/model.pth"]
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert fs.ls(f"{s3_server.bucket}/run", detail=False) == [f"{s3_server.bucket}/run/model.safetensors",
                                                             f"{s3_server.bucket}/run/sub"]
    assert fs.info(f"{s3_server.bucket}/run/sub/model.pth")["size"] == pth.stat().st_size
    data = st.read_bytes()
    with fs.open(s3_server.url("run/model.safetensors"), "rb", block_size=64 << 10, cache_type="none") as f:
        f.seek(4 << 20)
        assert f.read(100) == data[4 << 20:(4 << 20) + 100]
    assert 0 < s3_server.counts.bytes_sent[f"/{s3_server.bucket}/run/model.safetensors"] < len(data) // 10


@pytest.mark.parametrize("code", [403, 404])
def test_s3_status_and_delay(s3_server: S3Server, tmp_path: Path, code: int) -> None:
    import botocore.config
    import botocore.exceptions

    s3_server.upload(write_checkpoint(tmp_path, "pth"))
    s3_server.status[f"/{s3_server.bucket}/model.pth"] = code
    client = s3_server.client()
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.get_object(Bucket=s3_server.bucket, Key="model.pth", Range="bytes=0-7")
    assert caught.value.response["Error"]["Code"] == {403: "AccessDenied", 404: "NoSuchKey"}[code]
    del s3_server.status[f"/{s3_server.bucket}/model.pth"]
    s3_server.delay[f"/{s3_server.bucket}/model.pth"] = 1.0
    import boto3

    impatient = boto3.client("s3", config=botocore.config.Config(read_timeout=0.2, retries={"max_attempts": 1}))
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        impatient.get_object(Bucket=s3_server.bucket, Key="model.pth", Range="bytes=0-7")


# -- hub_server ----------------------------------------------------------------------------------------
def safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("redirect", [False, True], ids=["direct", "cdn-redirect"])
def test_hub_get_safetensors_metadata(hub_server: HubServer, redirect: bool) -> None:
    import huggingface_hub

    path = write_checkpoint(hub_server.root, "safetensors")
    hub_server.redirect_to_cdn = redirect
    meta = huggingface_hub.get_safetensors_metadata("org/name")
    header = safetensors_header(path)
    assert not meta.sharded and meta.weight_map == {k: "model.safetensors" for k in header if k != "__metadata__"}
    file_meta = meta.files_metadata["model.safetensors"]
    assert file_meta.metadata == header["__metadata__"]
    for name, info in file_meta.tensors.items():
        assert (info.dtype, info.shape, list(info.data_offsets)) == (
            header[name]["dtype"], header[name]["shape"], header[name]["data_offsets"])
    assert hub_server.file_bytes("model.safetensors") == 100_001 < path.stat().st_size  # its one Range request


@pytest.mark.parametrize("redirect", [False, True], ids=["direct", "cdn-redirect"])
def test_hub_download_and_errors(hub_server: HubServer, tmp_path: Path, redirect: bool) -> None:
    import huggingface_hub
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    data = write_checkpoint(hub_server.root, "pth").read_bytes()
    hub_server.redirect_to_cdn = redirect
    local = huggingface_hub.hf_hub_download("org/name", "model.pth")
    assert Path(local).read_bytes() == data and f"snapshots/{COMMIT}/" in local
    assert hub_server.file_bytes("model.pth") == len(data)
    with pytest.raises(RemoteEntryNotFoundError):
        huggingface_hub.hf_hub_download("org/name", "absent.pth", cache_dir=tmp_path / "c2")
    with pytest.raises(RepositoryNotFoundError):
        huggingface_hub.hf_hub_download("org/other", "model.pth", cache_dir=tmp_path / "c3")
    with pytest.raises(RevisionNotFoundError):
        huggingface_hub.hf_hub_download("org/name", "model.pth", revision="v9", cache_dir=tmp_path / "c4")


def test_hub_api_and_filesystem(hub_server: HubServer) -> None:
    from huggingface_hub import HfApi, HfFileSystem

    (hub_server.root / "shards").mkdir()
    st = write_checkpoint(hub_server.root, "safetensors")
    pth = write_checkpoint(hub_server.root / "shards", "pth")
    api = HfApi()
    assert api.model_info("org/name", revision="main").sha == api.model_info("org/name").sha == COMMIT
    assert api.list_repo_files("org/name") == ["model.safetensors", "shards/model.pth"]
    assert [e.path for e in api.get_paths_info("org/name", ["shards", "absent", "model.safetensors"])] == [
        "shards", "model.safetensors"]
    fs = HfFileSystem()
    assert fs.ls("org/name", detail=False) == ["org/name/model.safetensors", "org/name/shards"]
    assert fs.ls("org/name/shards", detail=False) == ["org/name/shards/model.pth"]
    assert fs.info("org/name/shards/model.pth", refresh=True)["size"] == pth.stat().st_size
    assert sorted(fs.find("org/name")) == ["org/name/model.safetensors", "org/name/shards/model.pth"]
    data = st.read_bytes()
    with fs.open("org/name/model.safetensors", "rb", block_size=64 << 10, cache_type="none") as f:
        f.seek(100)
        assert f.read(4096) == data[100:4196]
    assert 0 < hub_server.file_bytes("model.safetensors") < len(data) // 10


def test_hub_switches(hub_server: HubServer) -> None:
    """The file server's switches work on the Hub's resolve paths: a Hub that ignores Range costs the client
    the whole file; 403; a file replaced after a request has a new ETag."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    path = write_checkpoint(hub_server.root, "safetensors")
    hub_server.ignore_range = True
    huggingface_hub.get_safetensors_metadata("org/name")
    assert hub_server.file_bytes("model.safetensors") == path.stat().st_size
    hub_server.ignore_range = False
    url = hub_server.resolve_url("model.safetensors")
    before = huggingface_hub.get_hf_file_metadata(url)
    hub_server.change_after("model.safetensors", hub_server.counts.requests[hub_server.resolve_path("model.safetensors")],
                            b"replaced")
    after = huggingface_hub.get_hf_file_metadata(url)
    assert (after.size, after.commit_hash) == (8, COMMIT) and after.etag != before.etag
    hub_server.status[hub_server.resolve_path("model.safetensors")] = 403
    with pytest.raises(HfHubHTTPError) as caught:
        huggingface_hub.get_hf_file_metadata(url)
    assert caught.value.response.status_code == 403
