"""The gate is a list of checks (ckptfix.model.checks.CHECKS): each a function of the gate and the report so far that
returns its findings; a check added to the list shows up in the report. The fix command it suggests spells
convert's flags as ConvertOptions declares them."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix.cli import cli
from ckptfix.model import checks, fixes
from ckptfix.model.findings import Findings
from ckptfix.ops.convert_options import ConvertOptions, flag_of
from ckptfix.statedict import repair

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"
CONVERT_FLAGS = {decl for f in fields(ConvertOptions) for decl in flag_of(f).decls}


@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: c.__name__)
def test_each_check_is_a_function_of_the_gate_and_the_report(check: Any) -> None:
    assert inspect.isfunction(check) and check.__doc__, check
    signature = inspect.signature(check)
    assert list(signature.parameters) == ["gate", "report"] and signature.return_annotation == "Findings"


def _mine(gate: checks.Gate, report: Any) -> Findings:
    """A check a test adds: it sees what the checks before it found."""
    return Findings(failures=[f"mine: {report.sha256}"], warnings=["mine warns"], notes=["mine notes"],
                    fields={"suggestions": [{"text": "mine suggests"}]})


def _verify_json(cli_runner: Any, path: Path, code: int) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["verify", str(path), "--model", MLP_SPEC, "--json"])
    assert res.exit_code == code, res.output
    report: dict[str, Any] = json.loads(res.stdout)
    return report


def test_a_check_added_to_the_list_shows_in_the_report(monkeypatch: pytest.MonkeyPatch, cli_runner: Any,
                                                        fixtures_dir: Path) -> None:
    path = fixtures_dir / "mlp_ddp.pth"
    before = _verify_json(cli_runner, path, 0)
    monkeypatch.setattr(checks, "CHECKS", (*checks.CHECKS, _mine))
    report = _verify_json(cli_runner, path, 3)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert report["ok"] is False and report["failures"] == [*before["failures"], f"mine: {sha}"]
    assert report["warnings"][-1] == "mine warns" and report["notes"][-1] == "mine notes"
    assert report["suggestions"] == [{"text": "mine suggests"}]
    monkeypatch.setattr(checks, "CHECKS", tuple(c for c in checks.CHECKS if c is not _mine))
    assert _verify_json(cli_runner, path, 0) == before


def test_a_check_fills_only_the_report_s_fields(monkeypatch: pytest.MonkeyPatch, fixtures_dir: Path) -> None:
    def misspelt(gate: checks.Gate, report: Any) -> Findings:
        return Findings(fields={"sha265": "…"})

    monkeypatch.setattr(checks, "CHECKS", (misspelt,))
    with pytest.raises(AttributeError, match="'sha265', which VerifyReport has no field for"):
        ckptfix.verify(fixtures_dir / "mlp_ddp.pth", MLP_SPEC, forward=False)


def _command(**options: Any) -> str:
    """The fix command for a DDP file whose model has a ``backbone.`` prefix, with ``options``."""
    keys = ["module.0.weight", "module.0.bias"]
    target = repair.Target(shapes={"backbone.0.weight": None, "backbone.0.bias": None}, dtypes={}, tied=[],
                           module_names=[], wrappers=[])
    fix = repair.Repair(strip_prefix=None, add_prefix="backbone", fn=lambda k: "backbone." + k.removeprefix("module."))
    command = fixes.convert_command("run.pth", keys, fix, target, **options)
    assert command is not None
    return command


@pytest.mark.parametrize("options", [
    dict(select=None),
    dict(select="state_dict", dtype="fp16", untie=True, map_location="cpu", ext=".safetensors"),
], ids=["plain", "every-flag"])
def test_the_fix_command_spells_convert_s_flags(options: dict[str, Any]) -> None:
    argv = shlex.split(_command(**options))
    emitted = [a for a in argv if a.startswith("-")]
    assert emitted and set(emitted) <= CONVERT_FLAGS, emitted
    parsed = cli.commands["convert"].make_context("convert", argv[2:])  # the command parses as convert's arguments
    assert parsed.params["add_prefix"] == "backbone." and parsed.params["to"] == "single"
    if "dtype" in options:
        assert (parsed.params["dtype"], parsed.params["untie"], parsed.params["select"]) == ("fp16", True, "state_dict")
        assert parsed.params["map_location"] == ("cpu",) and argv[3] == "run.fixed.safetensors"


def test_the_fix_command_names_no_flag_itself() -> None:
    """Each flag comes from ``convert_flag`` (ConvertOptions): no string in convert_command starts with ``-``."""
    tree = ast.parse(inspect.getsource(fixes.convert_command))
    spelt = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.startswith("-")]
    assert not spelt
    assert fixes.convert_flag("map_location") == "--map-location" and fixes.convert_flag("untie") == "--untie"
