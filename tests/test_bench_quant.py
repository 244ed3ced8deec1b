"""bench/quant.py runs end to end on the committed quantized files (groups twice as tall) and produces every row, so
it can't rot between the runs that fill bench/RESULTS.md: each row ok (ckptfix's output and the library's own agree),
or skipped where the library is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cases() -> dict[str, str]:
    """bench/quant.py's rows: id → the library module its column needs (from the script itself)."""
    spec = importlib.util.spec_from_file_location("ckptfix_bench_quant", ROOT / "bench" / "quant.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return {case.id: case.library for case in module.CASES}


@pytest.mark.slow
def test_bench_quant_produces_every_row(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "quant.py"), "--factor", "2", "--rounds", "1",
                          "--json", str(tmp_path / "quant.json")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and (tmp_path / "quant.json").exists(), out.stdout[-2000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "quant.json").read_text())["rows"]
    cases = _cases()
    assert [r["id"] for r in rows] == list(cases)
    for row in rows:
        assert f"| {row['label']} | " in out.stdout
        assert row["groups"] > 0 and row["ckptfix_s"] > 0, row
        if importlib.util.find_spec(cases[row["id"]]) is not None:
            assert row["status"] == "ok" and row["library_s"] > 0 and row["ratio"] > 0, row
        else:
            assert row["status"] == f"skipped: {cases[row['id']]} is not installed", row
