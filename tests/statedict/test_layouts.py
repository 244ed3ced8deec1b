"""Training-framework checkpoints (fixtures/layouts.py) through every transform.

Lightning ``.ckpt`` (the network under ``model.``), timm (``state_dict`` + the EMA variant
``state_dict_ema``, ``args`` as an ``argparse.Namespace``), mmengine (``message_hub`` of
``HistoryBuffer`` objects with numpy arrays) and TorchScript archives, beside the PyTorch-tutorial
``train_ckpt``. Expected tensors come from the generator's own loader (plain torch.load /
torch.jit.load), never from ckptfix; outputs are compared with the manifest's (recorded on another
machine) within the recorded-value tolerance.
"""

from __future__ import annotations

import argparse
import json
import pickletools
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import ConversionError, UnsafeCheckpointError
from tests import adversarial
from tests.compare import assert_close_to_recorded, golden_from_manifest, recorded_tolerance
from tests.training import RESUMES_WITH, train_steps


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/load deprecation

HISTORY_BUFFER = "mmengine.logging.history_buffer.HistoryBuffer"


@dataclass(frozen=True)
class Layout:
    """One fixture as a conversion source: how to select its weights and what they should be."""

    file: str
    mode: str
    select: str = "auto"
    trust: bool = False
    strip: str | None = None  # the framework's attribute prefix, stripped with --strip-prefix
    #: what the framework's resume allows beside the weights that torch.load(weights_only=True) refuses: --allow'd
    #: for --keep-extra (without them the write is refused: the test of that is in tests/ops/test_plain_loadable.py)
    resumes_with: tuple[str, ...] = ()

    @property
    def key(self) -> str | None:
        """Where the selected weights sit in the file (None: the file is the state dict)."""
        return {"train_ckpt": "model_state_dict", "torchscript": None}.get(self.mode, self.state_dict_key)

    @property
    def state_dict_key(self) -> str:
        return "state_dict" if self.select == "auto" else self.select

    @property
    def output_field(self) -> str:
        return "ema_output" if self.select == "state_dict_ema" else "output"


LAYOUTS = {
    "lightning": Layout("mlp_lightning.ckpt", "lightning", strip="model."),
    "timm": Layout("mlp_timm.pth.tar", "timm", resumes_with=RESUMES_WITH["timm"]),
    "timm_ema": Layout("mlp_timm.pth.tar", "timm", select="state_dict_ema", resumes_with=RESUMES_WITH["timm"]),
    "mmengine": Layout("mlp_mmengine.pth", "mmengine", resumes_with=RESUMES_WITH["mmengine"]),
    "torchscript": Layout("mlp_torchscript.pt", "torchscript", trust=True),
    "train_ckpt": Layout("mlp_train_ckpt.pth", "train_ckpt"),
}
NAMES = list(LAYOUTS)


def _load_raw(train: Any, path: Path, mode: str) -> Any:
    """The whole file as the generator reads its own fixtures (TorchScript: the module)."""
    if mode == "train_ckpt":
        return torch.load(path, weights_only=True)
    return train._layouts().load(path, mode)[0]


def _read_back(train: Any, path: Path) -> Any:
    """A converted torch file, read without ckptfix (full unpickling of the test's own output, with
    mmengine's module name importable as the generator has it)."""
    return _load_raw(train, path, "mmengine")


def _expected(train: Any, fixtures_dir: Path, layout: Layout, strip: bool = True) -> dict[str, torch.Tensor]:
    """The layout's weights in single form, the framework prefix stripped (unless ``strip`` is False)."""
    raw = _load_raw(train, fixtures_dir / layout.file, layout.mode)
    sd = raw.state_dict() if layout.mode == "torchscript" else raw[layout.key]
    return {k.removeprefix(layout.strip or "") if strip else k: v for k, v in sd.items()}


