"""Checkpoints written by the real Lightning, timm and mmengine, through ckptfix.

Session fixtures train train.py's MLP for a few CPU steps with each library's own trainer and
checkpoint code (Lightning ``Trainer.fit`` + ``ModelCheckpoint``; timm ``CheckpointSaver`` with a
``ModelEmaV3``, and timm's own ``test_resnet`` for BatchNorm's integer buffers; mmengine ``Runner`` +
``CheckpointHook``), seeded as train.py's ``_train``. The tests then use ckptfix as a user would,
never with ``--trust``: ``inspect`` names the layout; ``convert``/``select`` give the tensors the
library's own model holds, bit for bit; ``load_into`` reproduces its forward output; what
``convert --keep-extra`` wrote resumes in the library itself exactly as the original does. Each real
file is also compared with its imitation, fixtures/layouts.py run in this session, entry by entry:
same keys in the same order, same types, same values bit for bit (the same seeded run on the same
machine gives the same weights), except the entries listed as run-specific (paths, timestamps,
timings). The committed imitations (fixtures/mlp_{lightning,timm,mmengine}…, trained on another
machine) are that same output: same structure, values within the recorded-value tolerance.

Lightning and timm are in the ``dev`` extra and run in this process. mmengine's Runner runs in a
child process (tests/real_mmengine.py), so this process never imports mmengine (the Runner changes
global state, and fixtures/layouts.py fakes mmengine's module only where it isn't imported); its
tests skip, with the child's reason, only where mmengine or OpenCV can't be imported.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.cli import cli
from tests.compare import assert_bit_equal, close_to_recorded, differences
from tests.lightning_run import lit_class
from tests.training import RESUMES_WITH, allow_flags

pytestmark = [  # Lightning's own noise: resuming into another directory, and its use of a torch deprecation
    pytest.mark.filterwarnings("ignore:The dirpath has changed from"),
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

TESTS = Path(__file__).resolve().parent
EMA_DECAY = 0.9  # fixtures/layouts.py's: timm's default would leave the EMA at its first copy after 5 steps
SKIP_RC = 77  # real_mmengine.py: mmengine's Runner can't be imported here


def _read_plain(path: Path) -> dict[str, torch.Tensor]:
    """A converted weights file, read without ckptfix."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


IMITATED = {"lightning": "mlp_lightning.ckpt", "timm": "mlp_timm.pth.tar", "mmengine": "mlp_mmengine.pth"}


@pytest.fixture(scope="session")
def imitations(tmp_path_factory: pytest.TempPathFactory, train: Any) -> Path:
    """fixtures/layouts.py's Lightning, timm and mmengine files, made on this machine in this session
    (the committed ones were trained on another: their floats differ in the last bits)."""
    out = tmp_path_factory.mktemp("imitations")
    train.generate(out, "mlp", list(IMITATED))
    return out


@pytest.mark.parametrize("mode", list(IMITATED))
def test_committed_imitation_is_the_generators_output(mode: str, imitations: Path, fixtures_dir: Path,
                                                      manifest: dict, train: Any) -> None:
    """The committed file is what layouts.py writes today: same entries, types and integers; floats
    within the recorded-value tolerance (recorded on another machine). Its manifest entry too."""
    layouts, name = train._layouts(), IMITATED[mode]
    here, committed = (layouts.load(d / name, mode)[0] for d in (imitations, fixtures_dir))
    assert differences(here, committed, recorded=True) == []
    entry = json.loads((imitations / "manifest.json").read_text())["fixtures"][name]
    recorded = manifest[name]
    outputs, run_specific = {"output", "ema_output"}, {"output", "ema_output", "sha256"}
    assert {k: v for k, v in entry.items() if k not in run_specific} == \
        {k: v for k, v in recorded.items() if k not in run_specific}
    for field in sorted(outputs & set(entry)):
        assert close_to_recorded(torch.tensor(entry[field]), torch.tensor(recorded[field])), field


