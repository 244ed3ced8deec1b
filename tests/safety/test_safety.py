"""Safe by default: the allow-list loads real training checkpoints, nothing else loads without trust.

Training checkpoints carry argparse.Namespace, numpy scalars and dtypes, paths, datetimes,
torch's version string, defaultdict/deque/Counter; they load through torch's weights_only
unpickler plus the allow-list. Anything else is refused naming the globals, never retried unsafely,
whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says; ``trust=True`` / ``--trust`` is the only way in.
"""

from __future__ import annotations

import re

import argparse
import collections
import datetime
import fractions
import io
import os
import pathlib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptfix
from ckptfix.parse.inert import InertGlobal, InertObject
from ckptfix.safety.allowlist import classify
from ckptfix.safety.guards import ckptfix_objects
from ckptfix.cli import cli
from ckptfix.errors import UnsafeCheckpointError
from tests import adversarial


pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save deprecation


def training_extras() -> dict[str, Any]:
    """What real training scripts put next to the weights."""
    return {
        "args": argparse.Namespace(lr=3e-4, arch="mlp", milestones=[30, 60], output=pathlib.PosixPath("/runs/7")),
        "epoch": np.int64(12),
        "best_acc": np.float32(0.913),
        "loss": np.float64(0.25),
        "dtype": np.dtype("float16"),
        "dtype_class": np.dtypes.Float32DType,
        "saved_at": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2024, 5, 1),
        "time_of_day": datetime.time(12, 30),
        "elapsed": datetime.timedelta(hours=3, seconds=5),
        "torch_version": torch.__version__,
        "history": collections.deque([0.9, 0.7, 0.5], maxlen=100),
        "per_class": collections.defaultdict(list, {"cat": [1, 2], "dog": []}),
        "counts": collections.Counter({"cat": 3, "dog": 1}),
        "order": collections.OrderedDict(a=1, b=2),
        "misc": {"set": {1, 2}, "complex": 1 + 2j, "bytes": b"\x00\xff", "nested": [(1, "a"), None, True]},
    }


