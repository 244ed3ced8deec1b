"""`ckptfix scan`: the opcode walker, the classes of globals, the zip structure checks, exit codes 0/3/1."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.parse import pickle_walk
from ckptfix.cli import cli
from ckptfix.errors import FormatError, UnsafeCheckpointError
from tests import adversarial



@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, adversarial.Case]:
    return {c.name: c for c in adversarial.build_corpus(tmp_path_factory.mktemp("corpus"))}


@pytest.mark.parametrize("name", adversarial.case_names())
def test_corpus_findings(name: str, corpus: dict[str, adversarial.Case]) -> None:
    case = corpus[name]
    with adversarial.audit_events() as events:
        report = ckptfix.scan(case.path)
    assert not report.ok
    assert set(case.unsafe) <= set(report.unsafe_globals)
    assert set(case.kinds) <= {f.kind for f in report.findings}
    assert all(f.message for f in report.findings)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is False and {g["class"] for g in d["globals"]} <= {"safe", "allowed", "unsafe"}
    assert events == []  # the scanner resolved no global (no find_class) and ran nothing


def test_scan_names_the_call_through_the_memo(corpus: dict[str, adversarial.Case]) -> None:
    report = ckptfix.scan(corpus["stack-global-memo-overwrite"].path)
    by_name = {g.name: g for g in report.globals}
    assert by_name["posix.system"].ops == ["STACK_GLOBAL", "REDUCE"] and by_name["posix.system"].category == "unsafe"
    # the decoy that slot 0 held first is resolved too, and is harmless
    assert by_name["collections.OrderedDict"].category == "safe"


@pytest.mark.parametrize("name", ["mlp_single.pth", "mlp_ddp.pth", "mlp_train_ckpt.pth", "mlp_legacy.pth",
                                  "mlp_amp.pth", "mlp_cuda1.pth", "mlp_safetensors.safetensors"])
def test_real_checkpoints_are_clean(name: str, fixtures_dir: Path, cli_runner) -> None:
    report = ckptfix.scan(fixtures_dir / name)
    assert report.ok and report.findings == []
    assert all(g.category == "safe" for g in report.globals)
    if not name.endswith(".safetensors"):
        assert "torch._utils._rebuild_tensor_v2" in {g.name for g in report.globals}
    res = cli_runner.invoke(cli, ["scan", str(fixtures_dir / name)])
    assert res.exit_code == 0 and "clean" in res.stdout


@pytest.mark.parametrize("dst", ["out.pth", "out.safetensors"])
@pytest.mark.parametrize("src", ["mlp_ddp.pth", "mlp_legacy.pth"])
def test_ckptfix_output_is_clean(src: str, dst: str, fixtures_dir: Path, tmp_path: Path) -> None:
    ckptfix.convert(fixtures_dir / src, tmp_path / dst)
    assert ckptfix.scan(tmp_path / dst).ok


def test_zip_written_by_zipfile_is_clean(tmp_path: Path) -> None:
    """Control for the structure cases: the same members re-zipped (also with zip64 headers) pass."""
    members = adversarial.benign_zip_members()
    adversarial.write_zip(tmp_path / "a.pt", members)
    with zipfile.ZipFile(tmp_path / "b.pt", "w") as z:
        for name, data in members:
            with z.open(name, "w", force_zip64=True) as f:
                f.write(data)
    for p in (tmp_path / "a.pt", tmp_path / "b.pt"):
        assert ckptfix.scan(p).ok
        assert torch.equal(ckptfix.load(p)["w"], torch.arange(4.0))


def test_allowed_globals_are_classed_allowed(tmp_path: Path) -> None:
    import argparse
    import datetime
    import pathlib

    import numpy as np

    torch.save({"model": {"w": torch.ones(1)}, "args": argparse.Namespace(lr=0.1), "step": np.int64(3),
                "when": datetime.datetime(2024, 1, 1), "dir": pathlib.PosixPath("/runs/1"),
                "version": torch.__version__}, tmp_path / "ckpt.pt")
    report = ckptfix.scan(tmp_path / "ckpt.pt")
    classes = {g.name: g.category for g in report.globals}
    assert report.ok
    for name in ("argparse.Namespace", "numpy._core.multiarray.scalar", "numpy.dtype", "datetime.datetime",
                 "pathlib.PosixPath", "torch.torch_version.TorchVersion"):
        assert classes[name] == "allowed", name
    assert classes["torch._utils._rebuild_tensor_v2"] == "safe" and classes["_codecs.encode"] == "safe"


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save deprecation
def test_torchscript_is_flagged(tmp_path: Path, cli_runner) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), path)
    res = cli_runner.invoke(cli, ["scan", str(path), "--json"])
    assert res.exit_code == 3
    report = json.loads(res.stdout)
    assert report["format"] == "torchscript"
    assert "torchscript-code" in {f["kind"] for f in report["findings"]}
    assert "compressed" not in {f["kind"] for f in report["findings"]}  # its code/ members are deflated by design
    assert any(g.startswith("__torch__.") for g in report["unsafe_globals"])


def test_plain_pickle_and_tar_legacy(tmp_path: Path) -> None:
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": [1, 2]}, protocol=4))
    report = ckptfix.scan(tmp_path / "plain.pkl")
    assert report.format == "pickle" and report.ok
    payload = pickle.dumps({"w": adversarial.Reduce(print, "x")}, protocol=2)
    tar_path = tmp_path / "old.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("sys_info", pickle.dumps({}, protocol=2)), ("pickle", payload),
                           ("storages", pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2)),
                           ("tensors", pickle.dumps(0, protocol=2))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    report = ckptfix.scan(tar_path)
    assert report.format == "torch-legacy" and "builtins.print" in report.unsafe_globals
    assert "tar-format" in {f.kind for f in report.findings}
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.load(tar_path)


@pytest.mark.parametrize("damage", ["missing", "empty", "random", "truncated-zip", "truncated-legacy",
                                    "legacy-storage-cut"])
def test_unreadable_is_exit_1(damage: str, tmp_path: Path, fixtures_dir: Path, cli_runner) -> None:
    path = tmp_path / "bad.pt"
    legacy = (fixtures_dir / "mlp_legacy.pth").read_bytes()
    if damage != "missing":
        path.write_bytes({
            "empty": b"",
            "random": bytes(range(7, 250)) * 20,
            "truncated-zip": (fixtures_dir / "mlp_single.pth").read_bytes()[:900],
            "truncated-legacy": legacy[:300],
            "legacy-storage-cut": legacy[:-100],
        }[damage])
    with pytest.raises(FormatError):
        ckptfix.scan(path)
    res = cli_runner.invoke(cli, ["scan", str(path)])
    assert res.exit_code == 1 and res.stderr.startswith(f"Error: {path}") and res.stderr.count("\n") == 1


def test_scan_subprocess(corpus: dict[str, adversarial.Case]) -> None:
    bad = corpus["stack-global-memo"].path
    res = subprocess.run([sys.executable, "-m", "ckptfix", "scan", str(bad), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 3, res.stderr
    assert json.loads(res.stdout)["unsafe_globals"] == ["posix.system"]
    assert not corpus["stack-global-memo"].canary.exists()


# -- the walker itself -------------------------------------------------------------------------------

def test_walker_keeps_what_came_before_a_break() -> None:
    data = adversarial.proto(2) + adversarial.call(adversarial.glob("posix", "system"), adversarial.u("x")) + b"\xff"
    walk = pickle_walk.walk(data)
    assert walk.error and walk.end is None
    assert [u.full for u in walk.uses] == ["posix.system", "posix.system"]


def test_walker_computed_stack_global_name_is_a_problem() -> None:
    # STACK_GLOBAL whose module name is the result of a call: no constant to name
    data = (adversarial.proto(4) + adversarial.call(adversarial.glob("builtins", "str"), adversarial.u("os"))
            + adversarial.u("system") + b"\x93.")
    walk = pickle_walk.walk(data)
    assert any("not a constant string" in p for p in walk.problems)


def test_walker_never_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "scan_trap_mod.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    walk = pickle_walk.walk(adversarial.as_weight(adversarial.call(adversarial.glob("scan_trap_mod", "f"))))
    assert walk.error is None and "scan_trap_mod" not in sys.modules
    assert [u.full for u in walk.uses] == ["scan_trap_mod.f", "scan_trap_mod.f"]


def test_sharded_checkpoint_scans_every_shard(tmp_path: Path, fixtures_dir: Path, cli_runner) -> None:
    out = tmp_path / "sharded"
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", out, max_shard_size="2KB", format="pth")
    shards = sorted(out.glob("pytorch_model-*.bin"))
    assert len(shards) >= 2 and ckptfix.scan(out).ok
    case = next(c for c in adversarial.build_corpus(tmp_path / "corpus") if c.name == "stack-global-memo")
    shards[-1].write_bytes(case.path.read_bytes())
    res = cli_runner.invoke(cli, ["scan", str(out), "--json"])
    assert res.exit_code == 3
    report = json.loads(res.stdout)
    assert report["unsafe_globals"] == ["posix.system"]
    assert all(f["where"].startswith(shards[-1].name) for f in report["findings"])
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        ckptfix.load(out)
    assert not case.canary.exists()
