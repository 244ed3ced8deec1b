"""``ckptfix.convert(URL, local)`` (issue 19): a remote torch zip, safetensors file or Hugging Face sharded checkpoint
converted range by range straight into the atomic temp output, through the real servers of tests/remote_servers.py
(the Range-honouring HTTP server, moto's S3, the Hub): the output is byte for byte the local convert's, every source
byte is fetched once, a damaged record is the local convert's CRC error, a file that changes mid-copy and a 404 are
refused, and nothing is written by a failed convert. tests/cli/test_cli_remote.py imports the helpers from here.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.parse.zipdir import zip_directory
from file_server import FileServer
from hub_server import REPO, HubServer
from remote_servers import S3Server, http_server, hub_server, s3_server
from test_remote import _file_bytes, _hub_bytes

SERVERS = (http_server, hub_server, s3_server)  # the fixtures, registered by being in this module's namespace


class Net(torch.nn.Module):
    """A small model with what a real one has: layers, a BatchNorm (int64 buffer), a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(512, 96)
        self.body = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 96))
        self.head = torch.nn.Linear(96, 512, bias=False)
        self.head.weight = self.embed.weight  # tied


def write_sources(root: Path) -> dict[str, str]:
    """Each kind of source under ``root``, by the real code paths: name → its path relative to root."""
    model = Net()
    model.body(torch.randn(8, 96))  # running stats and num_batches_tracked that are not the defaults
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, root / "model.pth")
    torch.save(torch.nn.DataParallel(model).state_dict(), root / "ddp.pth")  # module.-prefixed keys
    plain = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}  # (safetensors: no ties)
    save_file(plain, str(root / "model.safetensors"))
    from huggingface_hub import save_torch_state_dict

    (root / "sharded").mkdir()
    save_torch_state_dict(plain, str(root / "sharded"), max_shard_size=100_000)  # Hugging Face's own sharding
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return NAMES


NAMES = {"zip": "model.pth", "ddp": "ddp.pth", "safetensors": "model.safetensors", "sharded": "sharded"}


class Remote:
    """A backend holding the sources: ``url(name)``, and the bytes its server sent of checkpoint files."""

    def __init__(self, root: Path, url: Callable[[str], str], sent: Callable[[], int], reset: Callable[[], None],
                 listed: Callable[[], int] = lambda: 0):
        self.root, self.url, self.sent, self.reset, self.listed = root, url, sent, reset, listed


def remote(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    """The sources written and served by ``backend``'s server (the fixture asked for by name: only it starts)."""
    if backend == "http":
        server: FileServer = request.getfixturevalue("http_server")
        write_sources(server.root)
        return Remote(server.root, server.url, lambda: _file_bytes(server), server.counts.reset)
    if backend == "hub":
        hub: HubServer = request.getfixturevalue("hub_server")
        write_sources(hub.root)
        return Remote(hub.root, lambda name: f"hf://{REPO}/{name}", lambda: _hub_bytes(hub), hub.counts.reset)
    s3: S3Server = request.getfixturevalue("s3_server")
    root = tmp_path / "bucket"
    root.mkdir()
    write_sources(root)
    objects = {f"/{s3.bucket}/{key}" for key in s3.upload(root, key="")}

    def sent() -> int:  # (the objects' ranges and the listings: is_dir asks whether a key is a prefix)
        with s3.counts.lock:
            return sum(s3.counts.bytes_sent.values())

    def listed() -> int:
        with s3.counts.lock:
            return sum(n for path, n in s3.counts.bytes_sent.items() if path not in objects)

    return Remote(root, s3.url, sent, s3.counts.reset, listed)


def masked(path: Path) -> bytes:
    """A file's bytes; a torch zip's ``.data/serialization_id`` (random per save, as torch.save's) and its CRC-32
    zeroed, so two converts of the same source compare byte for byte."""
    data = open(path, "rb").read()
    if not data.startswith(b"PK"):
        return data
    entry = next(e for e in zip_directory(str(path)).entries if e.name.endswith(".data/serialization_id"))
    start = data.index(entry.name.encode()) + len(entry.name)  # (the local header's name; its data follows the extra)
    sid = data[start:].split(b"PK", 1)[0][-entry.file_size:]
    assert zlib.crc32(sid) == entry.crc
    return data.replace(sid, b"0" * len(sid)).replace(struct.pack("<I", entry.crc), b"\0" * 4)


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
    assert got.nbytes_in <= got.bytes_fetched - src.listed() <= size + 4096, (got.bytes_fetched, size)  # … once
    g, w = got.to_dict(), want.to_dict()
    for d in (g, w):
        for field in ("src", "dst", "seconds", "peak_rss", "bytes_fetched"):
            d.pop(field, None)
    g["notes"] = [n.replace(src.url(names[kind]), str(src.root / names[kind])) for n in g["notes"]]
    assert g == w


def _corrupt_record(path: Path) -> None:
    """Flip one byte inside the first tensor record of a torch zip, leaving the zip's CRC-32 as it was."""
    entry = next(e for e in zip_directory(str(path)).entries if "/data/" in e.name and e.file_size > 1000)
    data = bytearray(path.read_bytes())
    start = data.index(entry.name.encode()) + len(entry.name)
    start += struct.unpack("<H", data[start - len(entry.name) - 2 : start - len(entry.name)])[0]  # the extra field
    data[start + entry.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["out.safetensors", "out.pth"])
def test_a_damaged_record_is_the_local_crc_error(http_server: FileServer, tmp_path: Path, name: str) -> None:
    names = write_sources(http_server.root)
    _corrupt_record(http_server.root / names["ddp"])
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
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()
    assert got.bytes_fetched == _file_bytes(http_server) <= (http_server.root / "big.pth").stat().st_size
