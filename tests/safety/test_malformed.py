"""Malformed input: every broken file is exit 1 with one line naming the file and what is wrong.

No traceback, no output file, whatever the command. Files are made from real torch and
safetensors output, then damaged the way downloads and disks damage them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError


def _safetensors(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _torch_bytes(tmp: Path, legacy: bool = False) -> bytes:
    path = tmp / "src.pth"
    torch.save({"w": torch.arange(64.0), "b": torch.ones(8)}, path, _use_new_zipfile_serialization=not legacy)
    return path.read_bytes()


def _valid_safetensors(tmp: Path) -> bytes:
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, tmp / "v.safetensors")
    return (tmp / "v.safetensors").read_bytes()


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

# name → (bytes maker, what the one line must say)
CASES: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "empty": (lambda t: b"", "is empty (0 bytes)"),
    "random-bytes": (lambda t: bytes((i * 97 + 13) % 256 for i in range(4096)), "unknown format"),
    "truncated-zip": (lambda t: _torch_bytes(t)[:700], "truncated or corrupt zip"),
    "truncated-legacy-pickle": (lambda t: _torch_bytes(t, legacy=True)[:200], "truncated or corrupt"),
    "truncated-legacy-data": (lambda t: _torch_bytes(t, legacy=True)[:-40], "truncated"),
    "git-lfs-pointer": (lambda t: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32
                        + b"\nsize 1234567\n", "Git LFS pointer file"),
    "html-error-page": (lambda t: b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head></html>\n",
                        "HTML page"),
    "json-error-body": (lambda t: b'{"error": "Repository not found"}', "JSON document"),
    "safetensors-header-past-end": (lambda t: struct.pack("<Q", 10_000) + b'{"a": 1}', "runs past the end"),
    "safetensors-header-not-json": (lambda t: _safetensors(b"{not json at all}   "), "not valid JSON"),
    "safetensors-entry-not-a-tensor": (lambda t: _safetensors(b'{"a": 5}'), "needs dtype, shape and data_offsets"),
    "safetensors-deeply-nested": (lambda t: _safetensors(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                                  "not valid JSON"),
    "safetensors-overlap": (lambda t: _safetensors({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
                            "overlap"),
    "safetensors-out-of-bounds": (lambda t: _safetensors({"a": {**F32, "data_offsets": [0, 80]}}, bytes(8)),
                                  "fall outside the data"),
    "safetensors-shape-mismatch": (lambda t: _safetensors({"a": {**F32, "shape": [3]}}, bytes(8)),
                                   "byte range holds 8"),
    "safetensors-duplicate-key": (lambda t: _safetensors(b'{"a": ' + json.dumps(F32).encode() + b', "a": '
                                                         + json.dumps(F32).encode() + b"}", bytes(8)),
                                  "duplicate key 'a'"),
    "safetensors-truncated-data": (lambda t: _valid_safetensors(t)[:-4], "fall outside the data"),
}
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
