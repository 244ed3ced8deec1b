"""Shared by the parse tests: a damaged file refused by the CLI."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfix.cli import cli


@pytest.fixture
def refused_as_damage(cli_runner, tmp_path: Path) -> Callable[[str, Path], str]:
    """Run ``command`` (scan, inspect or convert) on ``path``; assert exit 1, one Error line naming the file,
    no --trust hint and nothing written; return the line."""

    def run(command: str, path: Path) -> str:
        out = tmp_path / "refused-out"
        out.mkdir(exist_ok=True)
        argv = {"scan": ["scan", str(path)], "inspect": ["inspect", str(path)],
                "convert": ["convert", str(path), str(out / "o.safetensors")]}[command]
        res = cli_runner.invoke(cli, argv)
        assert res.exit_code == 1 and res.stdout == "", res.output
        assert res.stderr.startswith(f"Error: {path}: ") and res.stderr.count("\n") == 1, res.stderr
        assert "--trust" not in res.stderr and list(out.iterdir()) == []
        return res.stderr

    return run
