"""Every text rendering of ckptfix in one place: what ``inspect``, ``convert``, ``scan``, ``verify`` and
``diff`` print without ``--json`` (``VerifyReport.format_text()`` and ``DiffReport.format_text()`` are these).

Each function takes a report (or a Checkpoint's ``to_dict()``) and returns the text; the CLI echoes it.
Sizes and dtype names come from :mod:`ckptfix.core.units`, grouped key lists from :func:`group_keys`. A name
from the file (a key, a global, an entry) is shown through :func:`~ckptfix.core.units.shown`: escaped and cut.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .core.units import SHOWN_ITEMS, few, human_size, listed, shown
from .parse.format_registry import FORMATS
from .statedict.repair import group_keys


def _format_layout(fmt: str) -> str | None:
    spec = FORMATS.get(fmt)
    return spec.inspect_layout if spec is not None else None


def counts(d: dict[str, int]) -> str:
    """``float32 ×4, int64 ×1``: a count per name, or ``-``."""
    return ", ".join(f"{k} ×{v}" for k, v in d.items()) or "-"


def stack(wrappers: list[str]) -> str:
    """``module._orig_mod.`` for a wrapper stack, ``none`` for none."""
    return ".".join(wrappers) + "." if wrappers else "none"


def inspect_text(info: dict[str, Any], all_keys: bool = False, head: int = 5) -> str:
    """``ckptfix inspect``'s summary from a Checkpoint's ``to_dict()``: one row per fact, then the keys
    (the first and last ``head``; every key with ``all_keys``)."""
    lines: list[str] = []
    whole = "the whole checkpoint" if os.path.isdir(info["path"]) else "the whole file"
    where = f"at {shown(repr(info['state_dict_key']))}" if info["state_dict_key"] else whole
    if info.get("no_state_dict") is not None or not info["num_keys"]:
        where = "none (see the note)" if info.get("no_state_dict") is not None else f"{where} (empty: no tensors)"
    rows = [
        ("path", info["path"]),
        ("format", info["format"]),
        ("state dict", where + (f" (EMA weights also at: {few(info['ema_keys'], SHOWN_ITEMS)})" if info["ema_keys"] else "")),
        ("layout", (f"{info['framework']} checkpoint" if info["framework"] else
                    _format_layout(info["format"]) or "plain")
         + (f"; every key starts with {shown(repr(info['common_prefix']))} (--strip-prefix {shown(info['common_prefix'])})"
            if info["common_prefix"] else "")),
        ("wrappers", stack(info["wrappers"])
         + (f"; inner: {', '.join(info['inner_wrappers'])}" if info["inner_wrappers"] else "")),
        ("tensors", f"{info['num_tensors']} ({info['num_params']:,} elements, {human_size(info['nbytes'])})"),
        ("dtypes", counts(info["dtypes"])),
        ("devices", counts(info["devices"]) + " (as saved)"),
    ]
    if info.get("bytes_fetched") is not None:
        rows.append(("fetched", f"{human_size(info['bytes_fetched'])} ({info['bytes_fetched']:,} bytes, headers only)"))
    rows += _provenance_rows(info)
    if info["extra"]:
        rows.append(("other entries", listed([f"{shown(k)}: {v}" for k, v in info["extra"].items()], SHOWN_ITEMS, "; ")))
    if info["non_tensor_keys"]:
        rows.append(("non-tensor keys", few(info["non_tensor_keys"], 10)))
    if "quantization" in info:
        rows.append(("quantization", quantization_row(info["quantization"])))
    for name, value in rows:
        lines.append(f"{name + ':':<16}{value}")
    if "quantization" in info:
        lines += quantization_lines(info["quantization"])
    rows = info["keys"]
    cut = not all_keys and len(rows) > 2 * head
    listing = [(shown(r["key"]), r) for r in (rows[:head] + rows[-head:] if cut else rows)]
    lines.append(f"keys ({info['num_keys']}" + (f"; the first and last {head}, --all lists every key" if cut else "")
                 + "):")
    width = max((len(key) for key, _ in listing), default=0)
    roles = quantized_roles(info.get("quantization"))
    for i, (key, row) in enumerate(listing):
        if cut and i == head:
            lines.append("  …")
        shape = "x".join("*" if n is None else str(n) for n in row["shape"]) if row["shape"] is not None else "-"
        layout = f" {row['layout']}" if "layout" in row else ""  # a sparse tensor's
        layout += f"  ({roles[row['key']]})" if row["key"] in roles else ""
        lines.append(f"  {key:<{width}}  [{shape}]  {shown(row['dtype'])}{layout}")
    for note in info["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def quantization_row(q: dict[str, Any]) -> str:
    """``fp8-block ×61 (fp8 by its config); 2 problems``: the groups per scheme, the config's quant_method."""
    method = f" ({q['quant_method']} by its config)" if q["quant_method"] else ""
    problems = f"; {len(q['problems'])} problem{'s' * (len(q['problems']) != 1)}" if q["problems"] else ""
    return f"{counts(q['schemes']) if q['schemes'] else 'no intact group'}{method}{problems}"


