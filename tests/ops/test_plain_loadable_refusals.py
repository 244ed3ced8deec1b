"""What the plain weights-only loader refuses, around the weights: ``convert --keep-extra`` refuses to write it (one
line, naming each object and its key, ``--allow`` to write it anyway), ``load_into`` warns naming it, ``verify``
fails on a global outside the allow-list anywhere in the file (exit 3, as ``scan``); and the two names of how a
safetensors output stores ties."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli

SPEC_PY = "import torch\n\ndef lin():\n    return torch.nn.Linear(3, 2)\n"


class _Evil:
    def __reduce__(self) -> tuple:
        return os.system, ("true",)  # never run: read as an inert placeholder


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("refusals")
    torch.manual_seed(0)
    sd = torch.nn.Linear(3, 2).state_dict()
    made = {"namespace": {"state_dict": sd, "args": argparse.Namespace(lr=0.1)},
            "os-system": {"state_dict": sd, "hook": {"run": _Evil()}}, "plain": {"state_dict": sd, "epoch": 3}}
    for name, obj in made.items():
        torch.save(obj, d / f"{name}.pth")
    in_metadata = torch.nn.Linear(3, 2).state_dict()
    in_metadata._metadata[""]["args"] = argparse.Namespace(lr=0.1)  # type: ignore[attr-defined]
    torch.save(in_metadata, d / "metadata.pth")
    made["metadata"] = {}
    (d / "spec.py").write_text(SPEC_PY)
    return {name: d / f"{name}.pth" for name in made} | {"spec": d / "spec.py"}


@pytest.mark.parametrize("name, says", [("namespace", "beside the state dict it holds args (argparse.Namespace)"),
                                        ("os-system", "beside the state dict it holds hook.run (posix.system)"),
                                        ("metadata", "in _metadata['']['args']: an argparse.Namespace"), ("plain", None)])
def test_load_into_warns_naming_what_the_plain_loader_refuses(name: str, says: str | None, files: dict[str, Path]) -> None:
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptfix.load_into(model, files[name])
    lines = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if name != "metadata":
        assert torch.equal(model.weight, torch.load(files["plain"], weights_only=True)["state_dict"]["weight"])
    if says is None:
        assert not [line for line in lines if "weights_only=True) refuses" in line]
    else:
        assert [line for line in lines if "torch.load(PATH, weights_only=True) refuses this file" in line
                and line.endswith(says)], lines


def test_keep_extra_refuses_what_the_plain_loader_refuses_in_one_line(files: dict[str, Path], tmp_path: Path,
                                                                      cli_runner: Any) -> None:
    out = tmp_path / "out.pth"
    res = cli_runner.invoke(cli, ["convert", str(files["namespace"]), str(out), "--keep-extra", "-q"])
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    assert "--keep-extra would write args (argparse.Namespace)" in res.stderr and "--allow argparse.Namespace" in res.stderr
    res = cli_runner.invoke(cli, ["convert", str(files["namespace"]), str(out), "--keep-extra", "-q",
                                  "--allow", "argparse.Namespace"])
    assert res.exit_code == 0, res.output
    with torch.serialization.safe_globals([argparse.Namespace]):  # what the resuming code allows, it loads
        assert torch.load(out, weights_only=True)["args"] == argparse.Namespace(lr=0.1)
    res = cli_runner.invoke(cli, ["convert", str(files["plain"]), str(tmp_path / "p.pth"), "--keep-extra", "-q"])
    assert res.exit_code == 0 and torch.load(tmp_path / "p.pth", weights_only=True)["epoch"] == 3


@pytest.mark.parametrize("exact", [False, True], ids=["repairs-allowed", "exact"])
def test_verify_fails_on_a_global_outside_the_allow_list_anywhere(exact: bool, files: dict[str, Path],
                                                                  cli_runner: Any) -> None:
    args = ["verify", str(files["os-system"]), "--model", f"{files['spec']}:lin", "--json", "--quiet"]
    res = cli_runner.invoke(cli, args + (["--exact"] if exact else []))
    report = json.loads(res.stdout)
    assert res.exit_code == 3 and not report["ok"]
    assert report["failures"][0].startswith("unsafe: the file holds hook.run (posix.system), globals outside the "
                                            "allow-list")
    assert not any("returns a dict" in f for f in report["failures"])  # torch raises: no false reason


def test_verify_names_what_beside_the_state_dict_the_plain_loader_refuses(files: dict[str, Path],
                                                                          cli_runner: Any) -> None:
    args = ["verify", str(files["namespace"]), "--model", f"{files['spec']}:lin", "--json", "--quiet"]
    assert cli_runner.invoke(cli, args).exit_code == 0  # ckptfix's own load takes the weights
    report = json.loads(cli_runner.invoke(cli, args + ["--exact"]).stdout)
    assert report["failures"][0].startswith("exact: torch.load(weights_only=True) refuses the file: beside the state "
                                            "dict it holds args (argparse.Namespace)")


def test_verify_of_a_file_the_read_refuses_is_a_finding(tmp_path: Path, files: dict[str, Path], cli_runner: Any) -> None:
    """A placeholder inside the state dict: the read refuses the file; verify says so and exits 3 (convert: 1)."""
    torch.save({"weight": _Evil(), "bias": torch.zeros(2)}, tmp_path / "inside.pth")
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "inside.pth"), "--model", f"{files['spec']}:lin", "--quiet"])
    assert res.exit_code == 3 and "posix.system" in res.stderr and res.stderr.startswith("Error: ")
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "inside.pth"), "--model", f"{files['spec']}:lin", "--json"])
    assert json.loads(res.stdout) | {"error": None} == {"error": None, "error_type": "UnsafeCheckpointError", "exit_code": 3}
    assert cli_runner.invoke(cli, ["convert", str(tmp_path / "inside.pth"), str(tmp_path / "o.pth")]).exit_code == 1


@pytest.mark.parametrize("flags, dst, says", [
    (["--untie", "--compact-ties"], "o.safetensors", "contradict each other"),
    (["--compact-ties"], "o.pth", "--compact-ties is for safetensors output"),
])
def test_how_ties_are_stored_is_named_once(flags: list[str], dst: str, says: str, files: dict[str, Path],
                                           tmp_path: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["convert", str(files["plain"]), str(tmp_path / dst), *flags])
    assert res.exit_code == 1 and says in res.stderr and not (tmp_path / dst).exists()