def _ckptfix(cli_runner: Any, *args: Any) -> Any:
    res = cli_runner.invoke(cli, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def _inspect(cli_runner: Any, path: Path) -> dict[str, Any]:
    return json.loads(_ckptfix(cli_runner, "inspect", path, "--json").stdout)


def _assert_scan_clean(path: Path) -> set[str]:
    """Every global the file names is torch's own or on ckptfix's allow-list; returns them."""
    report = ckptfix.scan(path)
    assert report.ok and report.unsafe_globals == [], report.to_dict()
    return {g.name for g in report.globals}


# --------------------------------------------------------------------------------------- Lightning


def _lightning_fit(module: Any, root: Path, train: Any, max_epochs: int, ckpt_path: Path | None = None) -> Any:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    x, y = train._batches("mlp")[0]  # one full batch per epoch: train.py's 5 steps
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    checkpoint = ModelCheckpoint(dirpath=root / "checkpoints")
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, callbacks=[checkpoint], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, Path(checkpoint.best_model_path)


@dataclass
class LightningRun:
    path: Path  # ModelCheckpoint's file after epoch 5
    module: Any  # the trained LightningModule


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory: pytest.TempPathFactory, train: Any) -> LightningRun:
    root = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(train.MODEL_SEED)  # as train.py's _train, before the model is built
    module = lit_class()(lr=1e-2, arch="mlp")
    trainer, path = _lightning_fit(module, root, train, max_epochs=5)
    assert trainer.global_step == 5 and path.name == "epoch=4-step=5.ckpt"
    return LightningRun(path, module)


def test_lightning_inspect_names_framework_and_prefix(lightning_run: LightningRun, cli_runner: Any) -> None:
    info = _inspect(cli_runner, lightning_run.path)
    assert (info["framework"], info["common_prefix"], info["state_dict_key"], info["num_tensors"]) == \
        ("lightning", "model.", "state_dict", 6)
    text = _ckptfix(cli_runner, "inspect", lightning_run.path).stdout
    assert "lightning checkpoint; every key starts with 'model.' (--strip-prefix model.)" in text
    assert _assert_scan_clean(lightning_run.path) == {"collections.OrderedDict", "torch.FloatStorage",
                                                      "torch._utils._rebuild_tensor_v2"}


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_lightning_convert_strip_prefix_gives_the_modules_weights(fmt: str, lightning_run: LightningRun,
                                                                   tmp_path: Path, cli_runner: Any) -> None:
    dst = tmp_path / f"mlp.{fmt}"
    _ckptfix(cli_runner, "convert", lightning_run.path, dst, "--strip-prefix", "model.", "-q")
    assert_bit_equal(_read_plain(dst), lightning_run.module.model.state_dict())
    assert_bit_equal(ckptfix.load(lightning_run.path, strip_prefix="model."), lightning_run.module.model.state_dict())


def test_lightning_load_into_reproduces_the_trained_output(lightning_run: LightningRun, train: Any) -> None:
    model = train.mlp()
    report = ckptfix.load_into(model, lightning_run.path)
    assert report.fix == "strip prefix model." and report.missing == report.unexpected == []
    x = train.fixed_input("mlp")
    assert torch.equal(_forward(model, x), _forward(lightning_run.module.model, x))