def quantized_roles(q: dict[str, Any] | None) -> dict[str, str]:
    """Each key of a quantized group → ``fp8-block weight`` / ``fp8-block scale``: what the key listing tags it."""
    roles: dict[str, str] = {}
    for group in (q or {}).get("groups", []):
        roles[group["weight"]] = f"{group['scheme']} weight"
        roles.update({key: f"{group['scheme']} {role}" for role, key in group["companions"].items()})
    return roles


def quantization_lines(q: dict[str, Any], most: int = 10) -> list[str]:
    """A line per problem (orphan scales, weights without theirs, wrong grids …) and per tensor that looks
    quantized but matches no scheme; the first ``most`` of each."""
    lines = [f"  problem: {shown(p['module'])}: {p['message']}" for p in q["problems"][:most]]
    if len(q["problems"]) > most:
        lines.append(f"  … and {len(q['problems']) - most} more problems (--json lists every one)")
    if q["unknown"]:
        lines.append(f"  unknown: {few([shown(k) for k in q['unknown']], most)} (float8 or packed integers beside a "
                     "scale no scheme knows)")
    return lines


def _provenance_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    """``digests`` and ``lineage`` rows, where the file records them (docs/digests.md)."""
    rows = []
    found = info.get("digests")
    if found is not None:
        rows.append(("digests", shown(found["error"]) if "error" in found else
                     f"{found['algorithm']}, {found['tensors']} tensors (verify checks them)"))
    lineage = info.get("lineage")
    if lineage is not None:
        source = lineage.get("source") if isinstance(lineage.get("source"), dict) else {}
        ident = ", ".join(f"{k} {shown(str(v))}" for k, v in source.items())
        rows.append(("lineage", f"ckptfix {shown(str(lineage.get('ckptfix')))}: "
                     f"{shown(str(lineage.get('transform') or '(no flags)'))} from {ident}"))
    return rows


def convert_text(report: Any) -> str:
    """``ckptfix convert``'s summary: what was written, the wrappers before and after, the notes."""
    lines: list[str] = []
    where = f" from {shown(repr(report.state_dict_key))}" if report.state_dict_key else ""
    lines.append(f"Wrote {report.dst} ({report.format_out}): {report.num_tensors} tensors, "
                 f"{human_size(report.nbytes)}{changed_bytes(report)}{where}")
    lines.append(f"  wrappers: {stack(report.wrappers_before)} -> {stack(report.wrappers_after)} ({report.renamed} keys renamed)")
    if getattr(report, "bytes_fetched", None) is not None:
        lines.append(f"  fetched: {human_size(report.bytes_fetched)} ({report.bytes_fetched:,} bytes) from {report.src}")
    if getattr(report, "signature", None) is not None:
        lines.append(f"  signed: {report.signature} (OpenSSF model signature)")
    for note in report.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def changed_bytes(report: Any) -> str:
    """`` (cast from 2.0 MiB)``, `` (dequantized 7 groups (fp8-block) to bfloat16, from 1.1 MiB)``: why the bytes
    written differ from SRC's (a dequantization: the groups, their schemes and dtype), or nothing where they don't."""
    q = getattr(report, "quantized", None) or {}
    if q.get("dequantized"):
        n, schemes = sum(q["dequantized"].values()), q["dequantized"]
        named = next(iter(schemes)) if len(schemes) == 1 else counts(schemes)
        return (f" (dequantized {n} group{'s' * (n != 1)} ({named}) to {q['dtype']}, "
                f"from {human_size(report.nbytes_in)})")
    return f" (cast from {human_size(report.nbytes_in)})" if report.nbytes != report.nbytes_in else ""


def scan_text(report: Any) -> str:
    """``ckptfix scan``'s verdict, the globals it found (unsafe first) and the findings."""
    lines: list[str] = []
    verdict = "clean" if report.ok else f"UNSAFE ({len(report.findings)} findings)"
    lines.append(f"{report.path} ({report.format}): {verdict}; {len(report.pickles)} pickle(s) walked")
    if report.globals:
        lines.append("globals:")
        globals_ = sorted(report.globals, key=lambda g: (g.category != "unsafe", g.name, g.where))
        names = [shown(g.name) for g in globals_]
        width = max(map(len, names))
        for g, name in zip(globals_, names):
            lines.append(f"  {g.category:<8} {name:<{width}}  {shown(g.where)}  ({', '.join(g.ops)})")
    if report.findings:
        lines.append("findings:")
        for f in report.findings:
            lines.append(f"  - {f.message}")
    if report.inert_globals:
        lines.append(f"read as inert data (keys and values; never imported): {few(report.inert_globals, SHOWN_ITEMS)}")
    if report.extractable:
        lines.append("torch.load(weights_only=False) would import and run these globals; ckptfix can still extract "
                     "the weights: it reads them as inert placeholders (never imported or called) and refuses "
                     "them only inside the state dict")
    return "\n".join(lines)


