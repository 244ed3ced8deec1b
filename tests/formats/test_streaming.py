"""Streaming conversion: tensor bytes copied file to file, never loaded; bounded memory; valid zips."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptfix

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("src_name, dst_name, streamed", [
    ("mlp_ddp.pth", "o.pth", True),
    ("mlp_ddp.pth", "o.safetensors", True),
    ("mlp_safetensors.safetensors", "o.pth", True),
    ("mlp_safetensors.safetensors", "o.safetensors", True),
    ("mlp_legacy.pth", "o.pth", False),
])
def test_streamed_outputs_are_valid_files(src_name: str, dst_name: str, streamed: bool, tmp_path: Path,
                                          fixtures_dir: Path) -> None:
    report = ckptfix.convert(fixtures_dir / src_name, tmp_path / dst_name)
    assert report.streamed is streamed
    assert report.bytes_written == (tmp_path / dst_name).stat().st_size
    if dst_name.endswith(".pth"):
        with zipfile.ZipFile(tmp_path / dst_name) as z:
            assert z.testzip() is None  # every member's CRC-32 is right
            assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        torch.load(tmp_path / dst_name, weights_only=True, mmap=True)
    else:
        with safe_open(tmp_path / dst_name, "pt") as f:  # the reference reader accepts it
            assert f.metadata()["format"] == "pt"


def test_generic_and_streamed_paths_agree(tmp_path: Path, fixtures_dir: Path) -> None:
    src = fixtures_dir / "mlp_train_ckpt.pth"
    a = ckptfix.convert(src, tmp_path / "a.pth", keep_extra=True)
    b = ckptfix.convert(src, tmp_path / "b.pth", keep_extra=True, map_location=lambda s, loc: s)  # forces a real load
    assert a.streamed and not b.streamed
    oa, ob = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pth", "b.pth"))
    assert list(oa) == list(ob) and oa["epoch"] == ob["epoch"] and oa["loss"] == ob["loss"]
    assert list(oa["model_state_dict"]) == list(ob["model_state_dict"])
    assert oa["model_state_dict"]._metadata == ob["model_state_dict"]._metadata
    for k, v in ob["model_state_dict"].items():
        assert oa["model_state_dict"][k].dtype == v.dtype and torch.equal(oa["model_state_dict"][k], v), k
    sa, sb = oa["optimizer_state_dict"], ob["optimizer_state_dict"]
    assert sa["param_groups"] == sb["param_groups"] and list(sa["state"]) == list(sb["state"])
    for p, state in sb["state"].items():
        assert list(sa["state"][p]) == list(state), p
        assert all(torch.equal(sa["state"][p][k], v) for k, v in state.items()), p


def test_views_shared_storage_and_odd_dtypes_stream_bit_exactly(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    sd = {
        "module.t": base.t(), "module.rows": base[1:3], "module.same": base, "module.alias": base,
        "module.bf16": torch.randn(5, 3).to(torch.bfloat16), "module.bool": torch.tensor([True, False, True]),
        "module.i8": torch.arange(-4, 4, dtype=torch.int8), "module.scalar": torch.tensor(7),
        "module.empty": torch.empty(0, 3),
    }
    src = tmp_path / "odd.pth"
    torch.save(sd, src)
    for dst in ("odd_out.pth", "odd_out.safetensors"):
        report = ckptfix.convert(src, tmp_path / dst)
        assert report.streamed
        back = ckptfix.load(tmp_path / dst)
        assert list(back) == [k[len("module."):] for k in sd]
        for k, v in sd.items():
            got = back[k[len("module."):]]
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    pth = torch.load(tmp_path / "odd_out.pth", weights_only=True)
    assert pth["same"].data_ptr() == pth["alias"].data_ptr()  # sharing kept in pth


def test_many_small_tensors(tmp_path: Path) -> None:
    sd = {f"module.blocks.{i}.weight": torch.full((4,), float(i)) for i in range(3000)}
    torch.save(sd, tmp_path / "many.pth")
    ckptfix.convert(tmp_path / "many.pth", tmp_path / "many.safetensors")
    back = ckptfix.load(tmp_path / "many.safetensors")
    assert list(back) == [k[7:] for k in sd] and all(torch.equal(back[k[7:]], v) for k, v in sd.items())


_PEAK_SCRIPT = """
import sys, threading, time
import torch, ckptfix
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
base = anon(); peak = [base]; stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
ckptfix.convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3] or None)
stop = True; t.join()
print(peak[0] - base)
"""


@pytest.mark.parametrize("dtype", ["", "bf16"])
@pytest.mark.parametrize("dst", ["out.pth", "out.safetensors"])
def test_peak_memory_growth_is_bounded(dst: str, dtype: str, tmp_path: Path) -> None:
    """A 200 MB conversion grows anonymous memory by far less than the file (here: < 25 %),
    a dtype cast included (tensors are cast one at a time as they are written)."""
    src = tmp_path / "big.pth"
    torch.save({f"module.layer{i}.weight": torch.randn(1280, 1024) for i in range(40)}, src)  # 200 MiB
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(src), str(tmp_path / dst), dtype],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth < 0.25 * src.stat().st_size, growth


class _Tty:
    """A stand-in stderr that says it is a terminal and keeps what is written."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty, enabled, drawn", [(True, True, True), (False, True, False), (True, False, False)])
