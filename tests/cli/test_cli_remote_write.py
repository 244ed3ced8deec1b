"""``ckptfix convert SRC s3://BUCKET/KEY`` (issue 19 item 4) on the command line: the report names the URL and the
bytes uploaded, each refusal and failure is one ``Error:`` line with exit 1 (a signal: 128+N), and nothing is left
at the key or in the bucket's multipart uploads. moto's real S3 server (tests/remote_servers.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.remote_servers import S3Server, s3_server
from tests.remote_uploads import failing_part, object_bytes, same_output, sources, uploads

from ckptfix.cli import cli

ROOT = Path(__file__).resolve().parents[2]
SERVERS = (s3_server,)  # the fixture, registered by being in this module's namespace


def test_convert_to_s3_reports_the_url_and_bytes(cli_runner: Any, s3_server: S3Server, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_UPLOAD_PART_SIZE", str(5 * 2**20))
    src = sources(tmp_path, 12)["pth"]
    url = s3_server.url("out.safetensors")
    res = cli_runner.invoke(cli, ["convert", "--json", str(src), url])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    # (--json hashes the source, which the lineage then names: the local output made the same way)
    assert cli_runner.invoke(cli, ["convert", "--json", str(src), str(tmp_path / "out.safetensors")]).exit_code == 0
    local = (tmp_path / "out.safetensors").read_bytes()
    assert got["dst"] == url and got["bytes_written"] == len(local)
    assert same_output(object_bytes(s3_server, "out.safetensors"), local)
    assert any(n.startswith(f"uploaded {len(local)} bytes to {url} (3 parts)") for n in got["notes"])
    again = cli_runner.invoke(cli, ["convert", str(src), url])
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr == f"Error: {url}: already exists; pass --force (library: force=True) to replace it\n"
    forced = cli_runner.invoke(cli, ["convert", "--force", str(src), url])
    assert forced.exit_code == 0 and forced.stdout.startswith(f"Wrote {url} (safetensors)"), forced.output


@pytest.mark.parametrize("dst, message", [
    ("https://example.com/out.safetensors", "an http(s) URL can't be written"),
    ("hf://org/name/out.safetensors", "huggingface-cli upload"),
    ("s3://ckpt/shards", "not a sharded or DCP directory"),
])
def test_unwritable_destination_is_one_error_line(cli_runner: Any, s3_server: S3Server, tmp_path: Path, dst: str,
                                                  message: str) -> None:
    src = sources(tmp_path, 1)["pth"]
    res = cli_runner.invoke(cli, ["convert", str(src), dst, "--max-shard-size", "1MB"] if "shards" in dst
                            else ["convert", str(src), dst])
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert res.stderr.startswith(f"Error: {dst}: ") and message in res.stderr and res.stderr.count("\n") == 1


def test_sigterm_mid_upload_is_one_line_and_nothing_left(cli_runner: Any, s3_server: S3Server, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_UPLOAD_PART_SIZE", str(5 * 2**20))
    src = sources(tmp_path, 12)["safetensors"]

    def terminate() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)

    failing_part(monkeypatch, 2, terminate)
    res = cli_runner.invoke(cli, ["convert", str(src), s3_server.url("out.pth")])
    assert res.exit_code == 128 + signal.SIGTERM and res.stdout == ""
    assert res.stderr == "Error: terminated (SIGTERM); nothing was written\n"
    assert object_bytes(s3_server, "out.pth") is None and uploads(s3_server) == []


def test_subprocess_convert_to_s3(s3_server: S3Server, tmp_path: Path) -> None:
    """The installed command, its environment the standard AWS one (AWS_ENDPOINT_URL …): exit 0, then exit 1."""
    src = sources(tmp_path, 1)["pth"]
    url = s3_server.url("sub/out.safetensors")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "ckptfix", "convert", str(src), url]
    first = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0 and first.stdout.startswith(f"Wrote {url}"), first.stderr
    second = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 1 and second.stderr.count("\n") == 1 and "already exists" in second.stderr