def _output(train: Any, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    model = train.mlp()
    model.load_state_dict(sd, strict=True)
    model.eval()
    with torch.no_grad():
        return model(train.fixed_input("mlp"))


def _read_output(path: Path) -> dict[str, torch.Tensor]:
    """A converted file read without ckptfix."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def _convert(fixtures_dir: Path, layout: Layout, dst: Path, **kw: Any) -> Any:
    strip = None if kw.get("keep_extra") else layout.strip  # a resumable checkpoint keeps the framework prefix
    allow = layout.resumes_with if kw.get("keep_extra") else ()
    return ckptfix.convert(fixtures_dir / layout.file, dst, select=layout.select, trust=layout.trust,
                           strip_prefix=strip, allow=allow, **kw)


@pytest.mark.parametrize("to, fmt", [("single", "pth"), ("single", "safetensors"), ("ddp", "pth")])
@pytest.mark.parametrize("name", NAMES)
def test_convert_is_bit_exact(name: str, to: str, fmt: str, tmp_path: Path, fixtures_dir: Path, manifest: dict,
                              train: Any) -> None:
    layout = LAYOUTS[name]
    expected = _expected(train, fixtures_dir, layout)
    report = _convert(fixtures_dir, layout, tmp_path / f"out.{fmt}", to=to)
    assert report.state_dict_key == layout.key
    out = _read_output(tmp_path / f"out.{fmt}")
    prefix = "module." if to == "ddp" else ""
    assert list(out) == [prefix + k for k in expected]
    single = {k.removeprefix(prefix): v for k, v in out.items()}
    for k, v in expected.items():
        assert single[k].dtype == v.dtype and torch.equal(single[k], v), k
    assert_close_to_recorded(_output(train, single), manifest[layout.file][layout.output_field])


@pytest.mark.parametrize("dtype, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("name", NAMES)
def test_dtype_casts_the_weights_only(name: str, dtype: str, torch_dtype: torch.dtype, tmp_path: Path,
                                      fixtures_dir: Path, train: Any) -> None:
    """Each float becomes exactly ``t.to(dtype)``; with --keep-extra the optimizer state stays fp32."""
    layout = LAYOUTS[name]
    expected = _expected(train, fixtures_dir, layout, strip=False)
    dst = tmp_path / "half.pth"
    report = _convert(fixtures_dir, layout, dst, dtype=dtype, keep_extra=True)
    assert report.dtype_cast == {f"float32->{str(torch_dtype)[6:]}": len(expected)}
    out = _read_back(train, dst)
    sd = out if layout.key is None else out[layout.key]
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert sd[k].dtype == torch_dtype and torch.equal(sd[k], v.to(torch_dtype)), k
    optimizer = {"lightning": "optimizer_states", "timm": "optimizer", "mmengine": "optimizer",
                 "train_ckpt": "optimizer_state_dict"}.get(layout.mode)
    if optimizer is not None:
        state = out[optimizer][0] if layout.mode == "lightning" else out[optimizer]
        assert {t.dtype for s in state["state"].values() for t in s.values()} == {torch.float32}


@pytest.fixture(scope="session")
def resnet18_layouts(tmp_path_factory: pytest.TempPathFactory, train: Any) -> Path:
    """resnet18 (BatchNorm: int64 num_batches_tracked) in the Lightning and timm layouts."""
    out = tmp_path_factory.mktemp("resnet18_layouts")
    train.generate(out, "resnet18", ["lightning", "timm"])
    return out


@pytest.mark.parametrize("file, select", [("resnet18_lightning.ckpt", "auto"), ("resnet18_timm.pth.tar", "auto"),
                                          ("resnet18_timm.pth.tar", "state_dict_ema")])
def test_dtype_keeps_integer_buffers(file: str, select: str, resnet18_layouts: Path, tmp_path: Path) -> None:
    src = resnet18_layouts / file
    raw = torch.load(src, weights_only=False)  # the generator's own file
    sd = raw["state_dict" if select == "auto" else select]
    ints = [k for k, v in sd.items() if not v.is_floating_point()]
    assert len(ints) == 20 and all(k.endswith("num_batches_tracked") for k in ints)
    report = ckptfix.convert(src, tmp_path / "out.safetensors", dtype="fp16", select=select)
    out = _read_output(tmp_path / "out.safetensors")
    assert report.dtype_cast == {"float32->float16": len(sd) - 20}
    for k, v in sd.items():
        want = v if k in ints else v.half()
        assert out[k].dtype == want.dtype and torch.equal(out[k], want), k


@pytest.mark.parametrize("name", NAMES)
def test_rename_on_the_single_form(name: str, tmp_path: Path, fixtures_dir: Path, train: Any) -> None:
    layout = LAYOUTS[name]
    expected = _expected(train, fixtures_dir, layout)
    report = _convert(fixtures_dir, layout, tmp_path / "r.pth", rename=[r"(\d)\.(weight|bias)=fc\1.\2"])
    out = torch.load(tmp_path / "r.pth", weights_only=True)
    assert list(out) == [f"fc{k}" for k in expected] and report.renamed == len(expected)
    assert all(torch.equal(out[f"fc{k}"], v) for k, v in expected.items())


class Renamed(nn.Module):
    """The MLP's layers under other names, in the same order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(13, 16), nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


@pytest.mark.parametrize("name", NAMES)
def test_by_order_maps_names_and_refuses_shapes(name: str, tmp_path: Path, fixtures_dir: Path, manifest: dict,
                                                train: Any) -> None:
    layout = LAYOUTS[name]
    _convert(fixtures_dir, layout, tmp_path / "o.pth", by_order=Renamed())
    model = Renamed()
    model.load_state_dict(torch.load(tmp_path / "o.pth", weights_only=True), strict=True)
    model.eval()
    with torch.no_grad():
        assert_close_to_recorded(model(train.fixed_input("mlp")), manifest[layout.file][layout.output_field])
    wrong = nn.Sequential(nn.Linear(13, 32), nn.Linear(32, 16), nn.Linear(16, 1))
    with pytest.raises(ConversionError, match=r"tensor #0 '0.weight' has shape \[16, 13\]"):
        _convert(fixtures_dir, layout, tmp_path / "bad.pth", by_order=wrong)
    assert not (tmp_path / "bad.pth").exists()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Deep equality over what training checkpoints hold: tensors and arrays bit-exact, types equal."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(getattr(a, "__dict__", None), dict) and not callable(a):
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b or a is b, where


@pytest.mark.parametrize("to", ["single", "ddp"])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "torchscript"])
def test_keep_extra_round_trip(name: str, to: str, tmp_path: Path, fixtures_dir: Path, train: Any) -> None:
    """Everything beside the weights comes back as it was (read without ckptfix), under the same
    class names: mmengine's HistoryBuffer resolves to mmengine's class, not ckptfix's."""
    layout = LAYOUTS[name]
    dst = tmp_path / "resume.pth"
    report = _convert(fixtures_dir, layout, dst, keep_extra=True, to=to)
    src, out = _read_back(train, fixtures_dir / layout.file), _read_back(train, dst)
    assert report.kept_extra == [k for k in src if k != layout.key] and list(out) == list(src)
    for key in src:
        if key != layout.key:
            assert_same(out[key], src[key], key)
    prefix = "module." if to == "ddp" else ""
    expected = _expected(train, fixtures_dir, layout, strip=False)
    assert list(out[layout.key]) == [prefix + k for k in expected]
    assert all(torch.equal(out[layout.key][prefix + k], v) for k, v in expected.items())


