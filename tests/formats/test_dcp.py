"""torch.distributed.checkpoint directories: consolidation, safe metadata, writing for torch's loader.

The fsdp2 fixture is a real 2-process gloo run of ``fully_shard`` saving with ``dcp.save`` (every
rank its shards), with the full state dict gathered in the same run beside it (fixtures/train.py).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import ckptfix
from ckptfix.statedict import locate
from ckptfix.core.devices import DevicePlan
from ckptfix.errors import FormatError, UnsafeCheckpointError
from ckptfix.formats.dcp import directory as dcp
from ckptfix.formats import DCP, read as formats_read
from ckptfix.parse.checkpoint_dirs import is_dcp_dir
from tests.compare import assert_close_to_recorded
from tests.page_cache import mapped_from


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def torch_load_dcp(state_dict: dict, path: Path) -> None:
    """torch's own loader, single process, filling ``state_dict`` in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tdcp.load(state_dict, checkpoint_id=str(path), no_dist=True)


@pytest.fixture
def fsdp2_copy(fixtures_dir: Path, tmp_path: Path) -> Path:
    """A scratch copy of the fsdp2 fixture directory, to break."""
    return Path(shutil.copytree(fixtures_dir / "mlp_fsdp2", tmp_path / "ckpt"))


def test_fsdp2_consolidates_to_the_gathered_full_state_dict(fixtures_dir: Path, manifest: dict, train: Any) -> None:
    raw = formats_read(str(fixtures_dir / "mlp_fsdp2"), DCP, DevicePlan("cpu"), trust=False)
    assert raw.format == "dcp"
    sel = locate.find_state_dict(raw.obj)
    assert sel.key == "model" and list(sel.extra) == ["optim"]
    full = torch.load(fixtures_dir / "mlp_fsdp2_full.pth", weights_only=True)
    assert_same(sel.state_dict, full)
    model = train.mlp()
    model.load_state_dict(sel.state_dict)
    model.eval()
    with torch.no_grad():
        assert_close_to_recorded(model(train.fixed_input("mlp")), manifest["mlp_fsdp2"]["output"])
    optim = sel.extra["optim"]  # nested again from DCP's planner data, dotted FQN keys intact
    assert list(optim["state"]) == list(full) and optim["state"]["0.weight"]["exp_avg"].shape == (16, 13)
    assert optim["param_groups"][0]["params"] == list(full) and optim["param_groups"][0]["lr"] == 1e-2


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_consolidation_keeps_tensor_data_out_of_anonymous_memory(fixtures_dir: Path, tmp_path: Path) -> None:
    """Sharded tensors land in a deleted scratch file's shared mapping; whole ones stay in their .distcp."""
    raw = formats_read(str(fixtures_dir / "mlp_fsdp2"), DCP, DevicePlan("cpu"), trust=False)
    for t in raw.obj["model"].values():
        assert mapped_from(t).endswith(".scratch (deleted)")
    dcp.write(raw.obj["model"], str(tmp_path / "whole"))
    back = formats_read(str(tmp_path / "whole"), DCP, DevicePlan("cpu"), trust=False)
    for t in back.obj.values():
        assert mapped_from(t) == str(tmp_path / "whole" / "__0_0.distcp")


def test_structure_read_touches_no_tensor_data(fsdp2_copy: Path) -> None:
    """Zero every tensor chunk record (plain values stay): a meta read can't notice, a real read can."""
    with open(fsdp2_copy / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own fixture: trusted here
    for index, info in meta.storage_data.items():
        if index.offset is not None:
            with open(fsdp2_copy / info.relative_path, "r+b") as f:
                f.seek(info.offset)
                f.write(bytes(info.length))
    raw = formats_read(str(fsdp2_copy), DCP, DevicePlan("meta"), trust=False)
    assert all(t.device.type == "meta" for t in raw.obj["model"].values())
    assert raw.obj["model"]["2.weight"].shape == (32, 16) and raw.obj["optim"]["param_groups"][0]["lr"] == 1e-2
    with pytest.raises(FormatError, match=r"__\d_0\.distcp: '[\w.]+' is not a torch.save record"):
        formats_read(str(fsdp2_copy), DCP, DevicePlan("cpu"), trust=False)


@pytest.mark.parametrize("key", [None, "model"])
def test_write_round_trips_through_torch_dcp_load(fixtures_dir: Path, tmp_path: Path, key: str | None) -> None:
    sd = torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)
    dcp.write(sd, str(tmp_path / "out"), key=key)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".metadata", "__0_0.distcp", "ckptfix.json"]
    fresh = OrderedDict((k, torch.zeros_like(v)) for k, v in sd.items())
    torch_load_dcp({key: fresh} if key else fresh, tmp_path / "out")
    assert_same(fresh, sd)
    back = formats_read(str(tmp_path / "out"), DCP, DevicePlan("cpu"), trust=False).obj
    assert_same(back[key] if key else back, sd)


