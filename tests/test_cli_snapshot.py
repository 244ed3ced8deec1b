"""tools/cli_snapshot.py's masks (the script itself runs every command for minutes; no test runs it): only what
varies run to run is masked, so a changed line of CLI output still shows."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "cli_snapshot.py"


@pytest.fixture(scope="module")
def snapshot() -> Any:
    spec = importlib.util.spec_from_file_location("cli_snapshot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("text, want", [
    ('"dst": "/tmp/ckptfix-snapshot-k2j4/out/3/o.pth",', '"dst": "<TMP>/out/3/o.pth",'),
    ('  "seconds": 0.137,\n  "peak_rss": 812335104,', '  "seconds": <SECONDS>,\n  "peak_rss": <PEAK_RSS>,'),
    ('"seconds": 1.5e-05', '"seconds": <SECONDS>'),
    ("Error: http://127.0.0.1:40123/x.pth: no such file", "Error: http://127.0.0.1:<PORT:http>/x.pth: no such file"),
    ("ckptfix verify: observe (1.5 s)\nckptfix verify: load (0.0 s)",
     "ckptfix verify: observe (<SECONDS> s)\nckptfix verify: load (<SECONDS> s)"),
])
def test_mask_replaces_what_varies(snapshot: Any, text: str, want: str) -> None:
    literals = {"/tmp/ckptfix-snapshot-k2j4": "<TMP>", "127.0.0.1:40123": "127.0.0.1:<PORT:http>"}
    assert snapshot.mask(text, literals) == want


@pytest.mark.parametrize("text", [
    "tensors:        6 (801 elements, 3.1 KiB)\n  fetched: 5.9 KiB (6,012 bytes, headers only)",
    '"bytes_read": 3204,\n  "sha256_in": "4dddd5d40360f1a83a5e5cdcbbd215b980870ce227fbffd152d136a3169b223d",',
    "Error: /tmp/other/x.pth: seconds 0.137, peak_rss 812335104 (not JSON keys); port 40123",
])
def test_mask_leaves_other_text_alone(snapshot: Any, text: str) -> None:
    assert snapshot.mask(text, {"/tmp/ckptfix-snapshot-k2j4": "<TMP>", "127.0.0.1:40123": "<PORT>"}) == text


@pytest.mark.parametrize("writer", ["torch.save", "ckptfix.convert"])
def test_serialization_id_fixed_keeps_a_valid_zip(snapshot: Any, tmp_path: Path, writer: str) -> None:
    """Two writes of one state dict are the same bytes once fixed (as before: both writers' ids are deterministic
    now, ckptfix's torch-free one drew it at random before; torch.save has a data descriptor after each record),
    every CRC-32 still right."""
    import torch

    import ckptfix

    sd = {"w": torch.arange(6.0).reshape(2, 3)}
    torch.save(sd, tmp_path / "src.pth")
    fixed = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "m.pth"
        torch.save(sd, path) if writer == "torch.save" else ckptfix.convert(tmp_path / "src.pth", path)
        fixed.append(snapshot.fixed_serialization_id(path.read_bytes()))
        path.write_bytes(fixed[-1])
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None
            assert z.read("m/.data/serialization_id").strip(b"0") == b""
        assert torch.equal(torch.load(path, weights_only=True)["w"], sd["w"])
    assert fixed[0] == fixed[1]
