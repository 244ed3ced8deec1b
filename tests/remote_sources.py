"""Remote checkpoints for the tests of reading and converting a URL (tests/ops/test_remote*.py, tests/cli/test_cli_remote.py):
the checkpoints and convert sources written by the real code paths, each backend's server holding them, the bytes a
server sent of its files, the HTTP server's failure switches, and the comparisons a remote result needs.
"""

from __future__ import annotations

import json
import os
import struct
import time
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
from ckptfix.safety import digests
from tests.file_server import FileServer
from tests.hub_server import REPO, HubServer
from tests.remote_servers import S3Server


def random_state_dict(n: int = 12, width: int = 64 * 1024) -> dict[str, torch.Tensor]:
    """``n`` seeded float tensors of ``width`` elements, under ``module.``-prefixed keys."""
    g = torch.Generator().manual_seed(0)
    return {f"module.layers.{i}.weight": torch.randn(width, generator=g) for i in range(n)}


def write_checkpoints(root: Path) -> dict[str, str]:
    """Each kind of remote checkpoint under ``root``: name → its path relative to root."""
    sd = random_state_dict()
    torch.save({"state_dict": sd, "epoch": 3}, root / "model.pth")
    save_file({k: v.clone() for k, v in sd.items()}, str(root / "model.safetensors"))
    ckptfix.convert(root / "model.safetensors", root / "sharded", max_shard_size=1_000_000)
    torch.save(sd, root / "legacy.pth", _use_new_zipfile_serialization=False)
    return {"zip": "model.pth", "safetensors": "model.safetensors", "sharded": "sharded",
            "sharded index": "sharded/model.safetensors.index.json", "legacy": "legacy.pth"}


def assert_same_as_local(remote: dict, local: dict) -> None:
    """A remote result (a report's dict) is the local one's, but for its bytes fetched (some) and path."""
    fetched = remote.pop("bytes_fetched")
    assert isinstance(fetched, int) and fetched > 0
    remote.pop("path"), local.pop("path")
    assert remote == local


def file_bytes(server: FileServer) -> int:
    """Body bytes the server sent of its files: not the bodies of its 404s (a client's probes for files that
    are not there, such as a directory's ``.metadata``), which no client counts as fetched."""
    with server.counts.lock:
        return sum(n for path, n in server.counts.bytes_sent.items() if server.file_for(path) is not None)


class Payload:
    """An object whose pickle calls ``os.system``: the unsafe global a scan must find."""
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned",))


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
    """The checkpoints written, the client's timeout (0.3 s) and retries (1) set, ``mode``'s switch turned on
    for ``file``: its URL."""
    monkeypatch.setenv("CKPTFIX_REMOTE_TIMEOUT", "0.3")
    monkeypatch.setenv("CKPTFIX_REMOTE_STALL_WINDOW", "1")
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "1")
    if not (server.root / "model.pth").exists():
        write_checkpoints(server.root)
    SWITCHES[mode](server, file)
    return server.url(file)


def hub_bytes(hub: HubServer) -> int:
    """Body bytes the Hub sent, files and listings: all but the user-agent probe huggingface_hub makes once a process
    (``/api/agent-harnesses``), whoever triggers it first."""
    with hub.counts.lock:
        return sum(n for path, n in hub.counts.bytes_sent.items() if path != "/api/agent-harnesses")


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
        return Remote(server.root, server.url, lambda: file_bytes(server), server.counts.reset)
    if backend == "hub":
        hub: HubServer = request.getfixturevalue("hub_server")
        write_sources(hub.root)
        return Remote(hub.root, lambda name: f"hf://{REPO}/{name}", lambda: hub_bytes(hub), hub.counts.reset)
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
    zeroed, so two converts of the same source compare byte for byte; the lineage left out (it names the source:
    a URL's identity is not its local copy's) — a safetensors header without it, a torch zip up to its record."""
    data = open(path, "rb").read()
    if not data.startswith(b"PK"):
        if not path.name.endswith(".safetensors"):
            return data
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        header["__metadata__"].pop(digests.LINEAGE_KEY)
        return json.dumps(header, separators=(",", ":")).encode() + data[8 + n :]
    entries = zip_directory(str(path)).entries
    entry = next(e for e in entries if e.name.endswith(".data/serialization_id"))
    start = data.index(entry.name.encode()) + len(entry.name)  # (the local header's name; its data follows the extra)
    sid = data[start:].split(b"PK", 1)[0][-entry.file_size:]
    assert zlib.crc32(sid) == entry.crc
    lineage = next(e for e in entries if e.name.endswith(digests.LINEAGE_RECORD))
    data = data[: lineage.header_offset]
    return data.replace(sid, b"0" * len(sid)).replace(struct.pack("<I", entry.crc), b"\0" * 4)


def corrupt_record(path: Path) -> None:
    """Flip one byte inside the first tensor record of a torch zip, leaving the zip's CRC-32 as it was."""
    entry = next(e for e in zip_directory(str(path)).entries if "/data/" in e.name and e.file_size > 1000)
    data = bytearray(path.read_bytes())
    start = data.index(entry.name.encode()) + len(entry.name)
    start += struct.unpack("<H", data[start - len(entry.name) - 2 : start - len(entry.name)])[0]  # the extra field
    data[start + entry.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def describe_refused_within(url: str, match: str, seconds: float) -> None:
    """``ckptfix.describe(url)`` raises the RemoteError ``match`` describes, within ``seconds`` (a deadline or a
    stall cut short, not waited out)."""
    start = time.monotonic()
    with pytest.raises(errors.RemoteError, match=match):
        ckptfix.describe(url)
    assert time.monotonic() - start < seconds


def one_error_line(res: Any, url: str, says: str = "") -> None:
    """A CLI run (click's result) that failed as a URL's failure must: exit 1, nothing on stdout, one stderr line
    naming the URL (then ``says``)."""
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert res.stderr.startswith(f"Error: {url}: {says}") and res.stderr.count("\n") == 1, res.stderr