def test_write_round_trips_a_nested_training_checkpoint(fixtures_dir: Path, tmp_path: Path) -> None:
    """The consolidated fsdp2 checkpoint (model + optimizer, tensors and plain values) written back."""
    obj = formats_read(str(fixtures_dir / "mlp_fsdp2"), DCP, DevicePlan("cpu"), trust=False).obj
    dcp.write(obj, str(tmp_path / "out"))
    back = formats_read(str(tmp_path / "out"), DCP, DevicePlan("cpu"), trust=False).obj
    assert_same(back["model"], obj["model"])
    for p, state in obj["optim"]["state"].items():
        assert_same(back["optim"]["state"][p], state)
    assert back["optim"]["param_groups"] == obj["optim"]["param_groups"]


def test_key_order_follows_the_saved_state_dict_not_the_rank_order(fsdp2_copy: Path, fixtures_dir: Path) -> None:
    """DCP's metadata lists entries rank by rank (a deduplicated buffer saved by rank 1 comes after
    every parameter); the planner data keeps the state dict's order, and consolidation follows it."""
    def rank_order(meta: Any) -> None:
        items = list(meta.state_dict_metadata.items())
        meta.state_dict_metadata = dict(items[1:] + items[:1])  # model.0.weight listed last

    _rewrite_metadata(fsdp2_copy, rank_order)
    model = formats_read(str(fsdp2_copy), DCP, DevicePlan("meta"), trust=False).obj["model"]
    assert list(model) == list(torch.load(fixtures_dir / "mlp_fsdp2_full.pth", weights_only=True))


class _Evil:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.canary}",))


