"""bench/load.py runs end to end on a tiny model and produces every row, so it can't rot between the runs
that fill bench/RESULTS.md."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptfix

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _cases() -> list[tuple[str, str]]:
    """bench/load.py's rows (id, label), from the script itself (its helpers imported by their bare names)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("ckptfix_bench_load", BENCH / "load.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        for name in ("measure", "load_report", "first_call", "ckptfix_bench_load"):
            sys.modules.pop(name, None)
    return [(case.id, case.label) for case in module.CASES]


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """bench/load.py run with ``args`` (its files in ``tmp_path``): the process and its --json."""
    out = subprocess.run([sys.executable, str(BENCH / "load.py"), *args, "--workdir", str(tmp_path / "work"),
                          "--json", str(tmp_path / "load.json")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (tmp_path / "load.json").exists(), out.stderr[-3000:]
    return out, json.loads((tmp_path / "load.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/status").exists(),
                    reason="the bench measures with /proc and posix_fadvise (Linux)")
def test_bench_load_produces_every_row(tmp_path: Path) -> None:
    out, report = _bench(tmp_path, "--size-mib", "1", "--width", "256", "--rounds", "1")
    rows = {row["id"]: row for row in report["rows"]}
    cases = _cases()
    assert list(rows) == [case_id for case_id, _ in cases]
    for case_id, label in cases:  # every row in the markdown table too
        assert f"| {label} | " in out.stdout, case_id
    has_runai = importlib.util.find_spec("runai_model_streamer") is not None
    # the rows that need issue 18's load_into (check_values, meta models, DTensors) pass once it is there
    rewritten = "check_values" in inspect.signature(ckptfix.load_into).parameters
    for case_id, row in rows.items():
        if case_id == "st.runai" and not has_runai:
            assert row["status"].startswith("skipped: runai-model-streamer is not installed")
            continue
        if "ckptfix" in case_id and not rewritten:
            continue
        assert row["status"] == "ok", (case_id, row["status"], row.get("traceback"))
        evicted = not any(rows[i]["cold"]["cold_not_possible"] for i in (case_id, row["vs"], "floor"))
        for mode in ("warm", "cold"):
            assert len(row[mode]["runs"]) == 1 and row[mode]["median"] > 0, (case_id, mode)
            if mode == "warm" or evicted:  # (tmpfs keeps its files: no cold figure there, the row says so)
                assert row[mode]["ratio"] is not None and row[mode]["ratio"] > 0, (case_id, mode)
                assert row[mode]["floor_ratio"] is not None and row[mode]["floor_ratio"] > 0, (case_id, mode)
        if row["cold"]["cold_not_possible"]:
            assert f"| {row['label']} | {row['file']} | cold not possible (" in out.stdout, case_id
        assert row["peak_anon_mib"] > 0 and row["growth_mib"] is not None and row["over_anchor_mib"] is not None
    assert out.returncode == (0 if rewritten else 1), out.stderr[-3000:]
    assert rows["pth.ckptfix"]["target"] == 1.25 and rows["meta.ckptfix"]["vs"] == "st.load_model"


def _report_module() -> Any:
    """bench/load_report.py (standard library only: no torch, no run)."""
    spec = importlib.util.spec_from_file_location("ckptfix_bench_load_report", BENCH / "load_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stayed", ["none", "row", "anchor", "floor"])
def test_cold_rows_are_marked_where_the_file_stayed_cached(stayed: str) -> None:
    """A cold run whose file stayed in the page cache (bench/measure.drop_from_page_cache's mincore count) gives no
    cold figure: its row says "cold not possible", the rows whose ratio is to it (its anchor's, the floor's) have
    none; the warm figures stand."""
    report = _report_module()
    ids = {"row": "b", "anchor": "a", "floor": "floor"}
    rows = [{"id": i, "group": "g", "label": f"label {i}", "file": "m", "model": "cpu", "vs": v, "target": 1.25,
             "mem_target": False} for i, v in (("floor", "floor"), ("a", "a"), ("b", "a"))]
    seconds = {"floor": 1.0, "a": 2.0, "b": 3.0}
    runs = {(i, mode): [{"seconds": s * (2 if mode == "cold" else 1), "peak": 1, "growth": 0, "after": 0,
                         "stayed_cached": 5 * 2**20 if mode == "cold" and ids.get(stayed) == i else 0}]
            for i, s in seconds.items() for mode in ("warm", "cold")}
    out = report.summarise(rows, runs, {"modes": ["warm", "cold"]})
    b = {r["id"]: r for r in out["rows"]}["b"]
    assert (b["warm"]["ratio"], b["warm"]["floor_ratio"], b["warm"]["cold_not_possible"]) == (1.5, 3.0, None)
    cold = b["cold"]
    assert cold["cold_not_possible"] == ("5.0 MiB stayed in the page cache" if stayed == "row" else None)
    assert cold["ratio"] == (None if stayed == "anchor" else 1.5)
    assert cold["floor_ratio"] == (None if stayed == "floor" else 3.0)
    assert cold["ratio_met"] is (None if stayed in ("row", "anchor") else False)
    setup = {"modes": ["warm", "cold"], "width": 8, "size_mib_arg": 1, "rounds": 1, "machine": "m", "torch": "t",
             "safetensors": "s", "layers": 1, "size_mib": 1.0, "load_into": "l"}
    table = report.render_markdown({"setup": setup, "rows": out["rows"]})
    line = next(x for x in table.splitlines() if x.startswith("| label b |"))
    assert ("cold not possible (5.0 MiB stayed in the page cache)" in line) is (stayed == "row")
    assert ("marked cold not possible: " in table) is (stayed != "none")


@pytest.mark.slow
def test_bench_first_call_mode_produces_every_row(tmp_path: Path) -> None:
    """``--modes first-call`` at a tiny size: every row loads bit for bit in its fresh process, each ckptfix row has its
    ms above the plain loader of its file, and after the warm-up (``from ckptfix import load_into``) no call imports."""
    out, report = _bench(tmp_path, "--modes", "first-call", "--size-mib", "0.05", "--rounds", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rows" not in report  # the forked rows weren't asked for
    rows = {row["id"]: row for row in report["first_call"]["rows"]}
    assert list(rows) == ["st.plain", "st.ckptfix", "st.ckptfix.unchecked", "st.ckptfix.numpy", "st.ckptfix.meta", "pth.plain",
                          "pth.ckptfix", "pth.ckptfix.meta"]
    for case_id, row in rows.items():
        assert row["status"] == "ok", (case_id, row["status"])
        assert len(row["runs_ms"]) == 1 and row["median_ms"] > 0 and row["cpu_ms"] >= 0, case_id
        assert f"| {row['label']} | {row['file']} | {row['model']} | " in out.stdout, case_id
        if "ckptfix" in case_id:
            assert row["vs"] == f"{case_id.split('.')[0]}.plain" and None not in (row["above_ms"], row["cpu_above_ms"]), case_id
            assert row["imported"] == [], (case_id, row["imported"])
    assert rows["st.ckptfix.unchecked"]["met"] is None  # (what the check costs: the bound is the checked row's)
    assert rows["st.ckptfix.numpy"]["met"] is None  # (a build without the kernels: no bound either)
    assert isinstance(rows["st.ckptfix"]["met"], bool)
    assert report["first_call"]["setup"]["tensors"] == 148


@pytest.mark.parametrize("script", ["cast_load.py", "load_gpu.py"])
def test_the_cast_and_gpu_benches_run(script: str) -> None:
    """bench/cast_load.py on a tiny file: every row timed and printed (its loads checked against the file); without a
    GPU, bench/load_gpu.py says it measured nothing rather than failing."""
    args = ["--size-mib", "8", "--rounds", "1"] if script == "cast_load.py" else ["--size-mib", "16", "--runs", "1"]
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    if script == "load_gpu.py" and "needs CUDA" in out.stdout:
        return
    rows = [line for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| row ", "| group "))]
    assert len(rows) == (6 if script == "cast_load.py" else 11), out.stdout


def test_the_ties_bench_runs(tmp_path: Path) -> None:
    """bench/ties.py on a small tied embedding: every row timed (each load into the tied model succeeds)."""
    out = subprocess.run([sys.executable, str(BENCH / "ties.py"), "--vocab", "512", "--dim", "64", "--rounds", "1",
                          "--busy", "1", "--json", str(tmp_path / "ties.json")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "ties.json").read_text())["rows"]
    assert [r["id"] for r in rows] == ["floor", "load_model", "once", "digests", "clones", "plain_clones"]
    assert all(r["s"] > 0 for r in rows)
