"""The gate's checks of quantized groups (issue 28), both model-free: every group intact — each weight with its
scales, no orphan scale, grids and packed sizes right, scale values valid — and finite after dequantization; with
``original``, each dequantized weight against the unquantized one, within the scheme's step bound.

They fill the report's ``quantization``: ``{groups, schemes: {name: count}, problems: [{module, key, message}],
unknown: [key], nonfinite: [module], original: null | {path, tensors: [{key, module, scheme, max_abs_diff, …}]}}``.
"""

from __future__ import annotations

import os
from typing import Any

from ..ops import api, quant_compare
from ..statedict import quant_dequant, quant_groups
from .findings import Findings, VerifyReport
from .gate import FileGate, model_free


def _where(problem: Any) -> str:
    return f"quantized {problem.module or problem.key}: {problem.message}"


@model_free
def quantized_groups(gate: FileGate, report: VerifyReport) -> Findings:
    """Every quantized group intact (the layout's problems, then each group's values: ``check_values``) and, with
    values, its dequantized weight free of NaN/Inf; a failure per broken module, naming it."""
    q = gate.quant
    if q.layout is None:
        return Findings()
    problems = list(q.layout.problems)
    found, nonfinite = Findings(), []
    if gate.with_values:
        sd = gate.ckpt.state_dict
        with gate.phase("quantized"):
            laid_out_wrong = {p.module for p in problems}
            for group in (g for g in q.groups if g.module not in laid_out_wrong):  # values read only when laid out right
                bad = quant_groups.check_values(group, sd)
                problems += bad
                if not bad and not bool(quant_dequant.dequantize(group, sd).isfinite().all()):
                    nonfinite.append(group.module)
    found.failures += [_where(p) for p in problems]
    found.failures += [f"quantized {m}: NaN/Inf in the dequantized weight" for m in nonfinite]
    if q.layout.unknown:
        found.warnings.append(f"{len(q.layout.unknown)} tensors look quantized (float8 or packed integers beside "
                              f"*scale* tensors) but match no scheme ckptfix knows; not checked: "
                              + ", ".join(q.layout.unknown[:5]) + (" …" if len(q.layout.unknown) > 5 else ""))
    found.fields["quantization"] = {
        "groups": len(q.groups), "schemes": q.layout.counts(),
        "problems": [{"module": p.module, "key": p.key, "message": p.message} for p in problems],
        "unknown": list(q.layout.unknown), "nonfinite": nonfinite, "original": None}
    return found


@model_free
def against_original(gate: FileGate, report: VerifyReport) -> Findings:
    """With ``original``: each intact group's dequantized weight against the original's, per-tensor max, mean and
    relative error; beyond the scheme's step bound (round-to-nearest) or ``atol``/``rtol`` (where given) fails."""
    o = gate.options
    if o.original is None:
        return Findings()
    if not gate.with_values:
        return Findings(notes=["--original not compared: read on meta (no values)"])
    orig = api.load(o.original, map_location="cpu", trust=o.trust)
    broken = {p["module"] for p in (report.quantization or {}).get("problems", [])}
    rows, found = [], Findings()
    with gate.phase("original"):
        for group in gate.quant.groups:
            if group.module in broken:
                continue
            key = quant_compare.original_key(group, orig)
            if key is None:
                found.failures.append(f"quantized {group.module}: the original {os.fspath(o.original)} has no "
                                      f"{group.module}.weight to compare with")
                continue
            row = {"key": key, **quant_compare.compare(group, gate.ckpt.state_dict, orig[key], o.atol, o.rtol)}
            rows.append(row)
            if row["ok"] is False:
                found.failures.append(quant_compare.failed_line(key, row))
    if not gate.quant.groups:
        found.notes.append(f"--original {os.fspath(o.original)}: the file holds no quantized group to compare")
    reported = [r for r in rows if r["tolerance"] == "reported"]
    if reported:
        found.notes.append(f"{len(reported)} weights of error-compensating schemes (GPTQ, AWQ, rotated) reported, not "
                           "judged: they hold no step bound; pass --atol/--rtol to judge them")
    quant = dict(report.quantization or {"groups": 0, "schemes": {}, "problems": [], "unknown": [], "nonfinite": []})
    found.fields["quantization"] = {**quant, "original": {"path": os.fspath(o.original), "tensors": rows}}
    return found
