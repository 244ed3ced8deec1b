"""Names from a file reach the terminal escaped and cut (issue 27, item 4): control characters in a global or
a key never reach stdout or stderr as bytes a terminal acts on, huge names and long lists are cut, ``--json``
keeps every name exact; a global named past any module's length is refused, a key never is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptfix.cli import cli
from tests.hostile_names import ESCAPES, marker, write_with_globals

ROOT = Path(__file__).resolve().parents[2]
RAW = ("\x1b", "\x07", "\x9b", "\u202e")  # what must never be printed as is


def _state(n_globals: int = 0, inside: bool = False) -> dict:
    sd = {"w": torch.ones(2)}
    placeholders = {f"c{i}": marker(i) for i in range(n_globals)}
    return {"state_dict": {**sd, **placeholders}} if inside else {"state_dict": sd, **placeholders}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    one = [("mod", ESCAPES)]
    key = tmp_path / "key.pt"
    torch.save({"w" + ESCAPES: torch.ones(2), "b": torch.ones(1)}, key)
    return {"beside": write_with_globals(tmp_path / "beside.pt", _state(1), one),
            "inside": write_with_globals(tmp_path / "inside.pt", _state(1, inside=True), one), "key": key}


CASES = [
    (["inspect", "{beside}"], 0), (["scan", "{beside}"], 3), (["convert", "{beside}", "{tmp}/o.safetensors"], 0),
    (["inspect", "{inside}"], 1), (["convert", "{inside}", "{tmp}/o.pth"], 1), (["scan", "{inside}"], 3),
    (["inspect", "{key}"], 0), (["diff", "{key}", "{beside}"], 3),
    (["verify", "{key}", "--model", "torch.nn:Linear", "--arg", "in_features=2", "--arg", "out_features=1", "--quiet"], 3),
]


def _case_id(v: object) -> str:
    return f"{v[0]}-{v[1].strip('{}')}" if isinstance(v, list) else str(v)


@pytest.mark.parametrize("args,code", CASES, ids=_case_id)
def test_control_characters_are_escaped(args: list[str], code: int, files: dict[str, Path], cli_runner, tmp_path: Path) -> None:
    res = cli_runner.invoke(cli, [a.format(tmp=tmp_path, **files) for a in args])
    assert res.exit_code == code, res.output
    out = res.stdout + res.stderr
    assert not [c for c in RAW if c in out], out
    assert "\\x1b[2J\\x1b]0;pwned\\x07Config\\u202e\\x9b" in out  # the name is shown, escaped as repr writes it
    assert len(res.stderr.splitlines()) <= 1 and "a bug in ckptfix" not in out


def test_json_keeps_names_exact(files: dict[str, Path], cli_runner) -> None:
    keys = json.loads(cli_runner.invoke(cli, ["inspect", str(files["key"]), "--json"]).stdout)["keys"]
    assert [k["key"] for k in keys] == ["w" + ESCAPES, "b"]
    report = json.loads(cli_runner.invoke(cli, ["scan", str(files["beside"]), "--json"]).stdout)
    assert "mod." + ESCAPES in [g["name"] for g in report["globals"]]


@pytest.mark.parametrize("inside", [False, True], ids=["beside", "inside"])
def test_many_long_names_are_cut(inside: bool, tmp_path: Path, cli_runner) -> None:
    """64 globals of 1000 characters (under the limit) and a 256 KiB key: every output stays small."""
    path = write_with_globals(tmp_path / "many.pt", _state(64, inside), [(f"m{i}", "C" * 1000) for i in range(64)])
    key = tmp_path / "longkey.pt"
    torch.save({"k" * 256 * 1024: torch.ones(1), "w": torch.ones(2)}, key)
    for args in (["inspect", path], ["scan", path], ["convert", path, tmp_path / "o.pth", "--force"], ["inspect", key],
                 ["diff", key, path]):
        res = cli_runner.invoke(cli, list(map(str, args)))
        assert res.exit_code in (0, 1, 3) and len(res.stdout) + len(res.stderr) < 100_000, (args, len(res.output))
        assert "a bug in ckptfix" not in res.output
    assert "…(+" in cli_runner.invoke(cli, ["inspect", str(key)]).stdout


def test_a_global_named_past_any_module_is_refused(tmp_path: Path, cli_runner) -> None:
    path = write_with_globals(tmp_path / "huge.pt", _state(64), [(f"m{i}", "C" * 256 * 1024) for i in range(64)])
    for args in (["inspect", path], ["scan", path], ["convert", path, tmp_path / "o.pth"]):
        res = cli_runner.invoke(cli, list(map(str, args)))
        assert res.exit_code == 1 and res.stdout == "", res.output
        assert len(res.stderr.splitlines()) == 1 and len(res.stderr) < 2_000, len(res.stderr)
        assert "262,147 characters long, longer than any module's name" in res.stderr


def test_a_long_key_is_never_refused(tmp_path: Path, cli_runner) -> None:
    key = "k" * 300_000 + ESCAPES
    torch.save({key: torch.ones(1)}, tmp_path / "k.pt")
    res = cli_runner.invoke(cli, ["convert", str(tmp_path / "k.pt"), str(tmp_path / "o.pth")])
    assert res.exit_code == 0, res.output
    assert list(torch.load(tmp_path / "o.pth", weights_only=True)) == [key]


def test_real_process_prints_no_control_bytes(files: dict[str, Path], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["inspect", files["beside"]], ["inspect", files["inside"]], ["convert", files["beside"], tmp_path / "o.pth"]):
        res = subprocess.run([sys.executable, "-m", "ckptfix", *map(str, args)], capture_output=True, env=env)
        assert res.returncode in (0, 1), res.stderr
        assert not [c for c in (b"\x1b", b"\x07", b"\xc2\x9b", "\u202e".encode()) if c in res.stdout + res.stderr]
        assert b"\\x1b" in res.stdout + res.stderr
