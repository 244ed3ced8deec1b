"""The gate as a CI step runs it: ``--no-forward`` still checks the values (NaN/Inf) and ``--structure-only`` reads
the structure alone, saying so on its verdict line; a line per phase on stderr where it is not a terminal,
``--quiet`` silencing them, stdout the same either way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.cli import cli

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"
PHASE = re.compile(r"^ckptfix verify: (\w+) \(\d+\.\d s\)$")


@pytest.fixture(params=["pth", "safetensors"])
def nan_file(request: Any, fixtures_dir: Path, tmp_path: Path) -> Path:
    """mlp_single's weights with one NaN, as a torch file or a safetensors file."""
    sd = torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)
    sd["2.bias"][1] = float("nan")
    path = tmp_path / f"nan.{request.param}"
    if request.param == "pth":
        torch.save(sd, path)
    else:
        save_file(sd, str(path))
    return path


def test_no_forward_fails_nan_structure_only_passes_and_says_so(nan_file: Path, cli_runner: Any) -> None:
    fast = cli_runner.invoke(cli, ["verify", str(nan_file), "--model", MLP_SPEC, "--no-forward", "--quiet"])
    assert fast.exit_code == 3, fast.output
    assert fast.stdout.startswith(f"FAILED: {nan_file} against {MLP_SPEC} (repairs allowed)\n")
    assert "  NaN/Inf (1):\n    2.bias\n" in fast.stdout and "  FAIL: 1 non-finite: 2.bias\n" in fast.stdout
    shape = cli_runner.invoke(cli, ["verify", str(nan_file), "--model", MLP_SPEC, "--structure-only", "--quiet"])
    assert shape.exit_code == 0, shape.output
    assert shape.stdout.startswith(f"VERIFIED: {nan_file} against {MLP_SPEC} (repairs allowed; structure only: values "
                                   "not checked)\n")
    assert "  note: structure only (--structure-only): read on meta; NaN/Inf and forward not checked\n" in shape.stdout
    report = json.loads(cli_runner.invoke(cli, ["verify", str(nan_file), "--model", MLP_SPEC, "--structure-only",
                                                "--json", "--quiet"]).stdout)
    assert report["ok"] is True and report["nonfinite"] is None and report["forward"] is None


def _phases(stderr: str) -> list[str]:
    """The phase names of stderr's lines, each line a phase line (anything else fails)."""
    found = [PHASE.match(line) for line in stderr.splitlines()]
    assert all(found), stderr
    return [m.group(1) for m in found if m]


@pytest.mark.parametrize("flags, phases", [
    ([], ["read", "build", "hash", "values", "crc", "load", "forward"]),
    (["--exact"], ["read", "build", "hash", "values", "crc", "observe", "load", "forward"]),
    (["--no-forward"], ["read", "build", "hash", "values", "crc"]),  # --json: hashed
    (["--structure-only"], ["read", "build", "hash", "crc"]),
], ids=["default", "exact", "no-forward", "structure-only"])
def test_a_line_per_phase_in_order_and_quiet_removes_them(flags: list[str], phases: list[str], fixtures_dir: Path,
                                                          cli_runner: Any) -> None:
    argv = ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--json", *flags,
            "--reference", str(fixtures_dir / "mlp_single.pth")]
    loud, quiet = cli_runner.invoke(cli, argv), cli_runner.invoke(cli, [*argv, "--quiet"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output
    assert _phases(loud.stderr) == phases
    assert quiet.stderr == ""
    assert _timeless(loud.stdout) == _timeless(quiet.stdout) and json.loads(loud.stdout)["ok"] is True  # the same


def test_a_phase_that_fails_prints_no_line_and_the_error_follows(fixtures_dir: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", "torchvision:resnet19"])
    assert res.exit_code == 1
    *phases, error = res.stderr.splitlines()
    # (the model spec is resolved before anything is read: no phase ran, the error is the only line)
    assert _phases("\n".join(phases)) == [] and error.startswith("Error: ") and "resnet19" in error


def test_a_real_process_with_stderr_a_pipe(fixtures_dir: Path) -> None:
    """CI's view: stderr a pipe, a line per phase as it ends; --quiet: nothing; stdout byte for byte the same."""
    exe = str(Path(sys.executable).with_name("ckptfix"))
    argv = [exe, "verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--exact"]
    loud = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    quiet = subprocess.run([*argv, "--quiet"], capture_output=True, text=True, timeout=120)
    assert loud.returncode == quiet.returncode == 0, loud.stderr
    assert _phases(loud.stderr) == ["read", "build", "hash", "values", "crc", "observe", "load"]
    assert quiet.stderr == "" and loud.stdout == quiet.stdout and loud.stdout.startswith("VERIFIED: ")


def _timeless(stdout: str) -> Any:
    """verify's --json object without the one figure that differs run to run (the observed load's seconds)."""
    obj = json.loads(stdout)
    if obj.get("observed"):
        obj["observed"].pop("seconds")
    return obj