def test_lightning_resumes_from_keep_extra_output(lightning_run: LightningRun, tmp_path: Path, train: Any,
                                                  cli_runner: Any) -> None:
    """``trainer.fit(ckpt_path=…)`` on the converted file continues exactly as on Lightning's own:
    loops, optimizer, scheduler and hyper-parameters all came through."""
    converted = tmp_path / "resume.ckpt"
    _ckptfix(cli_runner, "convert", lightning_run.path, converted, "--keep-extra", "-q")
    finals = []
    for i, src in enumerate([lightning_run.path, converted]):
        module = lit_class()()
        trainer, _ = _lightning_fit(module, tmp_path / f"run{i}", train, max_epochs=7, ckpt_path=src)
        assert trainer.global_step == 7 and trainer.current_epoch == 7
        finals.append(module.model.state_dict())
    assert_bit_equal(finals[1], finals[0])
    assert not torch.equal(finals[0]["0.weight"], lightning_run.module.model.state_dict()["0.weight"])
    restored = lit_class().load_from_checkpoint(converted)
    assert dict(restored.hparams) == {"lr": 1e-2, "arch": "mlp"}
    assert_bit_equal(restored.model.state_dict(), lightning_run.module.model.state_dict())


def test_lightning_file_matches_our_imitation(lightning_run: LightningRun, imitations: Path) -> None:
    """mlp_lightning.ckpt (layouts.py) is what Lightning writes for the same run, but for the
    checkpoint directory it names."""
    real = torch.load(lightning_run.path, weights_only=False)  # this test's own file
    ours = torch.load(imitations / "mlp_lightning.ckpt", weights_only=False)
    callback = next(iter(real["callbacks"]))
    assert differences(real, ours) == [f"/callbacks/{callback}/best_model_path", f"/callbacks/{callback}/dirpath"]


# -------------------------------------------------------------------------------------------- timm


@dataclass
class TimmRun:
    path: Path  # CheckpointSaver's last.pth.tar
    dir: Path
    model: nn.Module
    ema: nn.Module  # timm's ModelEmaV3
    args: argparse.Namespace


def _timm_train(model: nn.Module, out: Path, args: argparse.Namespace, batches: list, loss_fn: Any) -> TimmRun:
    """timm's train.py in small: one optimizer step per epoch, the EMA updated after each step, the
    saver called at each epoch's end with the loss as the (decreasing) metric."""
    from timm.utils import CheckpointSaver, ModelEmaV3

    ema = ModelEmaV3(model, decay=args.model_ema_decay)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    saver = CheckpointSaver(model, opt, args=args, model_ema=ema, checkpoint_dir=str(out), recovery_dir=str(out),
                            decreasing=True)
    model.train()
    for epoch, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        ema.update(model, step=epoch + 1)
        saver.save_checkpoint(epoch, metric=loss.item())
    return TimmRun(out / "last.pth.tar", out, model, ema, args)


@pytest.fixture(scope="session")
def timm_run(tmp_path_factory: pytest.TempPathFactory, train: Any, fixtures_dir: Path) -> TimmRun:
    """The MLP, as layouts.py's timm writer trains it, with the same args."""
    args = torch.load(fixtures_dir / "mlp_timm.pth.tar", weights_only=False)["args"]  # the fixture's Namespace
    assert args.model == "mlp" and args.model_ema_decay == EMA_DECAY
    torch.manual_seed(train.MODEL_SEED)
    return _timm_train(train.mlp(), tmp_path_factory.mktemp("timm"), args, train._batches("mlp"), nn.MSELoss())


@pytest.fixture(scope="session")
def timm_resnet_run(tmp_path_factory: pytest.TempPathFactory) -> TimmRun:
    """timm's own ``test_resnet`` (BatchNorm: int64 ``num_batches_tracked``), 3 epochs on 32x32 images."""
    import timm

    args = argparse.Namespace(model="test_resnet", num_classes=10, lr=1e-2, model_ema=True, model_ema_decay=EMA_DECAY)
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=args.num_classes)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))
    return _timm_train(model, tmp_path_factory.mktemp("timm_resnet"), args, [batch] * 3, nn.CrossEntropyLoss())


def test_timm_inspect_names_framework_and_ema(timm_run: TimmRun, cli_runner: Any) -> None:
    info = _inspect(cli_runner, timm_run.path)
    assert (info["framework"], info["common_prefix"], info["state_dict_key"], info["ema_keys"]) == \
        ("timm", None, "state_dict", ["state_dict_ema"])
    assert _assert_scan_clean(timm_run.path) == {"argparse.Namespace", "collections.OrderedDict", "torch.FloatStorage",
                                                 "torch._utils._rebuild_tensor_v2"}


