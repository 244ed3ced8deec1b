"""``ckptfix.convert(URL, local)`` (issue 19): a remote torch zip, safetensors file or Hugging Face sharded checkpoint
converted range by range straight into the atomic temp output, through the real servers of tests/remote_servers.py
(the Range-honouring HTTP server, moto's S3, the Hub): the output is byte for byte the local convert's, every source
byte is fetched once, a damaged record is the local convert's CRC error, a file that changes mid-copy and a 404 are
refused, and nothing is written by a failed convert.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix import errors
from tests.file_server import FileServer
from tests.remote_servers import http_server, hub_server, s3_server
from tests.remote_sources import NAMES, file_bytes, corrupt_record, masked, remote, write_sources

SERVERS = (http_server, hub_server, s3_server)  # the fixtures, registered by being in this module's namespace


def tree(path: Path) -> dict[str, bytes]:
    """A file's (masked) bytes, or a directory's, by name."""
    if path.is_file():
        return {"": masked(path)}
    return {p.name: masked(p) for p in sorted(path.iterdir())}


def source_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())


OUTPUTS: dict[str, tuple[str, dict[str, Any]]] = {  # name → (output name, convert's keywords)
    "safetensors": ("out.safetensors", {}),
    "pth": ("out.pth", {}),
    "pth keep": ("out.pth", {"to": "keep", "keep_extra": True}),
    "shards": ("out", {"max_shard_size": 150_000}),
    "pth shards": ("out", {"max_shard_size": 150_000, "format": "pth"}),
}


@pytest.mark.parametrize("output", list(OUTPUTS))
@pytest.mark.parametrize("kind", ["zip", "ddp", "safetensors", "sharded"])
@pytest.mark.parametrize("backend", ["http", "s3", "hub"])
def test_remote_convert_is_the_local_convert(request: pytest.FixtureRequest, tmp_path: Path, backend: str,
                                             kind: str, output: str) -> None:
    names = NAMES
    name, options = OUTPUTS[output]
    if output == "pth keep" and kind not in ("zip", "ddp"):
        options = {"to": "keep"}  # (nothing beside the state dict to keep)
    src = remote(backend, request, tmp_path)
    (tmp_path / "r").mkdir(), (tmp_path / "l").mkdir()
    got = ckptfix.convert(src.url(names[kind]), tmp_path / "r" / name, **options)
    want = ckptfix.convert(src.root / names[kind], tmp_path / "l" / name, **options)
    assert tree(tmp_path / "r" / name) == tree(tmp_path / "l" / name)
    assert got.bytes_fetched is not None and "bytes_fetched" not in want.to_dict()
    assert got.bytes_fetched == src.sent()  # every byte the server sent of the checkpoint is counted …
    size = source_size(src.root / names[kind])
    # … and each byte once: a tied tensor stored under each name (the default) whose names land in two shards is
    # copied into the later shard from the earlier one, not fetched again
    assert got.nbytes_in <= got.bytes_fetched - src.listed() <= size + 4096, (got.bytes_fetched, size)
    g, w = got.to_dict(), want.to_dict()
    # (the outputs differ in their lineage alone, whose length the source's identity sets: each size its own)
    assert (g["bytes_written"], w["bytes_written"]) == (source_size(tmp_path / "r" / name), source_size(tmp_path / "l" / name))
    for d in (g, w):
        for field in ("src", "dst", "seconds", "peak_rss", "bytes_fetched", "bytes_written"):
            d.pop(field, None)
    g["notes"] = [n.replace(src.url(names[kind]), str(src.root / names[kind])) for n in g["notes"]]
    assert g == w


@pytest.mark.parametrize("name", ["out.safetensors", "out.pth"])
def test_a_damaged_record_is_the_local_crc_error(http_server: FileServer, tmp_path: Path, name: str) -> None:
    names = write_sources(http_server.root)
    corrupt_record(http_server.root / names["ddp"])
    with pytest.raises(errors.FormatError, match="does not match the CRC-32 its zip records") as local:
        ckptfix.convert(http_server.root / names["ddp"], tmp_path / name)
    url = http_server.url(names["ddp"])
    with pytest.raises(errors.FormatError, match="does not match the CRC-32 its zip records") as got:
        ckptfix.convert(url, tmp_path / name)
    assert str(got.value) == str(local.value).replace(str(http_server.root / names["ddp"]), url)
    assert os.listdir(tmp_path) == ["http"]  # no output, no temp file left


def test_a_file_changing_mid_copy_is_refused(http_server: FileServer, tmp_path: Path) -> None:
    """The file is replaced (new ETag) once the convert has described it: its copy's first range sees it."""
    names = write_sources(http_server.root)
    path = f"/{names['zip']}"
    ckptfix.describe(http_server.url(names["zip"]))
    described = http_server.counts.requests[path]  # what a convert's describe asks too (the same reader)
    http_server.change_after(names["zip"], 2 * described, (http_server.root / names["zip"]).read_bytes())
    with pytest.raises(errors.RemoteError, match="changed while it was being read"):
        ckptfix.convert(http_server.url(names["zip"]), tmp_path / "out.safetensors")
    assert http_server.counts.requests[path] > 2 * described  # refused by the copy, not the describe
    assert os.listdir(tmp_path) == ["http"]


def test_a_missing_file_is_one_error(http_server: FileServer, tmp_path: Path) -> None:
    with pytest.raises(errors.MissingFileError, match="no such file \\(HTTP 404\\)"):
        ckptfix.convert(http_server.url("nope.pth"), tmp_path / "out.safetensors")
    assert os.listdir(tmp_path) == ["http"]


@pytest.mark.parametrize("options, why", [({"dtype": "bf16"}, "--dtype bf16"), ({"trust": True}, "--trust"),
                                          ({"format": "dcp"}, "dcp output")])
def test_what_needs_torch_is_refused_not_downloaded(http_server: FileServer, tmp_path: Path, options: dict,
                                                    why: str) -> None:
    names = write_sources(http_server.root)
    dst = tmp_path / ("out" if options.get("format") else "out.safetensors")
    with pytest.raises(errors.RemoteError, match=f"converting it needs a local copy \\({why}"):
        ckptfix.convert(http_server.url(names["zip"]), dst, **options)
    assert os.listdir(tmp_path) == ["http"]
    assert http_server.counts.total_bytes < source_size(http_server.root / names["zip"]) / 2  # headers, not the file


def test_a_large_file_is_copied_in_bounded_windows(http_server: FileServer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 1 MiB over a 24 MiB file: the output is the local one, each byte fetched once."""
    from ckptfix.core import rangecopy

    monkeypatch.setattr(rangecopy, "WINDOW", 2**20)
    monkeypatch.setattr(rangecopy, "AHEAD", 2 * 2**20)
    torch.save({f"w{i}": torch.randn(2**20 + i) for i in range(6)}, http_server.root / "big.pth")
    got = ckptfix.convert(http_server.url("big.pth"), tmp_path / "r.safetensors")
    ckptfix.convert(http_server.root / "big.pth", tmp_path / "l.safetensors")
    assert masked(tmp_path / "r.safetensors") == masked(tmp_path / "l.safetensors")  # (but the lineage)
    assert got.bytes_fetched == file_bytes(http_server) <= (http_server.root / "big.pth").stat().st_size