#: the classes of :func:`training_extras` torch.load(weights_only=True) refuses (what the resuming code must allow)
RESUMES_WITH = ("argparse.Namespace", "pathlib.PosixPath", "numpy.int64", "numpy.float32", "numpy.float64",
                "numpy.dtypes.Float16DType", "numpy.dtypes.Float32DType", "datetime.datetime", "datetime.date",
                "datetime.time", "datetime.timedelta", "torch.torch_version.TorchVersion", "collections.deque",
                "collections.defaultdict")


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, argparse.Namespace):
        assert vars(a) == vars(b)
    elif isinstance(a, collections.defaultdict):
        assert a.default_factory is b.default_factory and dict(a) == dict(b)
    elif isinstance(a, collections.deque):
        assert a.maxlen == b.maxlen and list(a) == list(b)
    else:
        assert a == b


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_training_checkpoint_with_allowed_globals_loads(legacy: bool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    extras = training_extras()
    weights = {"fc.weight": torch.randn(2, 3), "fc.bias": torch.zeros(2)}
    torch.save({"model": weights, **extras}, path, _use_new_zipfile_serialization=not legacy)
    with adversarial.audit_events() as events:
        ckpt = ckptfix.read(path)
    assert events == []
    assert ckpt.state_dict_key == "model"
    assert all(torch.equal(ckpt.state_dict[k], v) for k, v in weights.items())
    for key, value in extras.items():
        assert_same(ckpt.extra[key], value)
    assert ckptfix.scan(path).ok


def test_keep_extra_round_trip_keeps_allowed_objects(tmp_path: Path) -> None:
    src, dst = tmp_path / "ckpt.pth", tmp_path / "out.pth"
    extras = training_extras()
    torch.save({"model": {"module.fc.weight": torch.randn(2, 3)}, **extras}, src)
    with pytest.raises(ckptfix.errors.ConversionError, match=r"--keep-extra would write args \(argparse.Namespace\), "
                       r"args.output \(pathlib.PosixPath\), epoch \(numpy.int64\).*"
                       r"torch.load\(PATH, weights_only=True\) refuses"):
        ckptfix.convert(src, dst, keep_extra=True)  # the plain loader refuses them: named, with their keys
    assert not dst.exists()
    ckptfix.convert(src, dst, keep_extra=True, allow=RESUMES_WITH)  # the resuming code allows them
    ckpt = ckptfix.read(dst)
    assert list(ckpt.state_dict) == ["fc.weight"]
    for key, value in extras.items():
        assert_same(ckpt.extra[key], value)


def _rename_global(tmp_path: Path, obj: dict, old: bytes, new: bytes) -> Path:
    """A torch zip whose data.pkl names ``new`` where torch wrote ``old`` (as another version would)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    assert any(old in data for name, data in members if name.endswith("data.pkl"))
    path = tmp_path / "renamed.pth"
    adversarial.write_zip(path, [(n, d.replace(old, new) if n.endswith("data.pkl") else d) for n, d in members])
    return path


def test_numpy_1x_scalar_name_loads(tmp_path: Path) -> None:
    path = _rename_global(tmp_path, {"w": torch.ones(1), "step": np.int64(7)},
                          b"cnumpy._core.multiarray\nscalar\n", b"cnumpy.core.multiarray\nscalar\n")
    assert ckptfix.read(path).state_dict["step"] == 7


@pytest.mark.parametrize("old, new, expected", [
    (b"cpathlib\nPurePosixPath\n", b"cpathlib._local\nPosixPath\n", pathlib.PosixPath("/runs/7")),  # Python 3.13
    (b"cpathlib\nPureWindowsPath\n", b"cpathlib\nWindowsPath\n", pathlib.PureWindowsPath("C:/runs/7")),
])
def test_paths_from_other_pythons_and_systems(old: bytes, new: bytes, expected: Any, tmp_path: Path) -> None:
    src = pathlib.PurePosixPath("/runs/7") if b"Posix" in old else pathlib.PureWindowsPath("C:/runs/7")
    path = _rename_global(tmp_path, {"model": {"w": torch.ones(1)}, "dir": src}, old, new)
    loaded = ckptfix.read(path).extra["dir"]
    assert type(loaded) is type(expected) and loaded == expected


def test_allow_list_holds_no_function_that_runs_code() -> None:
    """Every entry is a data class or one of ckptfix's own guarded stand-ins; builtin types are inert tokens."""
    from ckptfix.safety import numpy_policy, standins
    from ckptfix.safety.subclasses import SubclassName

    own = {standins.defaultdict_stand_in, standins.empty_bytes, standins.getattr_method, *numpy_policy.STAND_INS.values()}
    for name, obj in ckptfix_objects().items():
        if isinstance(obj, InertGlobal):  # read as data (OmegaConf's classes): a name, never imported or called
            assert classify(*name.rsplit(".", 1)) == "inert" and obj.name == name and not callable(obj)
            continue
        assert classify(*name.rsplit(".", 1)) == "allowed"
        if isinstance(obj, SubclassName):  # torchao's tensor classes and enums: a name, never imported or called
            assert obj.name == name and not callable(obj) and name.startswith("torchao.")
            continue
        if name == "builtins.getattr":  # only getattr(HistoryBuffer, <statistic>), giving an inert name
            with pytest.raises(Exception, match="getattr is allowed only as"):
                obj(pathlib.PosixPath, "touch")
        elif name == "builtins.bytes":  # b"" only
            assert obj() == b""
            with pytest.raises(Exception, match="allowed only as bytes()"):
                obj(10**9)
        elif name.startswith("builtins."):
            with pytest.raises(Exception, match="default factory"):
                obj("x")
        elif name.endswith("multiarray._reconstruct"):  # an empty stand-in array, nothing else
            with pytest.raises(Exception, match="allowed only as numpy pickles an array"):
                obj(np.memmap, (0,), b"b")
        elif name == "numpy.ndarray":  # a token only _reconstruct accepts
            with pytest.raises(Exception, match="allowed only as the subtype"):
                obj((2,))
        elif callable(obj) and not isinstance(obj, type):
            assert obj in own, name
        else:
            assert isinstance(obj, type), name
    for unsafe in ("builtins.eval", "posix.system", "pathlib.Path", "collections.ChainMap", "torch.load",
                   "numpy.load", "numpy.memmap", "numpy._core.numeric._frombuffer", "builtins.setattr"):
        assert classify(*unsafe.rsplit(".", 1)) == "unsafe"
    # torch's weights_only reads nested tensors; ckptfix too, each component checked inside its buffer (issue 27)
    assert classify("torch._utils", "_rebuild_nested_tensor") == "safe"
    assert classify("pathlib", "PosixPath.touch") == "unsafe"


def test_builtin_type_token_cannot_be_called(tmp_path: Path) -> None:
    path = tmp_path / "tok.pth"
    adversarial.write_zip(path, adversarial.with_data_pkl(
        adversarial.as_weight(adversarial.call(adversarial.glob("builtins", "str"), adversarial.u("x")))))
    with pytest.raises(UnsafeCheckpointError, match="allowed only as a defaultdict's default factory"):
        ckptfix.load(path)


def test_defaultdict_factory_must_be_a_plain_type(tmp_path: Path) -> None:
    path = tmp_path / "dd.pth"
    torch.save({"w": torch.ones(1), "d": collections.defaultdict(argparse.Namespace)}, path)
    with pytest.raises(UnsafeCheckpointError, match="default factory"):
        ckptfix.read(path)


@pytest.fixture
def malicious(tmp_path: Path) -> adversarial.Case:
    return next(c for c in adversarial.build_corpus(tmp_path) if c.name == "os-system-protocol-2")


@pytest.mark.parametrize("variable", ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
@pytest.mark.parametrize("scanned", [True, False], ids=["with-scan", "unpickler-alone"])
def test_env_vars_never_make_ckptfix_unsafe(variable: str, scanned: bool, malicious: adversarial.Case,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's variables flip torch.load's *defaults*; ckptfix always hands torch its own restricted
    unpickler. The static scan passes a global outside the allow-list in the checkpoint's own pickle on to
    that unpickler, which makes it an inert placeholder (never imported or called), refused as the whole
    state dict; without the scan (patched out) the same."""
    from ckptfix.safety import scanner
    from ckptfix.parse.unpickler import SafePickle

    monkeypatch.setenv(variable, "1")
    if not scanned:
        monkeypatch.setattr(scanner, "ensure_safe", lambda path, fmt, **kwargs: None)
    calls: list[dict] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with adversarial.audit_events() as events:
        for fn in (ckptfix.load, ckptfix.inspect):
            with pytest.raises(UnsafeCheckpointError, match="posix.system"):
                fn(malicious.path)
    assert events == [] and not malicious.canary.exists()
    assert all(isinstance(c.get("pickle_module"), SafePickle) for c in calls)  # never plain pickle
    assert len(calls) >= 1
    assert os.environ[variable] == "1"  # lifted only for the call


@pytest.mark.parametrize("variable", ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
def test_env_var_allowed_checkpoint_still_loads(variable: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "1")
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(a=1)}, tmp_path / "c.pth")
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(a=1)}, tmp_path / "l.pth",
               _use_new_zipfile_serialization=False)
    for name in ("c.pth", "l.pth"):
        assert vars(ckptfix.read(tmp_path / name).extra["args"]) == {"a": 1}


def test_trust_is_the_only_way_in(tmp_path: Path, cli_runner) -> None:
    """Beside the state dict an unknown global is an inert placeholder; inside it, only --trust (or
    --allow, as inert data) takes it, and only --trust makes the real object."""
    path = tmp_path / "frac.pth"
    torch.save({"model": {"w": torch.ones(2), "ratio": fractions.Fraction(1, 3)}}, path)
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptfix.read(path)
    assert info.value.globals == ["fractions.Fraction"] and "--trust" in str(info.value)
    assert ckptfix.read(path, trust=True).state_dict["ratio"] == fractions.Fraction(1, 3)
    res = cli_runner.invoke(cli, ["inspect", str(path)])
    assert res.exit_code == 1 and "fractions.Fraction" in res.stderr and res.stderr.count("\n") == 1
    res = cli_runner.invoke(cli, ["inspect", str(path), "--trust"])
    assert res.exit_code == 0 and "ratio  [-]  Fraction" in res.stdout
    beside = tmp_path / "beside.pth"
    torch.save({"model": {"w": torch.ones(2)}, "ratio": fractions.Fraction(1, 3)}, beside)
    ratio = ckptfix.read(beside).extra["ratio"]
    assert isinstance(ratio, InertObject) and ratio.name == "fractions.Fraction" and ratio.args == (1, 3)


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_newer_pickle_protocols_load_safely(protocol: int, tmp_path: Path, cli_runner) -> None:
    """torch's weights_only unpickler can't read STACK_GLOBAL/MEMOIZE/FRAME; ckptfix's reads every opcode."""
    path = tmp_path / "p.pth"
    extras = training_extras()
    torch.save({"model": {"w": torch.arange(3.0)}, **extras}, path, pickle_protocol=protocol)
    assert ckptfix.scan(path).ok
    ckpt = ckptfix.read(path)
    assert torch.equal(ckpt.state_dict["w"], torch.arange(3.0))
    for key, value in extras.items():
        assert_same(ckpt.extra[key], value)
    assert cli_runner.invoke(cli, ["inspect", str(path)]).exit_code == 0


# -- TorchScript ---------------------------------------------------------------------------------

class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        self.norm = torch.nn.BatchNorm1d(2)
        self.register_buffer("scale", torch.arange(6.0).reshape(2, 3).t())  # a non-contiguous view
        self.not_state = torch.zeros(5)  # a tensor attribute: in the pickle, not in state_dict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x)) + self.not_state.sum()


@pytest.fixture
def scripted(tmp_path: Path) -> Path:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(_Scripted()), path)
    return path


def test_torchscript_inspect_lists_tensors_without_running_code(scripted: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 cli_runner) -> None:
    expected = torch.jit.load(scripted).state_dict()  # the test trusts its own file
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("torch.jit.load ran"))
    ckpt = ckptfix.inspect(scripted)
    assert ckpt.format == "torchscript"
    assert list(ckpt.state_dict) == list(expected)
    for key, t in ckpt.state_dict.items():
        assert t.device.type == "meta"
        assert (t.shape, t.stride(), t.dtype) == (expected[key].shape, expected[key].stride(), expected[key].dtype)
    res = cli_runner.invoke(cli, ["inspect", str(scripted)])
    assert res.exit_code == 0 and "torchscript" in res.stdout and re.search(r"body\.2\.weight +\[2x4\]", res.stdout)


def test_torchscript_load_needs_trust(scripted: Path, cli_runner, tmp_path: Path) -> None:
    with pytest.raises(UnsafeCheckpointError, match="TorchScript archive; loading it runs the code"):
        ckptfix.load(scripted)
    res = cli_runner.invoke(cli, ["convert", str(scripted), str(tmp_path / "o.pth")])
    assert res.exit_code == 1 and "TorchScript" in res.stderr and not (tmp_path / "o.pth").exists()
    sd = ckptfix.load(scripted, trust=True)
    expected = torch.jit.load(scripted).state_dict()
    assert list(sd) == list(expected) and all(torch.equal(sd[k], expected[k]) for k in sd)
