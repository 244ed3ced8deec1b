"""bench/verify.py runs end to end on a tiny model and produces both rows (a .pth and a .safetensors file), so it
can't rot between the runs that fill bench/RESULTS.md (its targets are measured there, at 1 GiB, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the bench samples RssAnon from /proc (Linux)")
def test_bench_verify_produces_every_row(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "verify.py"), "--size-mib", "1", "--width", "32",
                          "--rounds", "1", "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "verify.json")],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and (tmp_path / "verify.json").exists(), out.stderr[-3000:]
    rows = json.loads((tmp_path / "verify.json").read_text())["rows"]
    assert [row["file"] for row in rows] == ["m.pth", "m.safetensors"]
    for row in rows:
        assert row["plain_s"][0] > 0 and row["ckptfix_s"][0] > 0 and row["ratio"] > 0, row
        assert row["plain_peak_mib"] > 0 and row["ckptfix_peak_mib"] > 0 and row["status"] in ("ok", "over target")
        assert f"| {row['file']} (" in out.stdout
