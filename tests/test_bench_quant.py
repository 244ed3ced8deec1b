"""bench/quant.py runs end to end on the committed quantized files (rows twice as tall) and produces every row, so it
can't rot between the runs that fill bench/RESULTS.md: each row ok (ckptfix's output and compressed-tensors' own
agree), or skipped where compressed-tensors is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_quant_produces_every_row(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "quant.py"), "--factor", "2", "--rounds", "1",
                          "--json", str(tmp_path / "quant.json")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and (tmp_path / "quant.json").exists(), out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "quant.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["ct-fp8-block", "ct-fp8-channel", "ct-nvfp4", "ct-w4a16"]
    has_library = importlib.util.find_spec("compressed_tensors") is not None
    for row in rows:
        assert f"| {row['label']} | " in out.stdout
        assert row["groups"] > 0 and row["ckptfix_s"] > 0, row
        if has_library:
            assert row["status"] == "ok" and row["library_s"] > 0 and row["ratio"] > 0, row
        else:
            assert row["status"].startswith("skipped: compressed-tensors is not installed"), row