def verify_text(report: Any) -> str:
    """The readable summary: verdict, repair, then each problem with its keys, counts first."""
    spec = FORMATS.get(report.format)
    loader = spec.exact_loader if spec is not None and spec.exact_loader else "torch.load(weights_only=True)"
    mode = f"--exact: as {loader} + strict load_state_dict would load it" if report.exact else "repairs allowed"
    mode += f"; model in {report.model_dtype}" if report.model_dtype else ""
    mode += f"; serving device {report.serving_device}" if report.serving_device else ""
    mode += "; structure only: values not checked" if report.nonfinite is None else ""
    tolerated = f", {len(report.tolerated)} tolerated" if report.tolerated else ""
    verdict = "VERIFIED" if report.ok else "FAILED"
    if report.model is None:  # the model-free gate
        lines = [f"{verdict}: {report.checkpoint} (no model: the file alone{mode.partition('repairs allowed')[2]})"]
    else:
        lines = [f"{verdict}: {report.checkpoint} against {report.model} ({mode})",
                 f"  keys: {report.fix or 'as saved'}: {report.matched}/{report.total} keys match{tolerated}"]
    lines += verified_quantization(report.quantization)
    if report.exact and report.devices:
        lines.append(f"  devices: {counts(report.devices)} (where {loader} puts the tensors: as saved)")
    if report.convert_command:
        lines.append(f"  fix the file with: {report.convert_command}")
    for name, keys in (("missing", report.missing), ("unexpected", report.unexpected),
                       ("not a tensor", report.non_tensor), ("NaN/Inf", report.nonfinite or [])):
        if keys:
            lines.append(f"  {name} ({len(keys)}):")
            lines += [f"    {g}" for g in group_keys(keys)]
    if report.shape_mismatch:
        rows = report.shape_mismatch
        lines.append(f"  shape mismatch ({len(rows)}):")
        lines += [f"    {shown(r['key'])}: checkpoint {r['checkpoint']}, model {r['model']}" for r in rows[:20]]
        lines += [f"    … and {len(rows) - 20} more"] if len(rows) > 20 else []
    if report.dtype_mismatch:
        lines.append(f"  dtype mismatch ({len(report.dtype_mismatch)}){'' if report.exact else ' (warning: cast on load)'}:")
        by_cast: dict[str, list[str]] = {}
        for r in report.dtype_mismatch:
            by_cast.setdefault(f"checkpoint {r['checkpoint']}, model {r['model']}", []).append(r["key"])
        for cast, keys in by_cast.items():
            lines.append(f"    {cast} ({len(keys)}):")
            lines += [f"      {g}" for g in group_keys(keys)]
    for row in report.shared_mismatch:
        lines.append(f"  tied weights arrive as different tensors: {few(row['keys'], SHOWN_ITEMS)} ({row['reason']})")
    nbt = [r["key"] for r in report.tolerated if r["kind"] == "num_batches_tracked"]
    if nbt:
        lines.append(f"  tolerated ({len(nbt)}): missing num_batches_tracked (old BatchNorm checkpoint), set to 0: "
                     + few(nbt, 3))
    lines += [f"  tolerated: {shown(r['key'])}: {r['reason']}" for r in report.tolerated if r["kind"] != "num_batches_tracked"]
    for c in (report.forward or {}).get("against", []):
        diff = "output structure differs" if c["max_abs_diff"] is None else f"max abs diff {c['max_abs_diff']:.3g}"
        lines.append(f"  forward vs {c['what']} {c['path']}: {diff} ({'ok' if c['ok'] else 'DIFFERS'}; "
                     f"{describe_tolerance(c)}; {describe_recipe(c['input'])})")
    if report.golden and report.golden["action"] == "recorded":
        outs = ", ".join(f"{k} {v['dtype']} {'x'.join(map(str, v['shape']))}" for k, v in report.golden["outputs"].items())
        lines.append(f"  golden: recorded {outs} to {report.golden['path']} ({describe_recipe(report.golden['input'])})")
    lines += [f"  FAIL: {f}" for f in report.failures]
    lines += [f"  warning: {w}" for w in report.warnings]
    lines += [f"  suggestion: {s['text']}" for s in report.suggestions]
    lines += [f"  note: {n}" for n in report.notes]
    lines += [f"  sha256: {report.sha256}"] if report.sha256 else []
    return "\n".join(lines)


