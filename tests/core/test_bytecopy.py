"""core/bytecopy's copy engine and its outputs: a copy between offsets that sit alike in the page cache's folios goes
through copy_file_range, any other through a mapping of the source, both byte for byte; an :class:`Output` starts
its write-back behind the writes (never beyond them) and, asked by ``hashing``, hashes the bytes its writer declared
final as they land — a write below that mark voids the hash, so the caller hashes the finished file instead; a convert
that wants its output's SHA-256 (``--hash``, ``--json``'s checksums, ``--sign``) gets the file's, made behind the
copy wherever the header is final before it (a torch zip's whole records), from a local or a remote source."""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import ckptfix
from ckptfix.core import bytecopy, libc, outputs, positional
from ckptfix.ops.convert import steps
from tests import concurrent_writer
from tests.file_server import FileServer
from tests.remote_servers import http_server

SERVERS = (http_server,)  # the fixture, registered by being in this module's namespace
STEP, FOLIO = bytecopy._STEP, bytecopy._FOLIO


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "src.bin"
    path.write_bytes(os.urandom(3 * STEP + 12345))
    return path


@pytest.mark.parametrize("src_offset, dst_offset, size, way", [
    (0, 0, 2 * STEP, "kernel"),  # folio-aligned alike: copy_file_range
    (4096, 4096 + FOLIO, 2 * STEP + 7, "kernel"),
    (100, 8 + 250, 2 * STEP + 5, "mapped"),  # a safetensors data section's offsets
    (4096, 0, STEP, "mapped"),
    (70000, 123, STEP - 1, "kernel"),  # under a step: not worth a mapping
])
def test_each_way_copies_byte_for_byte(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       src_offset: int, dst_offset: int, size: int, way: str) -> None:
    used: list[str] = []
    mapped = bytecopy._mapped_copy
    monkeypatch.setattr(bytecopy, "_mapped_copy", lambda *a: (used.append("mapped"), mapped(*a))[1])
    data = source.read_bytes()
    out = tmp_path / "out"
    with open(source, "rb") as src, open(out, "wb") as dst:
        bytecopy.copy_range(src.fileno(), dst.fileno(), src_offset, dst_offset, size)
    assert (used == ["mapped"]) == (way == "mapped")
    assert out.read_bytes() == b"\0" * dst_offset + data[src_offset : src_offset + size]


@pytest.mark.parametrize("dst_offset", [0, 100])  # copy_file_range's short copy, and the mapped one's refusal
def test_a_source_shorter_than_its_range_is_an_error(source: Path, tmp_path: Path, dst_offset: int) -> None:
    size = source.stat().st_size
    with open(source, "rb") as src, open(tmp_path / "out", "wb") as dst:
        with pytest.raises(OSError, match="source ended early"):
            bytecopy.copy_range(src.fileno(), dst.fileno(), STEP, dst_offset, size - STEP + 1)


