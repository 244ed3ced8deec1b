"""Malformed input the tests share: ``CASES``, broken files made from real torch and safetensors output the way
downloads and disks damage them, each with what its one-line error says (tests/safety/test_malformed.py); and
``mutations``, seeded damage to a real torch.save archive (tests/parse/test_readers_agree.py)."""

from __future__ import annotations

import io
import json
import random
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file


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


def mutations(seed: int, count: int) -> list[tuple[str, bytes]]:
    """Seeded damage to a real torch.save archive, aimed at what a reader parses: the end records, the
    central directory, local headers, the zip64 fields; plus truncations and appended bytes."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int64)}, buf)
    base = buf.getvalue()
    cd = base.find(b"PK\x01\x02")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        data = bytearray(base)
        kind = rng.choice(["directory", "end", "local", "truncate", "append", "swap"])
        if kind == "directory":
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(cd, len(data))] = rng.randrange(256)
        elif kind == "end":
            at = len(data) - rng.randint(1, 22)
            data[at] = rng.choice([0, 1, 0xFF, rng.randrange(256)])
        elif kind == "local":
            at = rng.choice([m.start() for m in re.finditer(b"PK\x03\x04", bytes(data))])
            data[at + rng.randrange(30)] = rng.randrange(256)
        elif kind == "truncate":
            data = data[: rng.randrange(len(data) - 200, len(data))]
        elif kind == "append":
            data += rng.choice([b"PK\x05\x06" + bytes(18), bytes(rng.randrange(1, 40)), b"PK\x06\x07" + bytes(16)])
        else:  # two central-directory entries swapped in order (names sorted differently)
            data = bytearray(base.replace(b"data/0", b"DATA/0", 1) if rng.random() < 0.5 else base)
            data[rng.randrange(cd, len(data))] ^= 1 << rng.randrange(8)
        out.append((f"{kind}-{i}", bytes(data)))
    return out