@pytest.mark.parametrize("run", ["timm_run", "timm_resnet_run"])
def test_timm_select_auto_and_ema_give_the_saved_models(run: str, request: pytest.FixtureRequest, tmp_path: Path,
                                                        cli_runner: Any) -> None:
    """auto takes ``state_dict`` (the trained model), never the EMA; ``--select state_dict_ema`` the
    ModelEmaV3's module; integer buffers included, bit for bit."""
    r: TimmRun = request.getfixturevalue(run)
    model_sd, ema_sd = r.model.state_dict(), r.ema.module.state_dict()
    assert not torch.equal(model_sd[next(iter(model_sd))], ema_sd[next(iter(ema_sd))])
    assert_bit_equal(ckptfix.load(r.path), model_sd)
    assert_bit_equal(ckptfix.load(r.path, select="state_dict_ema"), ema_sd)
    for select, want in [("auto", model_sd), ("state_dict_ema", ema_sd)]:
        dst = tmp_path / f"{select}.safetensors"
        _ckptfix(cli_runner, "convert", r.path, dst, "--select", select, "-q")
        assert_bit_equal(_read_plain(dst), want, ordered=False)  # safetensors orders by dtype, then name


def test_timm_load_into_reproduces_model_and_ema_outputs(timm_run: TimmRun, timm_resnet_run: TimmRun,
                                                         train: Any) -> None:
    import timm

    cases = [(timm_run, train.mlp, train.fixed_input("mlp")),
             (timm_resnet_run, functools.partial(timm.create_model, "test_resnet", num_classes=10),
              torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))]
    for r, build, x in cases:
        for select, source in [("auto", r.model), ("state_dict_ema", r.ema.module)]:
            model = build()
            report = ckptfix.load_into(model, r.path, select=select)
            assert report.missing == report.unexpected == []
            assert torch.equal(_forward(model, x), _forward(source, x)), (r.args.model, select)


def test_timm_loads_ckptfix_safetensors_itself(timm_resnet_run: TimmRun, tmp_path: Path, cli_runner: Any) -> None:
    """timm's own ``load_checkpoint`` (strict) takes the EMA weights ckptfix extracted."""
    import timm
    from timm.models import load_checkpoint

    dst = tmp_path / "ema.safetensors"
    _ckptfix(cli_runner, "convert", timm_resnet_run.path, dst, "--select", "state_dict_ema", "-q")
    model = timm.create_model("test_resnet", num_classes=10)
    load_checkpoint(model, str(dst), strict=True)
    assert_bit_equal(model.state_dict(), timm_resnet_run.ema.module.state_dict())


def _timm_resume(path: Path, run: TimmRun, train: Any) -> tuple[int | None, dict, dict, Any]:
    """timm's resume (``resume_checkpoint``: weights_only, model + optimizer + epoch; the EMA through
    ``load_checkpoint(use_ema=True)``; the saver's history through its mmap'd metadata read), then one
    more epoch; returns (resume epoch, model and EMA state dicts, saver)."""
    from timm.models import load_checkpoint, resume_checkpoint
    from timm.utils import CheckpointSaver, ModelEmaV3

    model = train.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=run.args.lr)
    epoch = resume_checkpoint(model, str(path), optimizer=opt, log_info=False)
    ema = ModelEmaV3(model, decay=run.args.model_ema_decay)
    load_checkpoint(ema.module, str(path), use_ema=True, strict=True)
    saver = CheckpointSaver(model, opt, args=run.args, model_ema=ema, checkpoint_dir=str(run.dir), decreasing=True)
    assert saver.load_state_dict_from_checkpoint(str(path))
    x, y = train._batches("mlp")[0]
    model.train()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    ema.update(model, step=(epoch or 0) + 1)
    return epoch, model.state_dict(), ema.module.state_dict(), saver


