"""Lightning's sharded checkpoint directories (DCP files + ``meta.pt``) read as one Lightning checkpoint.

A session fixture runs tests/real_lightning_sharded.py: a real 2-process ``Trainer.fit`` with
``ModelParallelStrategy`` (FSDP2 on a CPU mesh, gloo) whose ``ModelCheckpoint`` writes the sharded
directory; the same checkpoint dict through Lightning's own ``FSDPStrategy.save_checkpoint`` (the
``model`` layout) and Fabric's save function; and the run's full state at that save. The tests then use
ckptfix as a user would (never ``--trust``): ``inspect`` names the layout, ``read`` gives the run's
weights, optimizer and loop state, ``convert --keep-extra`` writes a ``.ckpt`` that a single-process
CPU ``Trainer`` resumes from with all of it restored bit for bit, ``convert`` to a weights file gives
the weights. ``--strip-prefix`` with ``--keep-extra`` on a framework checkpoint is refused.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.formats.dcp.lightning import by_parameter_index
from tests.compare import assert_bit_equal, differences
from tests.dcp_spy import ScratchSpy
from tests.describe_both import PROBE, assert_same
from tests.lightning_run import ShardedRun, sharded_run
from tests.training import RESUMES_WITH, allow_flags

pytestmark = [  # Lightning's own noise: resuming into another directory, and its use of a torch deprecation
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

TESTS = Path(__file__).resolve().parents[1]
STRATEGIES = {"ModelParallelStrategy": "state_dict", "FSDPStrategy": "model"}  # the DCP entry holding the weights
SHARED_FIXTURES = (sharded_run,)  # the fixture, registered by being in this module's namespace


def _child_module() -> Any:
    """tests/real_lightning_sharded.py imported (its LitMLP and loader), without running it."""
    name = "ckptfix_real_lightning_sharded"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / "real_lightning_sharded.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ckptfix(cli_runner: Any, *args: Any, code: int = 0) -> Any:
    res = cli_runner.invoke(cli, [str(a) for a in args])
    assert res.exit_code == code, res.output
    return res


def _param_names() -> list[str]:
    return [name for name, _ in _child_module().LitMLP().named_parameters()]


def assert_optimizer_by_index(got: dict, by_name: dict) -> None:
    """``got`` (index-keyed, as ``Optimizer.state_dict``) holds ``by_name``'s state (keyed by parameter
    name), numbered in the LightningModule's own parameter order (how its Adam was built)."""
    names = _param_names()
    assert sorted(got["state"]) == list(range(len(names)))
    for i, name in enumerate(names):
        assert list(got["state"][i]) == list(by_name["state"][name])
        for k, v in by_name["state"][name].items():
            assert torch.equal(got["state"][i][k], v) and got["state"][i][k].dtype == v.dtype, (name, k)
    [group], [want] = got["param_groups"], by_name["param_groups"]
    assert group["params"] == list(range(len(names))) and want["params"] == names
    assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_inspect_names_one_lightning_checkpoint(strategy: str, sharded_run: ShardedRun, cli_runner: Any) -> None:
    info = json.loads(_ckptfix(cli_runner, "inspect", sharded_run.dirs[strategy], "--json").stdout)
    assert (info["format"], info["framework"], info["state_dict_key"], info["common_prefix"], info["num_tensors"]) == \
        ("dcp", "lightning", "state_dict", "model.", 6)
    assert list(info["extra"]) == [k for k in sharded_run.truth["keys"] if k != "state_dict"]
    assert info["extra"]["optimizer_states"] == "list (1 items)"
    moved = f"'{STRATEGIES[strategy]}' → state_dict ({strategy}); optimizer_0 → optimizer_states"
    assert any(moved in note for note in info["notes"])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_read_gives_the_runs_weights_optimizer_and_meta(strategy: str, sharded_run: ShardedRun) -> None:
    """Entries in dump_checkpoint's order; the weights and Adam state the run held (gathered in full),
    the optimizer keyed by index; every meta.pt entry as Lightning saved it."""
    path, truth = sharded_run.dirs[strategy], sharded_run.truth
    ckpt = ckptfix.read(path)
    assert list(ckpt.raw) == truth["keys"]
    assert_bit_equal(ckpt.state_dict, truth["state_dict"])
    assert_optimizer_by_index(ckpt.extra["optimizer_states"][0], truth["optimizer"])
    meta = torch.load(path / "meta.pt", weights_only=False)  # the run's own file
    assert list(meta) == [k for k in truth["keys"] if k not in ("state_dict", "optimizer_states")]
    assert differences({k: ckpt.extra[k] for k in meta}, meta) == []
    assert (ckpt.extra["epoch"], ckpt.extra["global_step"]) == (truth["epoch"], truth["global_step"]) == (2, 3)


