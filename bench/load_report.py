"""bench/load.py's results: per-row medians and ratios (plain data, its ``--json``) and the markdown table.

Kept apart from the runs so it can be read without torch: ``summarise`` takes the rows as plain dicts and
the runs as bench/load.py recorded them ({"seconds", "peak", "growth", "stayed_cached"} or {"error"}).
"""

from __future__ import annotations

import statistics
from typing import Any

MIB = 2**20
MEM_TARGET_MIB = 64  # the bound on peak RssAnon above the plain loader's


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(rows: list[dict[str, Any]], runs: dict[tuple[str, str], list[dict[str, Any]]],
              setup: dict[str, Any]) -> dict[str, Any]:
    """One entry per row: status, per mode the seconds of every round, their median and the median of the
    per-round ratios to the row's anchor (``vs``), the peak RssAnon and its growth, the targets met."""
    modes = setup["modes"]
    out = []
    for row in rows:
        entry = dict(row)
        mine = [run for mode in modes for run in runs.get((row["id"], mode), [])]
        errors = [run for run in mine if run.get("error")]
        entry["status"] = (f"skipped: {row['skip']}" if row.get("skip") else
                           f"failed: {errors[0]['error']}" if errors else "ok")
        if errors and errors[0].get("traceback"):
            entry["traceback"] = errors[0]["traceback"]
        for mode in modes:
            secs = [run.get("seconds") for run in runs.get((row["id"], mode), [])]
            anchor = [run.get("seconds") for run in runs.get((row["vs"], mode), [])]
            ratios = [s / a for s, a in zip(secs, anchor) if s is not None and a]
            ratio = None if _stayed(runs, row["vs"], mode) else _median(ratios)
            floor = [run.get("seconds") for run in runs.get(("floor", mode), [])]
            floor_ratio = None if _stayed(runs, "floor", mode) else _median(
                [s / f for s, f in zip(secs, floor) if s is not None and f])
            done, base = [s for s in secs if s is not None], [a for a in anchor if a]
            stayed = _stayed(runs, row["id"], mode)
            missed = stayed > 0  # not evicted: no cold figure, whatever it measured
            entry[mode] = {"runs": secs, "median": _median(done), "ratio": ratio, "floor_ratio": floor_ratio,
                           "ratio_of_mins": min(done) / min(base) if done and base else None,
                           "ratio_met": None if row["target"] is None or ratio is None or missed
                           else ratio <= row["target"],
                           "cold_not_possible": f"{stayed / MIB:.1f} MiB stayed in the page cache" if missed else None}
        ok = [run for run in mine if "peak" in run]
        entry["peak_anon_mib"] = max(run["peak"] for run in ok) / MIB if ok else None
        entry["growth_mib"] = max(run["growth"] for run in ok) / MIB if ok else None
        entry["stayed_cached_mib"] = max((run["stayed_cached"] for run in ok), default=0) / MIB
        out.append(entry)
    peaks = {e["id"]: e["peak_anon_mib"] for e in out}
    for e in out:
        mine, theirs = peaks[e["id"]], peaks.get(e["vs"])
        e["over_anchor_mib"] = None if mine is None or theirs is None else mine - theirs
        e["mem_met"] = (None if not e["mem_target"] or e["over_anchor_mib"] is None
                        else e["over_anchor_mib"] <= MEM_TARGET_MIB)
    return {"setup": setup, "rows": out}


def _stayed(runs: dict[tuple[str, str], list[dict[str, Any]]], row_id: str, mode: str) -> int:
    """Bytes of the file that stayed in the page cache in the row's cold runs (0 in the other modes): not 0, the
    row has no cold figure, nor the rows whose ratio is to it."""
    if not mode.startswith("cold"):
        return 0
    return max((run.get("stayed_cached") or 0 for run in runs.get((row_id, mode), [])), default=0)


def _mark(met: bool | None) -> str:
    return "" if met is None else " ✓" if met else " ✗"


