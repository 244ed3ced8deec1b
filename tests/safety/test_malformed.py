"""Malformed input: every broken file is exit 1 with one line naming the file and what is wrong.

No traceback, no output file, whatever the command. Files are made from real torch and
safetensors output, then damaged the way downloads and disks damage them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from tests.malformed_files import CASES

COMMANDS = ["load", "inspect", "convert", "scan", "verify", "diff"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_is_one_clear_line(case: str, command: str, tmp_path: Path, cli_runner, fixtures_dir: Path) -> None:
    make, says = CASES[case]
    ext = ".safetensors" if case.startswith("safetensors") else ".pt"
    path = tmp_path / f"bad{ext}"
    path.write_bytes(make(tmp_path))
    before = path.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    if command == "load":
        with pytest.raises(FormatError) as info:
            ckptfix.load(path)
        message = f"Error: {info.value}\n"
    else:
        argv = {
            "inspect": ["inspect", str(path)],
            "convert": ["convert", str(path), str(out / "o.safetensors")],
            "scan": ["scan", str(path)],
            "verify": ["verify", str(path), "--model", "torch.nn:Linear", "--arg", "in_features=2",
                       "--arg", "out_features=1"],
            "diff": ["diff", str(fixtures_dir / "mlp_single.pth"), str(path)],
        }[command]
        res = cli_runner.invoke(cli, argv)
        assert res.exit_code == 1, res.output
        assert res.stdout == "" and "Traceback" not in res.stderr
        message = res.stderr
    assert message.startswith(f"Error: {path}") and message.count("\n") == 1, message
    assert says in message, message
    assert "unexpected" not in message  # not the CLI's catch-all for a bug
    assert path.read_bytes() == before and list(out.iterdir()) == []
