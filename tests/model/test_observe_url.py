"""``verify --exact`` on a URL observes the serving loader too: the file fetched once into a private temp
directory (deleted after), statically scanned there, loaded by the real loader in its child process, and the
loader's tensors compared with ckptfix's read of the URL — a file changed between the two reads is a finding."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.cli import cli
from tests import observe_cases
from tests.file_server import FileServer
from tests.remote_servers import http_server

SERVERS = (http_server,)  # the fixture, registered by being in this module's namespace
SPEC_PY = "import torch\n\ndef lin():\n    torch.manual_seed(0)\n    return torch.nn.Linear(3, 2)\n"


@pytest.fixture
def served(http_server: FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileServer:
    (tmp_path / "spec.py").write_text(SPEC_PY)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(3, 2).state_dict(), http_server.root / "good.pth")
    torch.save(torch.nn.Linear(3, 2).state_dict(), http_server.root / "proto4.pth", pickle_protocol=4)
    (tmp_path / "private").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "private"))  # where the local copy goes (and is gone)
    return http_server


def _verify(cli_runner: Any, url: str, spec: Path) -> tuple[int, dict]:
    res = cli_runner.invoke(cli, ["verify", url, "--model", f"{spec}:lin", "--exact", "--json", "--quiet"])
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.parametrize("name, code", [("good.pth", 0), ("proto4.pth", 3)])
def test_a_url_is_observed_as_a_local_file_is(name: str, code: int, served: FileServer, tmp_path: Path,
                                              cli_runner: Any) -> None:
    got, report = _verify(cli_runner, served.url(name), tmp_path / "spec.py")
    assert got == code and report["observed"]["ok"] is (code == 0), report["failures"]
    if code:  # the loader's own refusal, named with the URL (not the temp copy's path)
        (line,) = [f for f in report["failures"] if f.startswith("exact: the serving loader failed as saved")]
        assert observe_cases.CASES["pickle-protocol-4"][2] in line and str(tmp_path / "private") not in line
    assert list((tmp_path / "private").iterdir()) == []  # the local copy deleted


def test_a_file_changed_between_the_reads_is_a_finding(served: FileServer, tmp_path: Path, cli_runner: Any) -> None:
    other = tmp_path / "other.pth"
    torch.save({k: v + 1 for k, v in torch.nn.Linear(3, 2).state_dict().items()}, other)
    served.change_after("good.pth", 3, other.read_bytes())  # after the static read's requests, the deploy lands
    code, report = _verify(cli_runner, served.url("good.pth"), tmp_path / "spec.py")
    assert code == 3 and any("changed at the URL between the two reads" in f for f in report["failures"]), report