def render_markdown(report: dict[str, Any]) -> str:
    """The tables, one per group of rows that share an anchor, under a line that says what was run where."""
    s, rows = report["setup"], report["rows"]
    modes = s["modes"]
    width = "" if s["width"] == 2048 else f" --width {s['width']}"
    lines = [
        "## `ckptfix.load_into` against the plain loaders (issue 18)",
        "",
        f"`python bench/load.py --size-mib {s['size_mib_arg']:g}{width} --rounds {s['rounds']} --modes {' '.join(modes)}` on "
        f"{s['machine']}; torch {s['torch']}, safetensors {s['safetensors']}. Model {s['layers']} × "
        f"Linear({s['width']}, {s['width']}) fp32, {s['size_mib']:.0f} MiB file; `{s['load_into']}`. Each run a fresh "
        f"process (forked from a server that imported torch and ckptfix), model built and the loader run once on a "
        f"tiny file before the timer; median of {s['rounds']} alternating rounds; × = median of the per-round ratios "
        f"to the anchor; peak RssAnon sampled every 5 ms during the load. Warm: the file read once before; cold: "
        f"`os.sync()` + POSIX_FADV_DONTNEED on it first; -busy: {s.get('busy', 2)} CPU-bound processes spinning beside "
        f"the run, started before it; × floor: the median of the per-round ratios to the floor row.",
    ]
    by_id = {r["id"]: r for r in rows}
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        lines += ["", f"### {group} (anchor: {by_id[members[0]['vs']]['label']})", "",
                  "| row | file | " + " | ".join(f"{m} (s) | {m} × | {m} × floor" for m in modes)
                  + " | target | peak RssAnon growth (MiB) | peak − anchor's (MiB) |",
                  "|---|---|" + "---:|---:|---:|" * len(modes) + "---|---:|---:|"]
        for r in members:
            target = "" if r["target"] is None else f"≤ {r['target']:g}×"
            if target and r["vs"] != members[0]["id"]:  # a ratio to another group's row
                target += f" {by_id[r['vs']]['label']} ({by_id[r['vs']]['group']})"
            if r["mem_target"]:
                target += f", ≤ +{MEM_TARGET_MIB} MiB"
            if r["status"] != "ok":
                cells = [r["status"].replace("|", "\\|")] + ["–"] * (3 * len(modes) - 1)
                lines.append(f"| {r['label']} | {r['file']} | " + " | ".join(cells) + f" | {target} | – | – |")
                continue
            cells = []
            for m in modes:
                if r[m].get("cold_not_possible"):  # (its anchor's and the floor's ratios would be no cold figure)
                    cells += [f"cold not possible ({r[m]['cold_not_possible']})", "–", "–"]
                    continue
                ratio = r[m]["ratio"]
                anchor_row = r["id"] == r["vs"]
                floor = r[m]["floor_ratio"]
                cells += [f"{r[m]['median']:.3f}", "anchor" if anchor_row else
                          "–" if ratio is None else f"{ratio:.2f}{_mark(r[m]['ratio_met'])}",
                          "–" if floor is None else f"{floor:.2f}"]
            over = "–" if r["over_anchor_mib"] is None else f"{r['over_anchor_mib']:+.0f}{_mark(r['mem_met'])}"
            lines.append(f"| {r['label']} | {r['file']} | " + " | ".join(cells)
                         + f" | {target} | {r['growth_mib']:.0f} | {over} |")
    stayed = [r for r in rows if r.get("stayed_cached_mib")]
    if stayed:
        lines += ["", "Cold runs where part of the file stayed in the page cache after `os.sync()` + POSIX_FADV_DONTNEED "
                  "(checked with mincore; mapped elsewhere, or tmpfs), marked cold not possible: "
                  + ", ".join(f"{r['id']} {r['stayed_cached_mib']:.0f} MiB" for r in stayed) + "."]
    return "\n".join(lines) + "\n"


def summarise_first_call(result: dict[str, Any]) -> dict[str, Any]:
    """bench/first_call.py's runs per row: the median call (wall and CPU), the median over rounds of the call minus the
    plain loader's in the same round ("ms above plain", against the issue's bound), the loader's import, and the
    modules any call imported."""
    runs, target = result["runs"], result["setup"]["target_ms"]
    out = []
    for row in result["rows"]:
        entry, mine = dict(row), runs[row["id"]]
        errors = [run["error"] for run in mine if run.get("error")]
        entry["status"] = f"failed: {errors[0]}" if errors else "ok"
        ms = [run["seconds"] * 1000 if "seconds" in run else None for run in mine]
        plain = [run["seconds"] * 1000 if "seconds" in run else None for run in runs[row["vs"]]]
        above = _median([m - p for m, p in zip(ms, plain) if m is not None and p is not None])
        cpu, plain_cpu = ([run["cpu"] * 1000 if "cpu" in run else None for run in runs[i]] for i in (row["id"], row["vs"]))
        entry.update(runs_ms=ms, median_ms=_median([m for m in ms if m is not None]), above_ms=above,
                     cpu_ms=_median([c for c in cpu if c is not None]),
                     cpu_above_ms=_median([c - p for c, p in zip(cpu, plain_cpu) if c is not None and p is not None]),
                     import_ms=_median([run["verb_import"] * 1000 for run in mine if "verb_import" in run]),
                     imported=sorted({m for run in mine for m in run.get("imported", [])}),
                     met=None if row["id"] == row["vs"] or above is None or not row.get("bounded", True)
                     else above <= target)
        out.append(entry)
    return {"setup": result["setup"], "rows": out}


def render_first_call(report: dict[str, Any], machine: str) -> str:
    """The first-call table under a line that says how it was measured."""
    s = report["setup"]
    lines = [
        "## The first call in a fresh process (issue 29)", "",
        f"`python bench/load.py --modes first-call --size-mib {s['size_mib_arg']:g} --rounds {s['rounds']}` on {machine}. "
        f"GPT-2-shaped model ({s['tensors']} tensors, width {s['shape'][0]}), {s['size_mib']:.0f} MiB fp32 file. Each run "
        "a fresh process; before the clock: torch, safetensors, ckptfix and the row's loader imported (`from ckptfix "
        "import load_into`: the warm-up), the model built, the file read once (warm). Only the call is timed; median of "
        f"{s['rounds']} alternating rounds; ms above plain: median of the per-round differences (bound ≤ "
        f"{s['target_ms']:g} ms); CPU: all of the process's threads during the call (on a shared machine the steadier "
        "figure).", "",
        "| row | file | model | call (ms) | ms above plain | CPU (ms) | CPU ms above plain | loader's import (ms) "
        "| imported by the call |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['file']} | {r['model']} | {r['status']} | – | – | – | – | – |")
            continue
        above = ("anchor" if r["id"] == r["vs"] else "–" if r["above_ms"] is None
                 else f"{r['above_ms']:+.1f}{_mark(r['met'])}")
        cpu_above = "anchor" if r["id"] == r["vs"] else "–" if r["cpu_above_ms"] is None else f"{r['cpu_above_ms']:+.1f}"
        imported = ", ".join(r["imported"]) or "none"
        lines.append(f"| {r['label']} | {r['file']} | {r['model']} | {r['median_ms']:.1f} | {above} | {r['cpu_ms']:.1f} "
                     f"| {cpu_above} | {r['import_ms']:.1f} | {imported} |")
    return "\n".join(lines) + "\n"