def test_timm_resumes_from_keep_extra_output(timm_run: TimmRun, tmp_path: Path, train: Any, cli_runner: Any) -> None:
    converted = tmp_path / "resume.pth.tar"
    # (timm's args Namespace beside the weights: timm resumes with weights_only=False, so it is allowed by name)
    _ckptfix(cli_runner, "convert", timm_run.path, converted, "--keep-extra", *allow_flags("timm"), "-q")
    (e0, model0, ema0, saver0), (e1, model1, ema1, saver1) = (_timm_resume(p, timm_run, train)
                                                              for p in (timm_run.path, converted))
    assert e0 == e1 == 5  # epoch 4 saved with version 2: resume at the next epoch
    assert_bit_equal(model1, model0)
    assert_bit_equal(ema1, ema0)
    assert not torch.equal(model0["0.weight"], timm_run.model.state_dict()["0.weight"])
    assert (saver1.checkpoint_files, saver1.best_epoch, saver1.best_metric) == \
        (saver0.checkpoint_files, saver0.best_epoch, saver0.best_metric)
    assert len(saver0.checkpoint_files) == 5 and saver0.best_epoch == 4


def test_timm_file_matches_our_imitation(timm_run: TimmRun, imitations: Path) -> None:
    """mlp_timm.pth.tar (layouts.py) is what CheckpointSaver writes for the same run: every
    entry, the EMA and the saver's history included."""
    real = torch.load(timm_run.path, weights_only=False)  # this test's own file
    ours = torch.load(imitations / "mlp_timm.pth.tar", weights_only=False)
    assert differences(real, ours) == []


# ----------------------------------------------------------------------------------------- mmengine


@dataclass
class MMEngineRun:
    path: Path  # CheckpointHook's epoch_5.pth
    state: dict[str, Any]  # what the Runner held after training (real_mmengine.py's _state)
    work: Path


