"""``ckptfix inspect``, ``scan`` and ``convert`` of https:// and s3:// URLs: --json's bytes_fetched, exit codes, and
each failure of issue 19 as one ``Error:`` line, exit 1, nothing on stdout (and for convert, nothing written). The
servers are tests/remote_servers.py's, the failures tests/ops/test_remote.py's ERRORS (each a switch of the HTTP
server) and tests/ops/test_remote_convert.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.file_server import FileServer
from tests.remote_servers import S3Server, http_server, s3_server
from tests.remote_sources import (ERRORS, NAMES, Payload, corrupt_record, failing, file_bytes, masked, one_error_line, remote,
                                  write_checkpoints, write_sources)

import ckptfix

from ckptfix.cli import cli

ROOT = Path(__file__).resolve().parents[2]
SERVERS = (http_server, s3_server)  # the fixtures, registered by being in this module's namespace


@pytest.mark.parametrize("kind", ["zip", "safetensors", "sharded"])
def test_inspect_json_reports_bytes_fetched(cli_runner: Any, http_server: FileServer, kind: str) -> None:
    names = write_checkpoints(http_server.root)
    res = cli_runner.invoke(cli, ["inspect", "--json", http_server.url(names[kind])])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["bytes_fetched"] == file_bytes(http_server) > 0
    local = json.loads(cli_runner.invoke(cli, ["inspect", "--json", str(http_server.root / names[kind])]).stdout)
    assert "bytes_fetched" not in local  # a local file's object is as it was
    assert got["keys"] == local["keys"] and got["num_params"] == local["num_params"]
    text = cli_runner.invoke(cli, ["inspect", http_server.url(names[kind])]).stdout
    assert "fetched:" in text and "headers only" in text


def test_scan_s3_exit_codes(cli_runner: Any, s3_server: S3Server, tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    write_checkpoints(root)
    torch.save({"hook": Payload()}, root / "evil.pth")
    s3_server.upload(root, key="")
    ok = cli_runner.invoke(cli, ["scan", "--json", s3_server.url("model.pth")])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["bytes_fetched"] > 0, ok.output
    bad = cli_runner.invoke(cli, ["scan", s3_server.url("evil.pth")])
    assert bad.exit_code == 3 and "posix.system" in bad.stdout, bad.output


@pytest.mark.parametrize("command", ["inspect", "scan"])
@pytest.mark.parametrize("mode, file, error, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_each_failure_is_one_error_line(cli_runner: Any, http_server: FileServer, monkeypatch: pytest.MonkeyPatch,
                                        command: str, mode: str, file: str, error: type, message: str) -> None:
    url = failing(http_server, monkeypatch, mode, file)
    one_error_line(cli_runner.invoke(cli, [command, url]), url)


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_convert_json_reports_bytes_fetched(cli_runner: Any, request: pytest.FixtureRequest, tmp_path: Path,
                                            backend: str) -> None:
    src = remote(backend, request, tmp_path)
    url, dst = src.url(NAMES["ddp"]), tmp_path / "out.safetensors"
    res = cli_runner.invoke(cli, ["convert", "--json", url, str(dst)])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["bytes_fetched"] == src.sent() > 0 and got["wrappers_before"] == ["module"]
    assert masked(dst) == masked(Path(ckptfix.convert(src.root / NAMES["ddp"], tmp_path / "l.safetensors").dst))
    local = json.loads(cli_runner.invoke(cli, ["convert", "--json", str(src.root / NAMES["ddp"]),
                                               str(tmp_path / "l2.safetensors")]).stdout)
    assert "bytes_fetched" not in local  # a local source's object is as it was
    text = cli_runner.invoke(cli, ["convert", url, str(tmp_path / "t.safetensors")])
    assert text.exit_code == 0 and "fetched: " in text.stdout and url in text.stdout, text.output


@pytest.mark.parametrize("case, message", [("404", "no such file (HTTP 404)"),
                                           ("damaged", "does not match the CRC-32 its zip records"),
                                           ("dtype", "converting it needs a local copy (--dtype bf16")])
def test_convert_failures_are_one_error_line(cli_runner: Any, http_server: FileServer, tmp_path: Path,
                                             case: str, message: str) -> None:
    write_sources(http_server.root)
    url, args = http_server.url(NAMES["ddp"]), []
    if case == "404":
        url = http_server.url("nope.pth")
    elif case == "damaged":
        corrupt_record(http_server.root / NAMES["ddp"])
    else:
        args = ["--dtype", "bf16"]
    res = cli_runner.invoke(cli, ["convert", url, str(tmp_path / "out.safetensors"), *args])
    one_error_line(res, url)
    assert message in res.stderr
    assert os.listdir(tmp_path) == ["http"]  # no output, no temp file


def test_inspect_url_in_a_real_process(http_server: FileServer) -> None:
    """The installed entry point's path: one real subprocess."""
    names = write_checkpoints(http_server.root)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "ckptfix", "inspect", "--json", http_server.url(names["zip"])],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["bytes_fetched"] == file_bytes(http_server)


def test_verify_and_diff_of_a_url(cli_runner: Any, http_server: FileServer, fixtures_dir: Path) -> None:
    """``verify URL --model`` and ``diff URL local`` read the URL as the local file: the same verdict and values;
    verify's fix writes a local file named after the remote one."""
    for name in ("mlp_ddp.pth", "mlp_single.pth"):
        (http_server.root / name).write_bytes((fixtures_dir / name).read_bytes())
    url, model = http_server.url("mlp_ddp.pth"), str(fixtures_dir / "train.py") + ":mlp"
    res = cli_runner.invoke(cli, ["verify", "--json", url, "--model", model])
    local = cli_runner.invoke(cli, ["verify", "--json", str(http_server.root / "mlp_ddp.pth"), "--model", model])
    assert res.exit_code == local.exit_code == 0, res.output
    got, want = json.loads(res.stdout), json.loads(local.stdout)
    assert got["convert_command"] == f"ckptfix convert {url} mlp_ddp.fixed.pth --to single"
    assert got["ok"] and got["fix"] == want["fix"] == "strip module."
    here = {n: str(http_server.root / n) for n in ("mlp_ddp.pth", "mlp_single.pth")}
    for a, b in (([url, here["mlp_single.pth"]], [here["mlp_ddp.pth"], here["mlp_single.pth"]]),
                 ([url, url], [here["mlp_ddp.pth"]] * 2)):
        remote_diff = cli_runner.invoke(cli, ["diff", "--json", *a])
        local_diff = cli_runner.invoke(cli, ["diff", "--json", *b])
        assert remote_diff.exit_code == local_diff.exit_code, remote_diff.output
        got, want = json.loads(remote_diff.stdout), json.loads(local_diff.stdout)
        for d in (got, want):
            d.pop("a", None), d.pop("b", None)
        assert got == want