def test_progress_line_only_on_a_terminal_and_not_quiet(tty: bool, enabled: bool, drawn: bool, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfix.core import progress

    stream = _Tty(tty)
    src = tmp_path / "p.pth"
    torch.save({f"module.l{i}": torch.zeros(256, 256) for i in range(8)}, src)
    clock = iter(range(0, 10_000, 2))  # every reading 2 s later: past the 1-second threshold at once
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(clock)))
    ckpt = ckptfix.read(src, map_location="meta")
    with progress.Progress(8 * 256 * 256 * 4, 8, enabled=enabled, stream=stream):
        ckptfix.formats.write(ckpt.state_dict, str(tmp_path / "o.pth"), "torch-zip", refs=ckpt.refs)
    if drawn:
        assert "8/8 tensors" in stream.text and "2.0 MiB / 2.0 MiB (100%)" in stream.text and stream.text.endswith("\n")
    else:
        assert stream.text == ""


@pytest.mark.parametrize("dst, kwargs", [
    ("o.safetensors", {"dtype": "fp16", "compact_ties": True}),  # half the bytes are written
    ("t.safetensors", {}),  # the tied tensor stored under its own key too: 256 KiB more written
    ("o.pth", {"dtype": "bf16"}),  # cast tensors the zip writer adds itself
    ("shards", {"max_shard_size": "300KB"}),
    ("shards", {"max_shard_size": "300KB", "format": "pth", "dtype": "fp16"}),
    ("o.pth", {}),  # a tied tensor is written once
    ("legacy", {}),  # a legacy source: loaded, written from memory
])
def test_progress_line_ends_at_100_percent(dst: str, kwargs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           cli_runner) -> None:
    from ckptfix.core import progress
    from ckptfix.cli import cli

    sd = {f"module.l{i}": torch.zeros(256, 256) for i in range(8)}
    sd["module.tied"] = sd["module.l0"]
    src = tmp_path / "p.pth"
    torch.save(sd, src, _use_new_zipfile_serialization=dst != "legacy")
    stream = _Tty(True)
    clock = iter(range(0, 10_000, 2))
    monkeypatch.setattr(progress.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(progress.sys, "stderr", stream)
    report = ckptfix.convert(src, tmp_path / ("o.pth" if dst == "legacy" else dst), progress=True, **kwargs)
    half = kwargs.get("dtype") in ("fp16", "bf16")
    untied = (256 << 10) if dst in ("t.safetensors", "shards") and kwargs.get("format") != "pth" else 0
    assert (report.nbytes_in, report.nbytes) == (2 << 20, ((1 << 20) if half else (2 << 20)) + untied)  # bytes written
    size = "1.0 MiB" if half else "2.2 MiB" if untied else "2.0 MiB"
    assert stream.text.rsplit("\r", 1)[-1].startswith(f"  {size} / {size} (100%)  9/9 tensors"), stream.text
    assert stream.text.endswith("\n")
    assert stream.text.count("%)") >= 8 if dst != "legacy" else True  # counted tensor by tensor, casts included
    if "dtype" in kwargs and dst == "o.safetensors":
        res = cli_runner.invoke(cli, ["convert", str(src), str(tmp_path / "c.safetensors"), "--dtype", "fp16", "-q",
                                      "--compact-ties"])
        assert res.exit_code == 0 and "9 tensors, 1.0 MiB (cast from 2.0 MiB)" in res.output


@pytest.mark.parametrize("dst", ["cast.pth", "cast.safetensors"])
def test_streamed_cast_is_exactly_to_dtype(dst: str, tmp_path: Path) -> None:
    base = torch.randn(6, 10, dtype=torch.float64)
    sd = {"module.t": base.t(), "module.rows": base[1:3], "module.same": base, "module.alias": base,
          "module.n": torch.tensor(5), "module.f32": torch.randn(4)}
    torch.save(sd, tmp_path / "src.pth")
    report = ckptfix.convert(tmp_path / "src.pth", tmp_path / dst, dtype="bf16")
    storages = 3 if dst.endswith(".pth") else 4  # (safetensors stores the alias under its own name: its own storage)
    assert report.streamed and report.dtype_cast == {"float64->bfloat16": storages, "float32->bfloat16": 1}
    back = ckptfix.load(tmp_path / dst)
    for k, v in sd.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert back[k[7:]].dtype == want.dtype and torch.equal(back[k[7:]], want), k
    if dst.endswith(".pth"):
        out = torch.load(tmp_path / dst, weights_only=True)
        assert out["same"].data_ptr() == out["alias"].data_ptr()  # tied stays tied after the cast
        with zipfile.ZipFile(tmp_path / dst) as z:
            assert z.testzip() is None


def test_streamed_fp16_overflow_leaves_nothing(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(3), "b": torch.tensor([1.0, 1e9])}, tmp_path / "src.pth")
    with pytest.raises(ckptfix.errors.ConversionError, match="overflow to inf in 'b'"):
        ckptfix.convert(tmp_path / "src.pth", tmp_path / "o.safetensors", dtype="fp16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pth"]
    report = ckptfix.convert(tmp_path / "src.pth", tmp_path / "o.safetensors", dtype="fp16", allow_overflow=True)
    assert report.streamed and any("1 value(s) became inf in b" in n for n in report.notes)
