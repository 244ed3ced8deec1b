"""Objects beside the weights: globals outside the allow-list become inert placeholders, never imported or called.

``custom.pt`` is ``torch.save({"state_dict": sd, "config": myproj.config.RunConfig(...), "epoch": 3})`` written by
a child process (tests/real_configs.py) that alone can import ``myproj``. Every command extracts the weights
bit for bit and names the placeholders; inside the selected state dict they are refused unless ``--allow``
names them. The payloads of the adversarial corpus, put beside the state dict (and inside a placeholder's
state), never run: a canary file they would create, the audit hook and ``sys.modules`` show it, while
``torch.load(weights_only=False)`` of the same files, in a child, does run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import ConversionError, UnsafeCheckpointError
from ckptfix.parse.inert import InertObject
from tests import adversarial

TESTS = Path(__file__).resolve().parents[1]
RUN_CONFIG, MODE = "myproj.config.RunConfig", "myproj.config.Mode"
CANARY_MODULE = "ckptfix_canary_beside"


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("custom")
    res = subprocess.run([sys.executable, str(TESTS / "real_configs.py"), "custom", str(out)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def weights(custom: Path) -> dict[str, torch.Tensor]:
    return torch.load(custom / "weights.pt", weights_only=True)["custom"]


def _bit_equal(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


def test_custom_object_is_an_inert_placeholder(custom: Path, weights: dict[str, torch.Tensor]) -> None:
    ckpt = ckptfix.read(custom / "custom.pt")
    _bit_equal(ckpt.state_dict, weights)
    config = ckpt.extra["config"]
    assert isinstance(config, InertObject) and config.name == RUN_CONFIG and config.op == "NEWOBJ"
    mode = config.state.pop("mode")
    assert config.state == {"lr": 0.5, "layers": 4, "name": "run", "widths": [8, 16]}
    assert isinstance(mode, InertObject) and mode.name == MODE and mode.args == ("eval",)
    assert ckpt.extra["epoch"] == 3
    assert f"config: inert {MODE}, {RUN_CONFIG} (not imported, never called; outside the state dict)" in ckpt.notes
    assert "myproj" not in sys.modules


@pytest.mark.parametrize("command", ["load", "select", "inspect", "convert-safetensors", "convert-pth", "describe"])
def test_every_command_extracts_the_weights(command: str, custom: Path, weights: dict[str, torch.Tensor],
                                            tmp_path: Path, cli_runner: Any) -> None:
    src = custom / "custom.pt"
    if command in ("load", "select"):
        _bit_equal(ckptfix.load(src, select="state_dict" if command == "select" else "auto"), weights)
    elif command == "describe":  # torch-free, and as the torch path reads it
        torch_free, with_torch = ckptfix.describe(src).to_dict(), ckptfix.inspect(src).to_dict()
        assert torch_free == with_torch and torch_free["extra"]["config"] == f"inert {RUN_CONFIG} (not imported)"
    elif command == "inspect":
        res = cli_runner.invoke(cli, ["inspect", str(src)])
        assert res.exit_code == 0, res.output
        assert f"config: inert {RUN_CONFIG} (not imported)" in res.stdout and f"inert {MODE}, {RUN_CONFIG}" in res.stdout
    else:
        out = tmp_path / ("w.safetensors" if command.endswith("safetensors") else "w.pth")
        res = cli_runner.invoke(cli, ["convert", str(src), str(out)])
        assert res.exit_code == 0, res.output
        assert f"config: inert {MODE}, {RUN_CONFIG}" in res.stdout
        if out.suffix == ".pth":
            _bit_equal(torch.load(out, weights_only=True), weights)
        else:
            from safetensors.torch import load_file

            got = load_file(str(out))
            assert all(torch.equal(got[k], weights[k]) for k in weights) and set(got) == set(weights)
    assert "myproj" not in sys.modules


def test_inside_the_state_dict_it_is_refused_unless_allowed(custom: Path, weights: dict[str, torch.Tensor],
                                                            tmp_path: Path, cli_runner: Any) -> None:
    src = custom / "custom_in_sd.pt"
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptfix.read(src)
    assert info.value.globals == [MODE, RUN_CONFIG] and "--trust" in str(info.value)
    assert f"--allow {MODE} --allow {RUN_CONFIG}" in str(info.value) and "(at 'extra')" in str(info.value)
    res = cli_runner.invoke(cli, ["inspect", str(src)])
    assert res.exit_code == 1 and res.stderr.startswith("Error: ") and "refused" in res.stderr
    res = cli_runner.invoke(cli, ["inspect", str(src), "--allow", MODE, "--allow", RUN_CONFIG])
    assert res.exit_code == 0, res.output
    assert any(line.split() == ["extra", "[-]", "inert", RUN_CONFIG, "(not", "imported)"] for line in res.stdout.splitlines())
    sd = ckptfix.load(src, allow=(MODE, RUN_CONFIG))
    _bit_equal({k: v for k, v in sd.items() if k != "extra"}, weights)
    assert isinstance(sd["extra"], InertObject) and sd["extra"].name == RUN_CONFIG
    with pytest.raises(UnsafeCheckpointError):  # one allowed, the other still not
        ckptfix.load(src, allow=(RUN_CONFIG,))
    with pytest.raises(ConversionError, match="can't be written back"):  # a placeholder is never written
        ckptfix.convert(src, tmp_path / "w.pth", allow=[MODE, RUN_CONFIG])
    assert not (tmp_path / "w.pth").exists()


def test_keep_extra_refuses_to_write_a_placeholder(custom: Path, tmp_path: Path, cli_runner: Any) -> None:
    out = tmp_path / "kept.pth"
    res = cli_runner.invoke(cli, ["convert", str(custom / "custom.pt"), str(out), "--keep-extra"])
    assert res.exit_code == 1 and "drop --keep-extra" in res.stderr and RUN_CONFIG in res.stderr
    assert not out.exists()


def test_scan_stays_honest_and_says_the_weights_can_be_extracted(custom: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["scan", str(custom / "custom.pt")])
    assert res.exit_code == 3 and "UNSAFE" in res.stdout
    assert "ckptfix can still extract the weights" in res.stdout
    report = json.loads(cli_runner.invoke(cli, ["scan", str(custom / "custom.pt"), "--json"]).stdout)
    assert report["extractable"] and report["unsafe_globals"] == [MODE, RUN_CONFIG]


# -- payloads beside the state dict --------------------------------------------------------------------------

def _payloads(directory: Path) -> dict[str, Any]:
    """name → an object whose unpickling would create ``directory/canary-<name>``."""

    def canary(name: str) -> str:
        return str(directory / f"canary-{name}")

    nested = types.SimpleNamespace()  # a placeholder whose BUILD state holds the call
    nested.__dict__["cmd"] = adversarial.Reduce(os.system, f"touch {canary('nested-in-state')}")
    return {
        "os-system": adversarial.Reduce(os.system, f"touch {canary('os-system')}"),
        "subprocess-popen": adversarial.Reduce(subprocess.Popen, ["touch", canary("subprocess-popen")]),
        "builtins-exec": adversarial.Reduce(exec, f"open({canary('builtins-exec')!r}, 'w').close()"),
        "builtins-eval": adversarial.Reduce(eval, f"open({canary('builtins-eval')!r}, 'w').close()"),
        "nested-in-state": nested,
        "list-of-payloads": [1, {"deep": adversarial.Reduce(os.system, f"touch {canary('list-of-payloads')}")}],
        "import-time-module": "import-time",  # made below: a module whose import creates the canary
    }


PAYLOADS = list(_payloads(Path("/nonexistent")))


@pytest.fixture(scope="module")
def beside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file per payload: ``{"state_dict": {"w": arange(4)}, "config": payload}``, and the same payload
    inside the state dict (``inside-<name>``)."""
    directory = tmp_path_factory.mktemp("beside")
    (directory / f"{CANARY_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(directory / 'canary-import-time-module')!r}).touch()\ndef boom():\n    pass\n")
    sys.path.insert(0, str(directory))
    try:
        module = __import__(CANARY_MODULE)  # (its import creates the canary: removed below)
        for name, payload in _payloads(directory).items():
            if name == "import-time-module":
                payload = adversarial.Reduce(module.boom)
            weights = {"w": torch.arange(4.0)}
            torch.save({"state_dict": weights, "config": payload}, directory / f"{name}.pt")
            torch.save({"state_dict": {**weights, "x": payload}}, directory / f"inside-{name}.pt")
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(CANARY_MODULE, None)
        (directory / "canary-import-time-module").unlink()
    return directory