class _Restored:
    """What a resumed Trainer holds when training starts (after Lightning restored the checkpoint)."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        outer = self

        class Capture(Callback):
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                outer.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
                outer.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
                outer.scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
                outer.step, outer.epoch = trainer.global_step, trainer.current_epoch

        self.callback = Capture()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_keep_extra_output_resumes_in_a_single_process_trainer(strategy: str, sharded_run: ShardedRun,
                                                               tmp_path: Path, cli_runner: Any) -> None:
    """``Trainer.fit(ckpt_path=…)`` on CPU, one process, no strategy: the weights, Adam's state, the
    scheduler, step and epoch of the 2-process run come back bit for bit, and training goes on."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    truth, resume = sharded_run.truth, tmp_path / "resume.ckpt"
    _ckptfix(cli_runner, "convert", sharded_run.dirs[strategy], resume, "--keep-extra", "-q")
    assert list(torch.load(resume, weights_only=True)) == truth["keys"]  # plain torch.load, weights_only
    child, restored = _child_module(), _Restored()
    module = child.LitMLP()
    trainer = L.Trainer(max_epochs=child.EPOCHS + 2, accelerator="cpu", devices=1, logger=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints"), restored.callback],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, child.loader(), ckpt_path=resume)
    assert_bit_equal(restored.weights, truth["state_dict"])
    assert_optimizer_by_index(restored.optimizer, truth["optimizer"])
    assert restored.scheduler == truth["lr_schedulers"][0]
    assert (restored.step, restored.epoch) == (truth["global_step"], truth["epoch"] + 1)
    assert (trainer.global_step, trainer.current_epoch) == (truth["global_step"] + 2, child.EPOCHS + 2)
    assert dict(module.hparams) == truth["hyper_parameters"] == {"lr": 1e-2, "arch": "mlp"}
    assert not torch.equal(module.model[0].weight, truth["state_dict"]["model.0.weight"])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(("dst", "strip"), [("model.safetensors", None), ("net.pth", "model.")])
def test_convert_gives_the_weights(strategy: str, dst: str, strip: str | None, sharded_run: ShardedRun,
                                   tmp_path: Path, cli_runner: Any, train: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / dst
    spy = ScratchSpy(monkeypatch, refuse=True)  # meta.pt joins the streamed DCP read: chunks copied, no scratch
    _ckptfix(cli_runner, "convert", sharded_run.dirs[strategy], out, "-q", *(["--strip-prefix", strip] if strip else []))
    assert not spy.made
    monkeypatch.undo()
    if out.suffix == ".safetensors":
        from safetensors.torch import load_file

        got = load_file(out)
    else:
        got = torch.load(out, weights_only=True)
    want = {k.removeprefix(strip or ""): v for k, v in sharded_run.truth["state_dict"].items()}
    assert_bit_equal(got, want, ordered=out.suffix != ".safetensors")  # safetensors orders by dtype, then name
    model = train.mlp()
    assert ckptfix.load_into(model, sharded_run.dirs[strategy]).fix == "strip prefix model."
    assert_bit_equal(model.state_dict(), {k.removeprefix("model."): v for k, v in sharded_run.truth["state_dict"].items()})


def test_fabric_directory_keeps_its_own_entries(sharded_run: ShardedRun, cli_runner: Any) -> None:
    """``fabric.save``'s directory: no Lightning version in meta.pt, so nothing is renamed; meta.pt's
    entries join the DCP ones, and the optimizer stays keyed by name (as fabric.load takes it)."""
    path, truth = sharded_run.dirs["Fabric"], sharded_run.truth
    info = json.loads(_ckptfix(cli_runner, "inspect", path, "--json").stdout)
    assert (info["framework"], info["state_dict_key"], list(info["extra"])) == (None, "model", ["optimizer", "step", "hparams"])
    ckpt = ckptfix.read(path)
    assert_bit_equal(ckpt.state_dict, truth["state_dict"])
    assert differences(_dicts(ckpt.extra["optimizer"]), truth["optimizer"]) == []
    assert (ckpt.extra["step"], ckpt.extra["hparams"]) == (truth["global_step"], truth["hyper_parameters"])


@pytest.mark.parametrize("which", [*STRATEGIES, "Fabric"])
def test_described_without_torch_as_torch_describes_it(which: str, sharded_run: ShardedRun) -> None:
    """``inspect`` of the directory (DCP files and meta.pt) needs no torch, and says what the torch path says."""
    path = sharded_run.dirs[which]
    with pytest.MonkeyPatch.context() as mp:
        assert_same(path, mp, described=True)
    run = subprocess.run([sys.executable, "-c", PROBE, "inspect", str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CKPTFIX_TORCH_FREE": "1"})
    assert run.returncode == 0 and "TORCH=False" in run.stderr, run.stderr


def _dicts(obj: Any) -> Any:
    """OrderedDicts (how DCP's nesting comes back) as plain dicts, all the way down."""
    if isinstance(obj, dict):
        return {k: _dicts(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dicts(v) for v in obj]
    return obj


class _Evil:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.canary}",))


@pytest.fixture
def sharded_copy(sharded_run: ShardedRun, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sharded_run.dirs["ModelParallelStrategy"], tmp_path / "epoch=2-step=3.ckpt"))


def test_meta_pt_is_read_under_the_safe_policy(sharded_copy: Path, tmp_path: Path, cli_runner: Any) -> None:
    canary = tmp_path / "canary"
    torch.save({"epoch": 2, "pytorch-lightning_version": "2.6.6", "callbacks": _Evil(canary)}, sharded_copy / "meta.pt")
    # the call sits beside the state dict: an inert placeholder, named, never imported or called (issue 20)
    for run in (lambda: ckptfix.read(sharded_copy), lambda: ckptfix.inspect(sharded_copy),
                lambda: ckptfix.describe(sharded_copy)):
        ckpt = run()
        assert any("inert posix.system" in n or "inert os.system" in n for n in ckpt.notes), ckpt.notes
    res = _ckptfix(cli_runner, "convert", sharded_copy, tmp_path / "out.ckpt", "--keep-extra", code=1)
    assert "system" in res.output and len(res.output.strip().splitlines()) == 1  # a placeholder is never written
    assert not canary.exists() and not (tmp_path / "out.ckpt").exists()
    report = ckptfix.scan(sharded_copy)  # the directory's scan covers meta.pt too
    assert not report.ok and any(g.startswith("posix.") or g.startswith("os.") for g in report.unsafe_globals)
    assert any(f.where.startswith("meta.pt: ") for f in report.findings) and not canary.exists()


@pytest.mark.parametrize(("meta", "message"), [
    (["not", "a", "dict"], r"meta\.pt: holds a list, not the dict Lightning saves there"),
    ({"pytorch-lightning_version": "2.6.6", "state_dict": {}}, r"meta\.pt: entry 'state_dict' is also in the DCP files"),
    ({"pytorch-lightning_version": "2.6.6", "optimizer_states": []}, r"meta\.pt: has 'optimizer_states', which the DCP"),
    (b"safetensors", r"meta\.pt: is safetensors, not the torch\.save file"),
])
def test_malformed_meta_pt_is_one_format_error(meta: Any, message: str, sharded_copy: Path) -> None:
    if meta == b"safetensors":
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, sharded_copy / "meta.pt")
    else:
        torch.save(meta, sharded_copy / "meta.pt")
    for describe in (ckptfix.inspect, ckptfix.describe):  # the torch path, and the torch-free one
        with pytest.raises(FormatError, match=message):
            describe(sharded_copy)


@pytest.mark.parametrize(("osd", "want"), [
    ({"state": {"b": {"step": 2}, "w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0, "params": ["b"]}]},
     {"state": {0: {"step": 1}, 1: {"step": 2}}, "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0, "params": [1]}]}),
    ({"state": {}, "param_groups": [{"params": ["w", "b"]}]}, {"state": {}, "param_groups": [{"params": [0, 1]}]}),
    ({"state": {1: {"step": 1}}, "param_groups": [{"params": [0, 1]}]},
     {"state": {1: {"step": 1}}, "param_groups": [{"params": [0, 1]}]}),
    ({"state": {"x": {}}, "param_groups": [{"params": ["w"]}]}, "holds state for 'x', which no param_group lists"),
    ({"state": {}, "param_groups": [{"params": ["w", "w"]}]}, "neither parameter names nor indices, each once"),
    ({"state": {}, "param_groups": [{"params": ["w", 1]}]}, "neither parameter names nor indices, each once"),
    ({"param_groups": []}, "is not an optimizer state"),
    ([1, 2], "is not an optimizer state"),
], ids=["two-groups", "no-state-yet", "already-indexed", "unknown-name", "duplicate", "mixed", "no-state", "list"])
def test_by_parameter_index(osd: Any, want: Any) -> None:
    if isinstance(want, str):
        with pytest.raises(FormatError, match=rf"^opt: .*{want}"):
            by_parameter_index(osd, "opt")
    else:
        assert by_parameter_index(osd, "opt") == want


@pytest.fixture
def untracked_dict(tmp_path: Path, fixtures_dir: Path) -> Path:
    """A training dict of no known framework: stripping a prefix with --keep-extra is the user's call."""
    sd = torch.load(fixtures_dir / "mlp_lightning.ckpt", weights_only=True)["state_dict"]
    torch.save({"model": sd, "epoch": 3}, tmp_path / "mine.pth")
    return tmp_path / "mine.pth"


@pytest.fixture
def mmengine_backbone(tmp_path: Path, fixtures_dir: Path) -> Path:
    """The mmengine fixture with its model's attribute (``backbone.``) as the real Runner saves it."""
    dst = tmp_path / "epoch_5.pth"
    ckptfix.convert(fixtures_dir / "mlp_mmengine.pth", dst, add_prefix="backbone.", keep_extra=True,
                    allow=RESUMES_WITH["mmengine"])
    return dst


@pytest.mark.parametrize(("source", "prefix", "refused"), [
    ("mlp_lightning.ckpt", "model.", "lightning"),
    ("mmengine", "backbone.", "mmengine"),
    ("sharded", "model.", "lightning"),
    ("untracked", "model.", None),
])
def test_strip_prefix_with_keep_extra_refused_for_framework_checkpoints(
        source: str, prefix: str, refused: str | None, request: pytest.FixtureRequest, fixtures_dir: Path,
        tmp_path: Path, cli_runner: Any) -> None:
    """The README's old recipe wrote a .ckpt Lightning can't resume (Missing key(s) "model.0.weight"):
    refused with the reason and both ways out; each half alone still works."""
    fixture = {"sharded": "sharded_copy", "untracked": "untracked_dict", "mmengine": "mmengine_backbone"}.get(source)
    src = request.getfixturevalue(fixture) if fixture else fixtures_dir / source
    dst = tmp_path / "out.ckpt"
    res = _ckptfix(cli_runner, "convert", src, dst, "--strip-prefix", prefix, "--keep-extra", code=1 if refused else 0)
    if refused:
        assert res.output.strip().splitlines() == [
            f"Error: {src}: --strip-prefix {prefix} with --keep-extra would write a {refused} checkpoint that can't "
            f"resume: {refused} loads 'state_dict' into the module that saved it, whose keys keep '{prefix}' "
            f"(Missing key(s) in state_dict: \"{prefix}0.weight\" …); drop --strip-prefix for a resumable copy, "
            "or drop --keep-extra for the plain weights"]
        assert not dst.exists()
        allow = allow_flags("mmengine") if refused == "mmengine" else ()  # (objects plain torch.load refuses: named to write)
        _ckptfix(cli_runner, "convert", src, dst, "--keep-extra", "-q", *allow)
        assert list(ckptfix.read(dst).state_dict)[0] == f"{prefix}0.weight"  # (torch.load would import mmengine)
        _ckptfix(cli_runner, "convert", src, tmp_path / "net.pth", "--strip-prefix", prefix, "-q")
    else:
        assert list(torch.load(dst, weights_only=True)["model"])[0] == "0.weight"
