"""Writing remote (issue 19 item 4): ``convert in.pth s3://bucket/out.safetensors`` through moto's real S3 server
(tests/remote_servers.py): the object is byte for byte the local convert's output, uploaded in parts (or one
put_object when it is one part or less); nothing is at the key until the upload completes, and a failure or a
signal mid-upload aborts it (no multipart upload left) and removes the local temp file. The failures are injected
at ckptfix's own seam (``s3_backend.send_part``), the S3 server is real.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix import errors
from ckptfix.core import upload
from tests.remote_servers import S3Server, s3_server
from tests.remote_uploads import failing_part, object_bytes, same_output, sources, uploads

SERVERS = (s3_server,)  # the fixture, registered by being in this module's namespace
PART = 5 * 2**20  # S3's smallest part: a 12 MiB output goes up in 3 parts


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR for the test: the upload's temp files go there (and must be gone after)."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("CKPTFIX_UPLOAD_PART_SIZE", str(PART))
    return folder


OPTIONS: dict[str, dict[str, Any]] = {"torch-free": {}, "torch (fp16 cast)": {"dtype": "fp16"}}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("mib", [1, 12], ids=["one put", "multipart"])
@pytest.mark.parametrize("src, ext", [("pth", ".safetensors"), ("safetensors", ".pth"), ("pth", ".pth")])
def test_s3_output_is_the_local_output(s3_server: S3Server, tmp_path: Path, temp_dir: Path, src: str, ext: str,
                                       mib: int, options: dict[str, Any]) -> None:
    files = sources(tmp_path, mib)
    local = tmp_path / f"out{ext}"
    want_report = ckptfix.convert(files[src], local, **options)
    url = s3_server.url(f"runs/out{ext}")
    report = ckptfix.convert(files[src], url, **options)
    assert same_output(object_bytes(s3_server, f"runs/out{ext}"), local.read_bytes())
    size = local.stat().st_size
    parts = -(-size // PART) if size > PART else 1
    assert (mib == 1) == (parts == 1)
    assert report.dst == url and report.bytes_written == size
    assert f"uploaded {size} bytes to {url} ({parts} part{'s' if parts > 1 else ''})" in " ".join(report.notes)
    assert report.streamed == want_report.streamed and report.num_tensors == want_report.num_tensors
    assert uploads(s3_server) == [] and list(temp_dir.iterdir()) == []


def test_hashed_name_on_s3(s3_server: S3Server, tmp_path: Path, temp_dir: Path) -> None:
    files = sources(tmp_path, 1)
    want = ckptfix.convert(files["pth"], tmp_path / "out.safetensors", hash=True)
    report = ckptfix.convert(files["pth"], s3_server.url("out.safetensors"), hash=True)
    name = os.path.basename(want.dst)
    assert report.dst == s3_server.url(name) and same_output(object_bytes(s3_server, name), Path(want.dst).read_bytes())
    assert object_bytes(s3_server, "out.safetensors") is None


def _nothing_left(s3: S3Server, key: str, temp_dir: Path) -> None:
    assert object_bytes(s3, key) is None
    assert uploads(s3) == []  # aborted: no parts left stored (and billed)
    assert list(temp_dir.iterdir()) == []


@pytest.mark.parametrize("src", ["pth", "safetensors"])
def test_a_failed_part_aborts_the_upload(s3_server: S3Server, tmp_path: Path, temp_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch, src: str) -> None:
    files = sources(tmp_path, 12)

    def fail() -> None:
        raise errors.RemoteError("s3://ckpt/out.safetensors: S3 error InternalError (injected)")

    sent = failing_part(monkeypatch, 2, fail)
    with pytest.raises(errors.RemoteError, match="injected"):
        ckptfix.convert(files[src], s3_server.url("out.safetensors"))
    assert 2 not in sent
    _nothing_left(s3_server, "out.safetensors", temp_dir)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_upload_aborts_it(s3_server: S3Server, tmp_path: Path, temp_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    files = sources(tmp_path, 12)

    def interrupt() -> None:  # (the signal reaches the main thread, which waits for the parts)
        os.kill(os.getpid(), signum)
        time.sleep(0.5)

    failing_part(monkeypatch, 2, interrupt)
    with pytest.raises(errors.Interrupted) as caught:
        ckptfix.convert(files["pth"], s3_server.url("out.safetensors"))
    assert caught.value.signum == signum and not caught.value.written
    _nothing_left(s3_server, "out.safetensors", temp_dir)


def test_an_object_put_there_meanwhile_is_not_replaced(s3_server: S3Server, tmp_path: Path, temp_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without force the upload completes only if the key is still free (If-None-Match: *)."""
    files = sources(tmp_path, 12)
    failing_part(monkeypatch, 1, lambda: s3_server.client().put_object(Bucket=s3_server.bucket, Key="out.pth",
                                                                         Body=b"theirs"))
    with pytest.raises(errors.DestinationError, match="an object is at this key already"):
        ckptfix.convert(files["pth"], s3_server.url("out.pth"))
    assert object_bytes(s3_server, "out.pth") == b"theirs" and uploads(s3_server) == []
    assert list(temp_dir.iterdir()) == []


