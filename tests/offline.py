"""Tests that must not reach the network: a command run in a network namespace without interfaces, and a guard
that fails the test on any connection attempt in this process."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from typing import Any

import pytest


def offline(argv: list[str]) -> list[str]:
    """``argv`` in a new network namespace without interfaces where unprivileged ones work (else as it is: CI
    containers often forbid them; the in-process socket guard still holds for the library tests)."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn", *argv]
    return argv


def refuse_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt in this process fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


#: model-signing's own CLI (its click group, as the ``model_signing`` script runs it) over several models in one
#: process: each CLI start costs ~1 s
RUN_CLI = """
import json, sys
from click.testing import CliRunner
from model_signing._cli import main
results = [CliRunner().invoke(main, argv) for argv in json.loads(sys.argv[1])]
print(json.dumps([[r.exit_code, r.output] for r in results]))
"""


def model_signing_cli(*argvs: list[str]) -> list[tuple[int, str]]:
    """Each ``argvs`` run by model-signing's own CLI, offline, in one process: (exit code, output) each."""
    out = subprocess.run(offline([sys.executable, "-c", RUN_CLI, json.dumps(argvs)]), capture_output=True, text=True,
                         timeout=120, check=True)
    return [(code, text) for code, text in json.loads(out.stdout)]