def test_malicious_metadata_is_refused_and_nothing_runs(fsdp2_copy: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    (fsdp2_copy / ".metadata").write_bytes(pickle.dumps(_Evil(canary), protocol=4))
    for plan in ("cpu", "meta"):
        with pytest.raises(UnsafeCheckpointError, match=r"system.*--trust") as e:
            formats_read(str(fsdp2_copy), DCP, DevicePlan(plan), trust=False)
        assert e.value.globals == [f"{os.system.__module__}.system"]
    assert not canary.exists()


def test_malicious_non_tensor_entry_is_refused(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tdcp.save({"w": torch.ones(3), "hook": _Evil(canary)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    for verb in (ckptfix.read, ckptfix.load, ckptfix.inspect):  # (read as an inert placeholder: refused in the state dict)
        with pytest.raises(UnsafeCheckpointError, match=r"posix.system; .*the selected state dict holds them \(at 'hook'\)"):
            verb(tmp_path / "ckpt")
    assert not canary.exists()


def _rewrite_metadata(path: Path, fn: Any) -> None:
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own fixture: trusted here
    fn(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _escape(meta: Any) -> None:
    for info in meta.storage_data.values():
        info.relative_path = "../" + info.relative_path


def _drop_chunk(meta: Any) -> None:
    del meta.storage_data[next(k for k in meta.storage_data if k.fqn == "model.2.weight" and list(k.offset) == [16, 0])]


def _shrink(meta: Any) -> None:
    meta.state_dict_metadata["model.2.weight"].size = torch.Size([20, 16])


@pytest.mark.parametrize(("breaker", "message"), [
    (lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage"), "corrupt or truncated"),
    (lambda p: (p / ".metadata").write_bytes(pickle.dumps({"a": 1})), "not torch.distributed.checkpoint Metadata"),
    (lambda p: (p / ".metadata").unlink(), "can't be read"),
    (lambda p: _rewrite_metadata(p, _escape), "leaves the directory"),
    (lambda p: _rewrite_metadata(p, _drop_chunk), r"'model.2.weight' chunk at offset \[16, 0\] is in the metadata but no"),
    (lambda p: _rewrite_metadata(p, _shrink), "falls outside its size"),
    (lambda p: (p / "__1_0.distcp").unlink(), "__1_0.distcp' is missing"),
], ids=["garbage", "not-metadata", "no-metadata", "path-escape", "missing-chunk", "bad-geometry", "missing-file"])
def test_broken_checkpoints_are_format_errors(fsdp2_copy: Path, breaker: Any, message: str) -> None:
    shutil.copy(fsdp2_copy / "__1_0.distcp", fsdp2_copy.parent / "__1_0.distcp")  # a target for ../
    shutil.copy(fsdp2_copy / "__0_0.distcp", fsdp2_copy.parent / "__0_0.distcp")
    breaker(fsdp2_copy)
    with pytest.raises(FormatError, match=message):
        formats_read(str(fsdp2_copy), DCP, DevicePlan("cpu"), trust=False)


def test_is_dcp_dir(fixtures_dir: Path, tmp_path: Path) -> None:
    assert is_dcp_dir(str(fixtures_dir / "mlp_fsdp2"))
    assert not is_dcp_dir(str(fixtures_dir / "mlp_fsdp2" / ".metadata"))
    assert not is_dcp_dir(str(tmp_path))


@pytest.mark.slow
def test_fresh_fsdp2_run_consolidates_bit_exactly(train: Any, tmp_path: Path) -> None:
    """fixtures/train.py's fsdp2 mode end to end: 2 gloo processes, fully_shard, dcp.save, gather."""
    manifest = train.generate(tmp_path, model="mlp", modes=["fsdp2"])
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    raw = formats_read(str(tmp_path / "mlp_fsdp2"), DCP, DevicePlan("cpu"), trust=False)
    assert_same(raw.obj["model"], torch.load(tmp_path / "mlp_fsdp2_full.pth", weights_only=True))
    entry = manifest["fixtures"]["mlp_fsdp2"]
    assert entry["format"] == "dcp" and entry["state_dict_key"] == "model" and entry["num_tensors"] == 6


# --- Ctrl-C and write failures inside torch.distributed.checkpoint.save: one line, not its traceback ---

@pytest.mark.parametrize("error, code, line", [
    (KeyboardInterrupt(), 130, "Error: interrupted; nothing was written"),
    (OSError(28, "No space left on device"), 1, r"Error: .*dcp_out: write failed: No space left on device; nothing was written"),
    (RuntimeError("a bug\nand its detail"), 1, r"Error: torch.distributed.checkpoint.save failed: RuntimeError: a bug"),
], ids=["ctrl-c", "disk-full", "other"])
def test_failures_inside_dcp_save_are_one_line(error: BaseException, code: int, line: str, tmp_path: Path,
                                               fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, cli_runner) -> None:
    """DCP catches BaseException on every rank and raises a CheckpointException (a BaseException whose
    message is the rank's traceback); ckptfix gives back what failed inside it."""
    import re

    from ckptfix.cli import cli

    real_save = torch.save

    def first_record_then_fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)  # a record is on disk in the temp directory
        raise error

    monkeypatch.setattr(torch, "save", first_record_then_fail)  # filesystem.py's _write_item calls torch.save
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(tmp_path / "dcp_out"), "--format", "dcp"])
    assert res.exit_code == code and res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and re.fullmatch(line, res.stderr.strip()), res.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_during_a_real_dcp_write(tmp_path: Path) -> None:
    """No monkeypatching: SIGINT while DCP writes a 256 MiB state dict. The interrupt lands inside
    torch.save, whose zip writer turns it into a RuntimeError on its way out, which DCP wraps."""
    import signal
    import subprocess
    import sys
    import time

    src, out = tmp_path / "big.pth", tmp_path / "out"
    out.mkdir()
    torch.save({f"w{i}": torch.zeros(2**22) for i in range(16)}, src)  # 16 × 16 MiB
    proc = subprocess.Popen([sys.executable, "-m", "ckptfix", "convert", str(src), str(out / "dcp"), "--format", "dcp", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not any(
            p.stat().st_size > 2**24 for p in out.glob(".dcp.ckptfix-tmp-*/__0_0.distcp")):
        time.sleep(0.0005)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"the write finished before the signal: {stderr[-2000:]}"
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == "Error: interrupted; nothing was written"
    assert stderr.count("\n") <= 3 and stdout == "" and list(out.iterdir()) == []  # (a Python warning may come first)