@pytest.mark.parametrize("mib", [1, 12], ids=["one put", "multipart"])
def test_existing_object_needs_force(s3_server: S3Server, tmp_path: Path, temp_dir: Path, mib: int) -> None:
    files = sources(tmp_path, mib)
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="out.safetensors", Body=b"old")
    url = s3_server.url("out.safetensors")
    with pytest.raises(errors.DestinationError, match="already exists; pass --force"):
        ckptfix.convert(files["pth"], url)
    assert object_bytes(s3_server, "out.safetensors") == b"old"
    ckptfix.convert(files["pth"], tmp_path / "out.safetensors")
    report = ckptfix.convert(files["pth"], url, force=True)
    assert same_output(object_bytes(s3_server, "out.safetensors"), (tmp_path / "out.safetensors").read_bytes())
    assert report.bytes_written == (tmp_path / "out.safetensors").stat().st_size


@pytest.mark.parametrize("existing", [False, True], ids=["new key", "existing key"])
@pytest.mark.parametrize("mib", [1, 12], ids=["one put", "multipart"])
def test_a_write_only_policy_can_upload(s3_server: S3Server, tmp_path: Path, temp_dir: Path, mib: int,
                                        existing: bool) -> None:
    """Without s3:ListBucket, S3 answers a HEAD with 403, found or not: the upload goes on (the bucket's and key's
    HEADs say nothing), and If-None-Match still keeps an object that is there."""
    files = sources(tmp_path, mib)
    if existing:
        s3_server.client().put_object(Bucket=s3_server.bucket, Key="w/out.safetensors", Body=b"theirs")
    for path in (f"/{s3_server.bucket}", f"/{s3_server.bucket}/w/out.safetensors"):
        s3_server.head_status[path] = 403
    url = s3_server.url("w/out.safetensors")
    if existing:
        with pytest.raises(errors.DestinationError, match="an object is at this key already"):
            ckptfix.convert(files["safetensors"], url)
        assert object_bytes(s3_server, "w/out.safetensors") == b"theirs" and uploads(s3_server) == []
        return
    report = ckptfix.convert(files["safetensors"], url)
    want = ckptfix.convert(files["safetensors"], tmp_path / "out.safetensors")
    assert same_output(object_bytes(s3_server, "w/out.safetensors"), Path(want.dst).read_bytes())
    assert report.dst == url and s3_server.counts.requests[f"/{s3_server.bucket}/w/out.safetensors"] > 1


REFUSED = [  # (destination, options, error, message)
    ("https://example.com/out.safetensors", {}, errors.DestinationError, "http\\(s\\) URL can't be written"),
    ("http://example.com/out.safetensors", {}, errors.DestinationError, "http\\(s\\) URL can't be written"),
    ("hf://org/name/out.safetensors", {}, errors.DestinationError, "huggingface-cli upload"),
    ("s3://ckpt/sharded", {"max_shard_size": "1MB"}, errors.DestinationError, "not a sharded or DCP directory"),
    ("s3://ckpt/dcp", {"format": "dcp"}, errors.DestinationError, "not a sharded or DCP directory"),
    ("s3://ckpt/", {"format": "safetensors"}, errors.DestinationError, "names a bucket or prefix"),
    ("s3://nobucket/out.pth", {}, errors.DestinationError, "bucket nobucket does not exist"),
]


@pytest.mark.parametrize("dst, options, error, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_unwritable_destinations_are_refused_before_reading(s3_server: S3Server, tmp_path: Path, dst: str,
                                                            options: dict[str, Any], error: type, message: str) -> None:
    files = sources(tmp_path, 1)
    with pytest.raises(error, match=message):
        ckptfix.convert(files["pth"], dst, **options)
    assert uploads(s3_server) == [] and s3_server.client().list_objects_v2(Bucket=s3_server.bucket)["KeyCount"] == 0


def test_the_source_itself_is_refused(s3_server: S3Server) -> None:
    with pytest.raises(errors.DestinationError, match="is the source itself"):
        upload.check_destination(s3_server.url("model.pth"), s3_server.url("model.pth"), force=True)