def test_torchscript_keep_extra_has_nothing_to_keep(tmp_path: Path, fixtures_dir: Path) -> None:
    report = ckptfix.convert(fixtures_dir / "mlp_torchscript.pt", tmp_path / "o.pth", keep_extra=True, trust=True)
    assert report.kept_extra == [] and report.state_dict_key is None
    assert list(torch.load(tmp_path / "o.pth", weights_only=True)) == ["0.weight", "0.bias", "2.weight", "2.bias",
                                                                        "4.weight", "4.bias"]


@pytest.mark.parametrize("name, framework, prefix, key, ema", [
    ("lightning", "lightning", "model.", "state_dict", []),
    ("timm", "timm", None, "state_dict", ["state_dict_ema"]),
    ("mmengine", "mmengine", None, "state_dict", []),
    ("torchscript", None, None, None, []),
    ("train_ckpt", "pytorch-tutorial", None, "model_state_dict", []),
])
def test_inspect_names_the_layout(name: str, framework: str | None, prefix: str | None, key: str | None,
                                  ema: list[str], fixtures_dir: Path, manifest: dict, cli_runner: Any) -> None:
    """No --trust, no tensor data: TorchScript included (its tensors listed, its code not run)."""
    layout = LAYOUTS[name]
    res = cli_runner.invoke(cli, ["inspect", str(fixtures_dir / layout.file), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert (info["framework"], info["common_prefix"], info["state_dict_key"], info["ema_keys"]) == (framework, prefix, key, ema)
    entry = manifest[layout.file]
    assert (info["format"], info["num_tensors"], info["dtypes"]) == (entry["format"], entry["num_tensors"], entry["dtypes"])
    assert entry.get("framework", framework) == framework and entry.get("common_prefix", prefix) == prefix
    assert any("state_dict_ema" in n for n in info["notes"]) == bool(ema)
    text = cli_runner.invoke(cli, ["inspect", str(fixtures_dir / layout.file)]).stdout
    assert ("every key starts with 'model.' (--strip-prefix model.)" in text) == (prefix == "model.")


def test_select_auto_takes_state_dict_never_the_ema(fixtures_dir: Path, train: Any) -> None:
    path = fixtures_dir / "mlp_timm.pth.tar"
    raw = _load_raw(train, path, "timm")
    auto = ckptfix.read(path)
    assert auto.state_dict_key == "state_dict" and auto.ema_keys == ["state_dict_ema"]
    assert any("EMA weights also present at state_dict_ema" in n for n in auto.notes)
    assert all(torch.equal(auto.state_dict[k], v) for k, v in raw["state_dict"].items())
    assert not all(torch.equal(raw["state_dict"][k], v) for k, v in raw["state_dict_ema"].items())
    ema = ckptfix.read(path, select="state_dict_ema")
    assert ema.state_dict_key == "state_dict_ema" and ema.ema_keys == []
    assert all(torch.equal(ema.state_dict[k], v) for k, v in raw["state_dict_ema"].items())
    assert isinstance(auto.extra["args"], argparse.Namespace) and vars(auto.extra["args"]) == vars(raw["args"])


def test_lightning_without_strip_keeps_the_attribute(tmp_path: Path, fixtures_dir: Path) -> None:
    """convert never guesses the framework prefix; --strip-prefix model. removes it by whole segments."""
    ckptfix.convert(fixtures_dir / "mlp_lightning.ckpt", tmp_path / "o.pth")
    assert list(torch.load(tmp_path / "o.pth", weights_only=True))[0] == "model.0.weight"


def test_lightning_verify_and_load_into_find_the_prefix(fixtures_dir: Path, manifest: dict, train: Any,
                                                        cli_runner: Any, tmp_path: Path) -> None:
    path = fixtures_dir / "mlp_lightning.ckpt"
    golden = golden_from_manifest(manifest["mlp_lightning.ckpt"], tmp_path / "golden.safetensors")
    report = ckptfix.verify(path, "fixtures/train.py:mlp", golden=golden)
    assert report.ok and report.fix == "strip prefix model." and (report.matched, report.total) == (6, 6)
    (check,) = report.forward["against"]
    assert check["what"] == "golden" and check["ok"] and check["tolerance"] == "recorded"
    assert report.convert_command.startswith(f"ckptfix convert {path}") and "--strip-prefix model." in report.convert_command
    res = cli_runner.invoke(cli, ["verify", str(path), "--model", "fixtures/train.py:mlp"])
    assert res.exit_code == 0 and "strip prefix model.: 6/6 keys match" in res.stdout
    model = train.mlp()
    loaded = ckptfix.load_into(model, path)
    assert loaded.fix == "strip prefix model." and loaded.missing == loaded.unexpected == []
    model.eval()
    with torch.no_grad():
        assert_close_to_recorded(model(train.fixed_input("mlp")), manifest["mlp_lightning.ckpt"]["output"])


def _resume(path: Path, train: Any) -> list[float]:
    """Five more Adam steps from the weights and ``optimizer_states[0]`` (read without ckptfix)."""
    model = train.mlp()
    ckptfix.load_into(model, path)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(torch.load(path, weights_only=True)["optimizer_states"][0])
    return train_steps(model, opt, 5)


@pytest.mark.parametrize("to, dtype", [("single", None), ("ddp", "fp32")])
def test_resume_from_converted_lightning_checkpoint(to: str, dtype: str | None, tmp_path: Path, fixtures_dir: Path,
                                                    train: Any) -> None:
    src = fixtures_dir / "mlp_lightning.ckpt"
    ckptfix.convert(src, tmp_path / "resume.ckpt", to=to, keep_extra=True, dtype=dtype)  # model. kept: resumable
    first = _resume(src, train)
    assert _resume(tmp_path / "resume.ckpt", train) == first and len(set(first)) == 5


def test_mmengine_loads_without_trust_and_without_mmengine(fixtures_dir: Path, train: Any) -> None:
    path = fixtures_dir / "mlp_mmengine.pth"
    scan = ckptfix.scan(path)
    classes = {g.name: g.category for g in scan.globals}
    assert scan.ok and {classes[n] for n in (HISTORY_BUFFER, "builtins.getattr", "numpy.ndarray",
                                             "numpy._core.multiarray._reconstruct", "numpy.dtype",
                                             "numpy._core.multiarray.scalar")} == {"allowed"}
    with adversarial.audit_events() as events:
        ckpt = ckptfix.read(path)
    assert events == [] and not any(m.startswith("mmengine") for m in sys.modules)
    raw = _load_raw(train, path, "mmengine")  # through the generator's throwaway mmengine module
    hub, want = ckpt.extra["message_hub"], raw["message_hub"]
    assert list(hub["log_scalars"]) == ["train/lr", "train/data_time", "train/loss", "train/time"]
    assert isinstance(hub["runtime_info"]["eta"], np.float64)  # LoggerHook's eta: a numpy scalar
    for key, buffer in hub["log_scalars"].items():
        log, count = buffer.data
        assert np.array_equal(log, want["log_scalars"][key]._log_history) and log.dtype == np.float64
        assert np.array_equal(count, want["log_scalars"][key]._count_history) and count.dtype == np.int64
        assert sorted(vars(buffer)["statistics_methods"]) == ["current", "max", "mean", "min"]
        with pytest.raises(TypeError, match="not mmengine's method"):
            vars(buffer)["statistics_methods"]["mean"](buffer)
    assert hub["runtime_info"] == want["runtime_info"] and ckpt.extra["meta"] == raw["meta"]


def _globals(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return [str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "loaded"])
def test_mmengine_keep_extra_writes_history_buffer_back(streamed: bool, tmp_path: Path, fixtures_dir: Path) -> None:
    """Both writers (the streaming zip writer and torch.save) name mmengine's class and getattr as the
    input does; reading the output with ckptfix gives the same numpy arrays."""
    src, dst = fixtures_dir / "mlp_mmengine.pth", tmp_path / "out.pth"
    # a map_location callable makes convert load the tensors (and write with torch.save)
    report = ckptfix.convert(src, dst, keep_extra=True, map_location="cpu" if streamed else (lambda s, loc: s),
                             allow=RESUMES_WITH["mmengine"])
    assert report.streamed == streamed
    names = _globals(dst)
    assert "mmengine.logging.history_buffer HistoryBuffer" in names and "__builtin__ getattr" in names
    assert not any("ckptfix" in n for n in names) and set(names) == set(_globals(src))
    assert ckptfix.scan(dst).ok
    before, after = ckptfix.read(src).extra["message_hub"], ckptfix.read(dst).extra["message_hub"]
    assert list(after["log_scalars"]) == list(before["log_scalars"])
    for key, buffer in before["log_scalars"].items():
        for a, b in zip(buffer.data, after["log_scalars"][key].data, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


class _Reduce:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _save_with(path: Path, value: Any, train: Any) -> None:
    """torch.save of weights plus ``value``, mmengine's module name importable while pickling."""
    with train._layouts()._mmengine_importable():
        torch.save({"state_dict": {"w": torch.ones(1)}, "value": value}, path)


@pytest.mark.parametrize("target, attr", [("HistoryBuffer", "__init__"), ("PosixPath", "touch"),
                                          ("HistoryBuffer", "__class__")])
def test_getattr_reaches_no_attribute(target: str, attr: str, tmp_path: Path, train: Any) -> None:
    """getattr is only getattr(HistoryBuffer, <statistic>): anything else fails the scan and the load."""
    import pathlib

    cls = {"HistoryBuffer": train._layouts().HistoryBuffer, "PosixPath": pathlib.PosixPath}[target]
    _save_with(tmp_path / "g.pth", _Reduce(getattr, cls, attr), train)
    report = ckptfix.scan(tmp_path / "g.pth")
    assert not report.ok and "builtins.getattr" in report.unsafe_globals
    assert any("only getattr(mmengine.logging.history_buffer.HistoryBuffer" in f.message for f in report.findings)
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.read(tmp_path / "g.pth")


def test_getattr_statistic_loads_as_an_inert_name(tmp_path: Path, train: Any) -> None:
    _save_with(tmp_path / "g.pth", train._layouts().HistoryBuffer.mean, train)
    assert ckptfix.scan(tmp_path / "g.pth").ok
    token = ckptfix.read(tmp_path / "g.pth").extra["value"]
    assert repr(token) == "<mmengine.logging.history_buffer.HistoryBuffer.mean>"
    with pytest.raises(TypeError, match="not mmengine's method"):
        token(None)


@pytest.mark.parametrize("value", [
    _Reduce(np._core.multiarray._reconstruct, np.memmap, (0,), b"b"),  # a subclass (memmap opens files)
    _Reduce(np._core.multiarray._reconstruct, np.ndarray, (5,), b"b"),  # not what numpy writes
    _Reduce(np.ndarray, (2,)),  # the class called directly
], ids=["memmap", "shape", "direct"])
def test_numpy_arrays_only_as_numpy_pickles_them(value: Any, tmp_path: Path, train: Any) -> None:
    _save_with(tmp_path / "n.pth", value, train)
    assert not ckptfix.scan(tmp_path / "n.pth").ok
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.read(tmp_path / "n.pth")
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.inspect(tmp_path / "n.pth")


def test_torchscript_needs_trust_to_convert(tmp_path: Path, fixtures_dir: Path, cli_runner: Any) -> None:
    path = fixtures_dir / "mlp_torchscript.pt"
    res = cli_runner.invoke(cli, ["convert", str(path), str(tmp_path / "o.pth")])
    assert res.exit_code == 1 and res.stderr.startswith("Error:") and "--trust" in res.stderr
    assert not (tmp_path / "o.pth").exists()


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_torchscript_inspect_and_trusted_extraction(fmt: str, tmp_path: Path, fixtures_dir: Path, manifest: dict,
                                                    train: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fixtures_dir / "mlp_torchscript.pt"
    module = torch.jit.load(str(path))  # the test trusts its own fixture
    expected = module.state_dict()
    with monkeypatch.context() as m:
        m.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("inspect ran torch.jit.load"))
        info = ckptfix.inspect(path)
    assert info.format == "torchscript" and list(info.state_dict) == list(expected)
    assert all(info.state_dict[k].shape == v.shape and info.state_dict[k].device.type == "meta" for k, v in expected.items())
    ckptfix.convert(path, tmp_path / f"o.{fmt}", trust=True)
    out = _read_output(tmp_path / f"o.{fmt}")
    assert list(out) == list(expected) and all(torch.equal(out[k], v) for k, v in expected.items())
    assert_close_to_recorded(_output(train, out), manifest["mlp_torchscript.pt"]["output"])


@pytest.mark.parametrize("select, expected", [("auto", "output"), ("state_dict_ema", "ema_output")])
def test_verify_compares_the_selected_weights_with_their_recorded_output(select: str, expected: str,
                                                                          fixtures_dir: Path, manifest: dict,
                                                                          tmp_path: Path) -> None:
    golden = golden_from_manifest(manifest["mlp_timm.pth.tar"], tmp_path / "golden.safetensors", output=expected)
    report = ckptfix.verify(fixtures_dir / "mlp_timm.pth.tar", str(fixtures_dir / "train.py") + ":mlp", select=select,
                            golden=golden)
    assert report.ok, report.failures
    (check,) = report.forward["against"]
    assert check["what"] == "golden" and check["ok"] and check["tolerance"] == "recorded"
    # the other recorded output is far outside that tolerance: comparing with it would fail
    other = torch.tensor(manifest["mlp_timm.pth.tar"]["ema_output" if expected == "output" else "output"])
    atol, rtol = recorded_tolerance(other)
    assert not torch.allclose(other, torch.tensor(manifest["mlp_timm.pth.tar"][expected]), atol=atol, rtol=rtol)


def test_dcp_refuses_mmengine_extras_it_cannot_name(tmp_path: Path, fixtures_dir: Path) -> None:
    with pytest.raises(ckptfix.errors.ConversionError, match="DCP directory can't store"):
        ckptfix.convert(fixtures_dir / "mlp_mmengine.pth", tmp_path / "d", format="dcp", keep_extra=True)
    assert not (tmp_path / "d").exists()