def test_the_payloads_are_live(beside: Path) -> None:
    """torch.load(weights_only=False) of the same files, in a child, runs every payload."""
    code = ("import sys, torch\nsys.path.insert(0, sys.argv[1])\nfor p in sys.argv[2:]:\n"
            "    torch.load(p, weights_only=False)\n")
    paths = [str(beside / f"{name}.pt") for name in PAYLOADS]
    res = subprocess.run([sys.executable, "-c", code, str(beside), *paths], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    import time

    deadline = time.monotonic() + 10
    while not all((beside / f"canary-{n}").exists() for n in PAYLOADS) and time.monotonic() < deadline:
        time.sleep(0.05)  # subprocess.Popen touches its canary asynchronously
    assert [n for n in PAYLOADS if not (beside / f"canary-{n}").exists()] == []
    for name in PAYLOADS:
        (beside / f"canary-{name}").unlink()


@pytest.mark.parametrize("command", ["load", "inspect", "convert", "scan", "inside"])
@pytest.mark.parametrize("name", PAYLOADS)
def test_payloads_beside_the_state_dict_never_run(name: str, command: str, beside: Path, tmp_path: Path,
                                                  cli_runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(beside))  # so importing the canary module *would* work
    path = beside / (f"inside-{name}.pt" if command == "inside" else f"{name}.pt")
    before = path.read_bytes()
    with adversarial.audit_events() as events:
        if command == "load":
            assert torch.equal(ckptfix.load(path)["w"], torch.arange(4.0))
            assert ckptfix.read(path).notes[0].startswith("config: inert ")
        elif command == "inside":  # in the state dict: refused, as before
            with pytest.raises(UnsafeCheckpointError, match="refused"):
                ckptfix.load(path)
        elif command == "scan":
            res = cli_runner.invoke(cli, ["scan", str(path)])
            assert res.exit_code == 3 and "ckptfix can still extract the weights" in res.stdout
        else:
            argv = ["inspect", str(path)] if command == "inspect" else ["convert", str(path), str(tmp_path / "w.pth")]
            res = cli_runner.invoke(cli, argv)
            assert res.exit_code == 0, res.output
            assert "config: inert " in res.stdout
            if command == "convert":
                assert torch.equal(torch.load(tmp_path / "w.pth", weights_only=True)["w"], torch.arange(4.0))
    assert events == [], f"code ran: {events}"
    assert not (beside / f"canary-{name}").exists()
    assert CANARY_MODULE not in sys.modules
    assert path.read_bytes() == before