def verified_quantization(quant: dict[str, Any] | None) -> list[str]:
    """verify's quantized groups: their count per scheme, and each weight's error against ``--original``."""
    if not quant:
        return []
    schemes = ", ".join(f"{name} {n}" for name, n in quant["schemes"].items())
    lines = [f"  quantized: {quant['groups']} groups" + (f" ({schemes})" if schemes else "")]
    original = quant.get("original")
    if original and original["tensors"]:
        lines.append(f"  against the original {original['path']} (max abs, mean abs, relative error):")
        lines += [f"    {dequantized_row(r)}" for r in original["tensors"][:20]]
        lines += [f"    … and {len(original['tensors']) - 20} more"] if len(original["tensors"]) > 20 else []
    return lines


def dequantized_row(r: dict[str, Any]) -> str:
    """``model.0.weight (fp8-block): 0.0012, 0.0003, 0.021 (ok: step bound)`` for one dequantized weight's row."""
    if r["max_abs_diff"] is None:
        return f"{shown(r['key'])} ({r['scheme']}): shape {r['shape']} vs {r['original_shape']} (DIFFERS)"
    verdict = "reported, not judged" if r["ok"] is None else f"{'ok' if r['ok'] else 'DIFFERS'}: {r['tolerance']}"
    return (f"{shown(r['key'])} ({r['scheme']}): {r['max_abs_diff']:.3g}, {r['mean_abs_diff']:.3g}, "
            f"{r['rel_error']:.3g} ({verdict})")


def diff_text(report: Any) -> str:
    c = report.counts
    head = "DIFFER" if not report.identical else "within bounds" if report.dequantized else "identical"
    tol = "exact" if not (report.atol or report.rtol) else f"atol={report.atol:g}, rtol={report.rtol:g}"
    lines = [f"{head}: {report.a} vs {report.b} ({'raw keys' if report.raw else 'single form'}, {tol})",
             f"  {c['common']} common keys: {c['equal']} equal{' within tolerance' if report.atol or report.rtol else ''}, "
             f"{c['values']} values differ, "
             f"{c['shape']} shape, {c['dtype']} dtype; {c['only_a']} only in A, {c['only_b']} only in B"]
    if report.dequantized:
        lines.append(f"  dequantized ({len(report.dequantized)}) against the other side's weight (max abs, mean abs, "
                     "relative error):")
        lines += [f"    {dequantized_row(r)}" for r in report.dequantized[:20]]
        lines += [f"    … and {len(report.dequantized) - 20} more"] if len(report.dequantized) > 20 else []
    for name, keys in (("only in A", report.only_a), ("only in B", report.only_b)):
        if keys:
            lines.append(f"  {name} ({len(keys)}):")
            lines += [f"    {g}" for g in group_keys(keys)]
    for name, rows in (("shape", report.shape_mismatch), ("dtype", report.dtype_mismatch)):
        if rows:
            lines.append(f"  {name} differs ({len(rows)}):")
            lines += [f"    {shown(r['key'])}: {r['a']} vs {r['b']}" for r in rows[:20]]
    if report.value_mismatch:
        lines.append(f"  values differ ({len(report.value_mismatch)}), largest first:")
        rows = sorted(report.value_mismatch, key=lambda r: -(r["max_abs_diff"] if r["max_abs_diff"] is not None else math.inf))
        lines += [f"    {shown(r['key'])}: max abs diff {r['max_abs_diff']}" for r in rows[:20]]
    return "\n".join(lines)

def describe_tolerance(row: dict[str, Any]) -> str:
    """``atol=1e-06, rtol=1e-05: recorded-value default for float32`` for a ``forward.against`` row."""
    dtypes = "/".join(row["output_dtypes"]) or "this output"
    why = {"given": "as given", "exact": "bit-exact, both computed in this run",
           "recorded": f"recorded-value default for {dtypes}",
           "dtype": f"default for {dtypes}, the serving dtype (the reference run in it too)"}[row["tolerance"]]
    return f"atol={row['atol']:g}, rtol={row['rtol']:g}: {why}"


def describe_recipe(recipe: dict[str, Any]) -> str:
    """``input 4x13 float, seed 1234`` / ``input 1x16 long in [0, 30522), seed 1234`` / ``input x.pt`` for an
    input recipe's ``to_dict()`` (a verify row's ``input``, a golden file's metadata)."""
    if "file" in recipe:
        return f"input {recipe['file'] or 'given tensors'}"
    rng = recipe.get("range")
    span = f" in [{number(rng[0])}, {number(rng[1])})" if rng is not None else ""
    shape = "x".join(map(str, recipe.get("shape") or ()))
    return f"input {shape} {recipe.get('dtype', 'float')}{span}, seed {recipe.get('seed')}"


def number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