def _mmengine_child(tmp: Path, *args: Any) -> Any:
    """Run real_mmengine.py in a fresh interpreter (cwd: a temporary directory, so mmengine finds no
    git repository to add to its version string); returns what it wrote."""
    out = tmp / "child_out.pt"
    res = subprocess.run([sys.executable, str(TESTS / "real_mmengine.py"), args[0], str(out), *map(str, args[1:])],
                         cwd=tmp, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if res.returncode == SKIP_RC:
        pytest.skip(res.stderr.strip().splitlines()[-1])
    assert res.returncode == 0, res.stderr[-4000:]
    return torch.load(out, weights_only=False)  # this test's own child's output


@pytest.fixture(scope="session")
def mmengine_run(tmp_path_factory: pytest.TempPathFactory) -> MMEngineRun:
    tmp = tmp_path_factory.mktemp("mmengine")
    state = _mmengine_child(tmp, "train", tmp / "work")
    assert state["epoch"] == 5 and Path(state["last_checkpoint"]).name == "epoch_5.pth"
    return MMEngineRun(Path(state["last_checkpoint"]), state, tmp)


def _without(prefix: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    assert all(k.startswith(prefix) for k in sd)
    return {k.removeprefix(prefix): v for k, v in sd.items()}


def test_mmengine_inspect_and_load_without_trust_or_mmengine(mmengine_run: MMEngineRun, cli_runner: Any) -> None:
    info = _inspect(cli_runner, mmengine_run.path)
    assert (info["framework"], info["common_prefix"], info["state_dict_key"], info["num_tensors"]) == \
        ("mmengine", "backbone.", "state_dict", 6)
    assert _assert_scan_clean(mmengine_run.path) == {
        "_codecs.encode", "builtins.getattr", "collections.Counter", "collections.OrderedDict",
        "mmengine.logging.history_buffer.HistoryBuffer", "numpy._core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar", "numpy.dtype", "numpy.ndarray", "torch.FloatStorage",
        "torch._utils._rebuild_tensor_v2"}
    ckpt = ckptfix.read(mmengine_run.path)
    assert not any(m == "mmengine" or m.startswith("mmengine.") for m in sys.modules)
    assert_bit_equal(ckpt.state_dict, mmengine_run.state["state_dict"])
    hub = ckpt.extra["message_hub"]
    assert list(hub["log_scalars"]) == ["train/lr", "train/data_time", "train/loss", "train/time"]
    assert hub["log_scalars"]["train/loss"].data[0].tolist() == mmengine_run.state["train/loss"]
    assert isinstance(hub["runtime_info"]["eta"], np.float64)


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_mmengine_convert_and_load_into(fmt: str, mmengine_run: MMEngineRun, tmp_path: Path, train: Any,
                                        cli_runner: Any) -> None:
    dst = tmp_path / f"mlp.{fmt}"
    _ckptfix(cli_runner, "convert", mmengine_run.path, dst, "--strip-prefix", "backbone.", "-q")
    assert_bit_equal(_read_plain(dst), _without("backbone.", mmengine_run.state["state_dict"]))
    model = train.mlp()
    report = ckptfix.load_into(model, mmengine_run.path)
    assert report.fix == "strip prefix backbone."
    assert _forward(model, train.fixed_input("mlp")).tolist() == mmengine_run.state["output"]


def test_mmengine_resumes_from_keep_extra_output(mmengine_run: MMEngineRun, tmp_path: Path, cli_runner: Any) -> None:
    """``Runner(load_from=…, resume=True)`` on both of ckptfix's writers' output (the streamed copy, and
    torch.save of what ckptfix loaded: its HistoryBuffer stand-ins written back under mmengine's name)
    continues exactly as on mmengine's own file: weights, optimizer, epoch and the logged history."""
    streamed, loaded = tmp_path / "streamed.pth", tmp_path / "loaded.pth"
    _ckptfix(cli_runner, "convert", mmengine_run.path, streamed, "--keep-extra", "-q", *allow_flags("mmengine"))
    report = ckptfix.convert(mmengine_run.path, loaded, keep_extra=True, map_location=lambda s, loc: s,
                             allow=RESUMES_WITH["mmengine"])
    assert not report.streamed  # a map_location callable makes convert load the tensors and torch.save them
    original, *converted = _mmengine_child(tmp_path, "resume", tmp_path / "work", mmengine_run.path, streamed, loaded)
    assert original["epoch"] == 6 and len(original["train/loss"]) == 6
    assert original["train/loss"][:5] == mmengine_run.state["train/loss"]
    assert not torch.equal(original["state_dict"]["backbone.0.weight"], mmengine_run.state["state_dict"]["backbone.0.weight"])
    for state in converted:
        assert differences(state, original) == ["/last_checkpoint"]


def test_mmengine_file_matches_our_imitation(mmengine_run: MMEngineRun, imitations: Path, train: Any) -> None:
    """mlp_mmengine.pth (layouts.py) is what the Runner writes for the same run, but for the
    run's own config text, name, time, timings and path, and the model's attribute (``backbone.``)."""
    layouts = train._layouts()
    real = layouts.load(mmengine_run.path, "mmengine")[0]  # both through the generator's own mmengine stand-in
    ours = layouts.load(imitations / "mlp_mmengine.pth", "mmengine")[0]
    real["state_dict"] = type(real["state_dict"])(_without("backbone.", real["state_dict"]))
    hub = "/message_hub"
    assert differences(real, ours) == [
        "/meta/cfg", "/meta/experiment_name", "/meta/time",
        f"{hub}/log_scalars/train/data_time@/_log_history", f"{hub}/log_scalars/train/time@/_log_history",
        f"{hub}/runtime_info/cfg", f"{hub}/runtime_info/experiment_name", f"{hub}/runtime_info/last_ckpt"]