def test_write_back_starts_behind_the_writes_and_never_beyond(source: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(outputs, "_BEHIND", 2 * STEP)
    monkeypatch.setattr(libc, "start_writeback", lambda fd, offset, n: started.append((offset, n)))
    header = 300
    with open(source, "rb") as src, open(tmp_path / "out", "wb") as dst, outputs.Output(dst.fileno(), str(dst.name)):
        pos = header
        for _ in range(4):  # a zip's records: a header's bytes between copies stay in the window
            bytecopy.copy_range(src.fileno(), dst.fileno(), 0, pos, STEP + 1)
            pos += STEP + 1 + 64
    assert started and started[0][0] == header
    for (a, n), (b, _m) in zip(started, started[1:]):
        assert a + n == b  # one window after another
    assert all(n >= 2 * STEP for _a, n in started) and started[-1][0] + started[-1][1] <= pos


def test_a_write_below_the_mark_voids_the_hash(tmp_path: Path) -> None:
    path = tmp_path / "out"
    with outputs.hashing(str(path)) as hashed:
        with open(path, "wb") as f, outputs.Output(f.fileno(), str(path)) as out:
            bytecopy.write_all(f.fileno(), memoryview(b"a" * 5000), 0)
            out.final(5000)
            bytecopy.write_all(f.fileno(), memoryview(b"b" * 10), 5000)  # at the mark: hashed as it lands
        assert hashed.hasher is not None
        assert hashed.hasher.result() == hashlib.sha256(path.read_bytes()).hexdigest()
    with outputs.hashing(str(path)) as hashed:
        with open(path, "r+b") as f, outputs.Output(f.fileno(), str(path)) as out:
            out.final(5010)
            bytecopy.write_all(f.fileno(), memoryview(b"c"), 10)  # a patch of hashed bytes
        assert hashed.hasher is None


def _saved(tmp_path: Path, view: bool) -> Path:
    """A torch zip with tensors over a step (the mapped copy) and under it; ``view``: one tensor a slice of another's
    storage (its digest is computed in the copy, so a safetensors header is final only after it)."""
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(3 * STEP // 4 + 3, generator=g), "small": torch.randn(7, 5, generator=g),
          "ids": torch.arange(40_000, dtype=torch.int64)}
    if view:
        sd["part"] = sd["big"][5:]
    path = tmp_path / ("view.pth" if view else "plain.pth")
    torch.save(sd, path)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("view", [False, True])
def test_a_converts_sha256_is_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str,
                                        view: bool) -> None:
    src = _saved(tmp_path, view)
    after: list[str] = []
    real = steps.signing.hash_in_background
    monkeypatch.setattr(steps.signing, "hash_in_background", lambda p: (after.append(p), real(p))[1])
    marks: list[tuple[int, int]] = []  # (bytes declared final as the writer went, the file's size) at its end
    done = outputs.Output.__exit__
    monkeypatch.setattr(outputs.Output, "__exit__", lambda o, *e: (marks.append((o.mark, os.fstat(o.fd).st_size)),
                                                                   done(o, *e))[1])
    report = ckptfix.convert(src, tmp_path / f"out{suffix}", checksums=True)
    out = Path(report.dst)
    assert report.to_dict()["sha256_out"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert after == []  # hashed by the writer's Output, not in a pass of its own after it
    (mark, size), = marks
    # behind the copy: every byte but the zip's central directory was final as it landed; a safetensors header
    # whose view's digest comes from the copy is patched after it: the hash then starts once the file is written
    if suffix == ".pth":
        assert size - 1000 < mark < size
    else:
        assert mark == (0 if view else size)
    plain = (torch.load(out, weights_only=True) if suffix == ".pth" else
             __import__("safetensors.torch", fromlist=["load_file"]).load_file(out))
    for key, t in torch.load(src, weights_only=True).items():
        assert torch.equal(plain[key], t)


@pytest.mark.parametrize("name", ["out.safetensors", "out.pth"])
def test_a_remote_converts_sha256_is_its_files(http_server: FileServer, tmp_path: Path, name: str) -> None:
    """Copies from a URL land when the write's queued copies run: no byte is hashed before it is there."""
    src = _saved(http_server.root, view=False)
    report = ckptfix.convert(http_server.url(src.name), tmp_path / name, checksums=True)
    assert report.to_dict()["sha256_out"] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()


@pytest.mark.parametrize("cuts", [[], [1], [5, 5, 2**18 + 3], [2**18 * k + k for k in range(1, 11)]])
def test_crc32_notes_chain_every_cut_in_one_pass_of_reads(source: Path, cuts: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cut's note is the CRC-32 of the bytes from the start to it, read in windows smaller than the run (cuts
    inside a window, on a window's edge, repeated)."""
    monkeypatch.setattr(positional, "_CRC_READ", 2**18)
    data = source.read_bytes()
    start, end = 7, 2**18 * 11 + 11
    with open(source, "rb") as f:
        notes = positional.crc32_notes(f.fileno(), start, end, [start + c for c in cuts])
    assert notes == {c: zlib.crc32(data[start:c]) for c in [start, end, *(start + c for c in cuts)]}


def test_a_crc32_pass_over_a_file_truncated_under_it_is_an_oserror(source: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass reads (a mapping would be SIGBUS here: this test's process killed): short, it says so."""
    path = tmp_path / "cut.bin"
    path.write_bytes(source.read_bytes())
    real = positional.crc32

    def crc32(data: memoryview, crc: int = 0) -> int:
        os.truncate(path, 2**20)
        return real(data, crc)

    monkeypatch.setattr(positional, "crc32", crc32)
    monkeypatch.setattr(positional, "_CRC_READ", 2**18)
    with open(path, "rb") as f, pytest.raises(positional.SourceShort, match="short read while computing CRC-32"):
        positional.crc32_range(f.fileno(), 0, 3 * STEP)


@pytest.mark.parametrize("leased", [False, True])
@pytest.mark.parametrize("src_fmt, dst_fmt, where", [
    ("pth", "safetensors", "crc"), ("pth", "pth", "crc"), ("safetensors", "pth", "crc"),
    ("pth", "safetensors", "copy"), ("pth", "pth", "copy"), ("safetensors", "pth", "copy"),
])
def test_a_source_truncated_mid_convert(tmp_path: Path, src_fmt: str, dst_fmt: str, where: str, leased: bool) -> None:
    """Another writer truncates the source while a torch-free convert copies it (in the CRC-32 pass on its thread,
    or in the copy itself). Leased (the convert holds a read lease on its source): the writer waits, the output is
    the file as it was, bit for bit, and the cut lands after. Without a lease: exit 1 naming the source and what
    happened, not SIGBUS and not a destination error; no output and no temp file left. In a child process: a
    SIGBUS would kill it, not the test run."""
    if leased and not concurrent_writer.leases_work(tmp_path):
        pytest.skip(f"{tmp_path}: no read leases here")
    sd = {f"w{i}": torch.randn(2**20 // 4 + i) for i in range(12)}  # ~12 MiB, tensors over a copy step each
    src = tmp_path / f"src.{src_fmt}"
    torch.save(sd, src) if src_fmt == "pth" else st.save_file(sd, src)
    size = os.path.getsize(src)
    dst = tmp_path / "out" / f"dst.{dst_fmt}"
    dst.parent.mkdir()
    out = concurrent_writer.run(src, ["convert", str(src), str(dst)], where, leased)
    assert "signal" not in out and out["cut"], out
    assert out["size_after"] == size // 4, out
    if leased:
        assert out["code"] == 0 and out["waited"] and out["waiting_at_end"], out
        got = st.load_file(dst) if dst_fmt == "safetensors" else torch.load(dst, weights_only=True)
        assert got.keys() == sd.keys() and all(torch.equal(got[k], v) for k, v in sd.items())
        return
    assert out["code"] == 1, out
    assert f"{src}: ends at byte " in out["stderr"], out["stderr"]
    assert "truncated or rewrote it while it was converted; nothing was written" in out["stderr"]
    assert os.listdir(dst.parent) == []
