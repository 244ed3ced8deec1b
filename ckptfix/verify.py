"""Verify a checkpoint against a model: keys, shapes, dtypes, values, tied weights, forward outputs.

The keys are first adapted to the model with the repair ckptfix knows (:mod:`ckptfix.repair`).
Without ``exact`` the checkpoint passes when the repaired state dict loads strictly (dtypes are
cast, so they are warnings); with ``exact`` it must load as saved through plain
``torch.load`` + ``load_state_dict(strict=True)`` with every dtype the model's.

>>> ckptfix.verify("run.pth", "torchvision:resnet18", reference="orig.pth").ok   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from . import forward as fwd
from . import models, repair, wrappers
from .atomic import sha256_file
from .errors import CkptfixError

_TORCH_FORMATS = ("torch-zip", "torch-legacy")  # what plain torch.load reads
_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # convert --dtype names


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`; ``to_dict()`` is the CLI's ``--json`` object."""

    ok: bool
    checkpoint: str
    model: str
    fix: str | None
    missing: list[str]
    unexpected: list[str]
    shape_mismatch: list[dict[str, Any]]
    dtype_mismatch: list[dict[str, Any]]
    nonfinite: list[str] | None
    forward: dict[str, Any] | None
    sha256: str | None
    exact: bool = False
    format: str = ""
    state_dict_key: str | None = None
    matched: int = 0
    total: int = 0
    non_tensor: list[str] = field(default_factory=list)
    shared_mismatch: list[dict[str, Any]] = field(default_factory=list)
    tolerated: list[dict[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    convert_command: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self) -> str:
        """The readable summary: verdict, repair, then each problem with its keys, counts first."""
        mode = "--exact: as plain torch.load would load it" if self.exact else "repairs allowed"
        lines = [f"{'VERIFIED' if self.ok else 'FAILED'}: {self.checkpoint} against {self.model} ({mode})",
                 f"  keys: {self.fix or 'as saved'}: {self.matched}/{self.total} keys match"]
        if self.convert_command:
            lines.append(f"  fix the file with: {self.convert_command}")
        for name, keys in (("missing", self.missing), ("unexpected", self.unexpected),
                           ("not a tensor", self.non_tensor), ("NaN/Inf", self.nonfinite or [])):
            if keys:
                lines.append(f"  {name} ({len(keys)}):")
                lines += [f"    {g}" for g in repair.group_keys(keys)]
        for name, rows in (("shape mismatch", self.shape_mismatch), ("dtype mismatch", self.dtype_mismatch)):
            if rows:
                lines.append(f"  {name} ({len(rows)}){' (warning: cast on load)' if name[0] == 'd' and not self.exact else ''}:")
                lines += [f"    {r['key']}: checkpoint {r['checkpoint']}, model {r['model']}" for r in rows[:20]]
                lines += [f"    … and {len(rows) - 20} more"] if len(rows) > 20 else []
        for row in self.shared_mismatch:
            lines.append(f"  tied weights arrive as different tensors: {', '.join(row['keys'])} ({row['reason']})")
        nbt = [r["key"] for r in self.tolerated if r["kind"] == "num_batches_tracked"]
        if nbt:
            lines.append(f"  tolerated ({len(nbt)}): missing num_batches_tracked (old BatchNorm checkpoint), set to 0: "
                         + ", ".join(nbt[:3]) + (" …" if len(nbt) > 3 else ""))
        lines += [f"  tolerated: {r['key']}: {r['reason']}" for r in self.tolerated if r["kind"] != "num_batches_tracked"]
        for c in (self.forward or {}).get("against", []):
            diff = "output structure differs" if c["max_abs_diff"] is None else f"max abs diff {c['max_abs_diff']:.3g}"
            lines.append(f"  forward vs {c['what']} {c['path']}: {diff} ({'ok' if c['ok'] else 'DIFFERS'}; "
                         f"{fwd.describe_tolerance(c)}; "
                         f"input {'x'.join(map(str, c['input_shape']))}, seed {c['seed']})")
        lines += [f"  FAIL: {f}" for f in self.failures]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  suggestion: {s['text']}" for s in self.suggestions]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  sha256: {self.sha256}"] if self.sha256 else []
        return "\n".join(lines)


class _ModelSource:
    """Where model instances come from: a spec (built), a factory (called) or a module (copied)."""

    def __init__(self, model: Any, args: dict[str, Any] | None):
        import torch

        self.model, self.args = model, args or {}
        if isinstance(model, str):
            self.label = model + "".join(f" {k}={v!r}" for k, v in self.args.items())
        elif isinstance(model, torch.nn.Module):
            self.label = type(models.unwrap_model(model)).__name__
        elif callable(model):
            self.label = getattr(model, "__qualname__", repr(model))
        else:
            raise CkptfixError(f"model: expected an nn.Module, a model spec string or a factory, got {type(model).__name__}")

    def structure(self, meta: bool) -> tuple[Any, bool]:
        """``(model, is_fresh)`` to read keys from: the given module itself, or a new build."""
        import torch

        if isinstance(self.model, torch.nn.Module):
            return self.model, False
        return self.fresh(meta), not meta

    def fresh(self, meta: bool = False) -> Any:
        """A new instance; on ``meta`` (no memory) where the builder allows it."""
        import torch

        if isinstance(self.model, torch.nn.Module):
            return _deepcopy(self.model)
        if meta:
            try:
                with torch.device("meta"):
                    return self._build()
            except CkptfixError:
                pass  # some builders need real tensors; build normally
        return self._build()

    def _build(self) -> Any:
        if isinstance(self.model, str):
            return models.build_model(self.model, self.args)
        return models.call_factory(self.model, self.args, self.label)


def _deepcopy(model: Any) -> Any:
    try:
        return copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - whatever the module holds that can't be copied
        raise CkptfixError(f"model: can't make a fresh copy for the forward check ({type(e).__name__}: {e}); "
                           "pass a model spec or a factory instead of an instance") from None


def verify(
    path: Any,
    model: Any,
    reference: Any = None,
    exact: bool = False,
    forward: bool = True,
    atol: float | None = None,
    rtol: float | None = None,
    input_shape: tuple[int, ...] | None = None,
    model_args: dict[str, Any] | None = None,
    map_location: Any = "cpu",
    select: str = "auto",
    trust: bool = False,
    manifest: Any = "auto",
    seed: int = fwd.INPUT_SEED,
    checksum: bool = True,
) -> VerifyReport:
    """Check checkpoint ``path`` against ``model`` (an nn.Module, a spec such as
    ``'torchvision:resnet18'`` with ``model_args``, or a factory).

    ``forward=False`` reads on ``meta``: keys, shapes and dtypes only; with ``checksum=False`` too,
    nothing is hashed (``sha256`` is then None). A torch zip's CRC-32s are checked either way.
    ``manifest='auto'`` compares with the outputs a fixtures ``manifest.json`` beside the file
    records for it (same sha256).

    ``atol``/``rtol`` (None or 0: not given): with none given, the output is compared bit for bit with
    ``reference``'s (both computed in this run) and within :data:`ckptfix.forward.RECORDED_TOLERANCE`
    for its dtype with a manifest's (recorded elsewhere); given, they apply to both. Each
    ``forward['against']`` row says the atol/rtol it used.
    """
    from .api import read

    path = os.fspath(path)
    forward = forward and str(map_location).strip().lower() != "meta"  # meta holds no values to run
    source = _ModelSource(model, model_args)
    ckpt = read(path, map_location=map_location if forward else "meta", trust=trust, select=select)
    structure, is_fresh = source.structure(meta=not forward)
    target = repair.describe_target(structure)
    chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=path)
    sha = sha256_file(path) if (checksum or forward) and os.path.isfile(path) else None  # a directory: no one hash
    report = VerifyReport(
        ok=False, checkpoint=path, model=source.label, fix=chosen.description, missing=fit.missing,
        unexpected=fit.unexpected, shape_mismatch=fit.shape_mismatch, dtype_mismatch=fit.dtype_mismatch,
        nonfinite=None, forward=None, sha256=sha, exact=exact, format=ckpt.format,
        state_dict_key=ckpt.state_dict_key, matched=chosen.matched, total=chosen.total,
        non_tensor=fit.non_tensor, tolerated=fit.tolerated, notes=list(ckpt.notes),
    )
    cast = _cast_to(fit, target) if exact else None
    if chosen.description or cast or (exact and (ckpt.state_dict_key is not None or ckpt.format not in _TORCH_FORMATS)):
        report.convert_command = repair.convert_command(path, list(ckpt.state_dict), chosen, target,
                                                        ckpt.state_dict_key, dtype=cast)
    _check_values(report, fit, target, has_data=forward)
    _judge_structure(report, fit, exact, ckpt, target)
    report.failures += crc_failures(path, ckpt.format)  # with or without the forward check
    if forward and fit.loads:
        net = structure if is_fresh else source.fresh()
        _forward_checks(report, fit.state_dict, net, source, reference, input_shape, atol, rtol, seed,
                        _manifest_entry(path, manifest, sha or "", ckpt.state_dict_key), map_location, trust)
    elif forward:
        report.notes.append("forward check skipped: the checkpoint does not load into the model")
    else:
        report.notes.append("structure only (--no-forward): read on meta; NaN/Inf and forward not checked"
                            + ("; --reference ignored" if reference is not None else ""))
    report.ok = not report.failures
    return report


def _check_values(report: VerifyReport, fit: repair.Fit, target: repair.Target, has_data: bool) -> None:
    """NaN/Inf per tensor, and tied parameters that arrive as different tensors."""
    import torch

    from .devices import storage_id

    sd = fit.state_dict
    if has_data:
        report.nonfinite = [k for k in target.shapes if isinstance(sd.get(k), torch.Tensor) and
                            (sd[k].is_floating_point() or sd[k].is_complex()) and not bool(torch.isfinite(sd[k]).all())]
    for group in target.tied:
        present = [k for k in group if isinstance(sd.get(k), torch.Tensor)]
        views = {(storage_id(sd[k]), sd[k].storage_offset(), tuple(sd[k].shape), tuple(sd[k].stride())) for k in present}
        if len(views) <= 1:
            continue
        if not has_data:
            report.warnings.append(f"tied parameters {', '.join(present)} are separate tensors in the checkpoint; "
                                   "their values are not compared on meta (run without --no-forward)")
        elif any(sd[k].shape != sd[present[0]].shape or not torch.equal(sd[k], sd[present[0]]) for k in present[1:]):
            report.shared_mismatch.append({"keys": present, "reason": "the model ties them but their values differ; "
                                                                      "only one survives loading"})


def crc_failures(path: str, fmt: str) -> list[str]:
    """One line per zip member whose stored CRC-32 doesn't match its bytes, in a torch zip or
    TorchScript file or each torch-zip shard of a sharded checkpoint: the file changed after it
    was written. Reads every byte once (safetensors, legacy and DCP files carry no checksums)."""
    if fmt not in ("torch-zip", "torchscript", "sharded-pth"):
        return []
    from . import safety

    report = safety.scan(path, check_crc=True)
    return [f"integrity: {f.where}: its CRC-32 does not match its bytes: the file was damaged or altered after "
            "it was written (a truncated copy, a bad download or disk); copy or download it again from the original"
            for f in report.findings if f.kind == "crc-mismatch"]


def _judge_structure(report: VerifyReport, fit: repair.Fit, exact: bool, ckpt: Any, target: repair.Target) -> None:
    fails = report.failures
    problems = [f"{len(v)} {name}" for name, v in (
        ("missing", fit.missing), ("unexpected", fit.unexpected), ("shape mismatch", fit.shape_mismatch),
        ("non-tensor", fit.non_tensor), ("non-finite", report.nonfinite or []),
        ("tied-weight mismatch", report.shared_mismatch)) if v]
    if problems:
        fails.append(("after the repair: " if report.fix else "") + ", ".join(problems))
        if fit.missing and fit.unexpected:
            fails[-1] += " (names differ: a renamed layer, or a different architecture)"
            single = wrappers.strip_wrappers  # convert's --rename applies to the single form
            report.suggestions = repair.suggest_renames({single(k): repair.shape_of(fit.state_dict[k]) for k in fit.unexpected},
                                                        {single(k): target.shapes[k] for k in fit.missing}, ckpt.path)
            if repair.by_order_fits(fit.state_dict, target):
                report.suggestions.append({"by_order": True, "keys": len(fit.state_dict), "text": (
                    "the tensors pair up with the model's in order, shapes equal: "
                    f"ckptfix convert {ckpt.path} OUT --by-order --model SPEC [--arg NAME=VALUE …]")})
        elif fit.missing or fit.shape_mismatch:
            fails[-1] += " (a different architecture or configuration than the checkpoint's?)"
    if fit.dtype_mismatch and not exact:
        counts = sorted({f"{r['checkpoint']} -> {r['model']}" for r in fit.dtype_mismatch})
        report.warnings.append(f"{len(fit.dtype_mismatch)} tensors are cast on load ({', '.join(counts)})")
    if exact:
        fails += _exact_failures(ckpt, target, report)


def _exact_failures(ckpt: Any, target: repair.Target, report: VerifyReport) -> list[str]:
    """Why plain ``load_state_dict(torch.load(PATH, weights_only=True), strict=True)`` would not take it as is."""
    out = []
    how = f" (the repair: {report.fix})" if report.fix else ""
    if ckpt.format not in _TORCH_FORMATS:
        out.append(f"exact: plain torch.load can't read a {ckpt.format} file")
    if ckpt.state_dict_key is not None:
        out.append(f"exact: torch.load returns a dict with the state dict under {ckpt.state_dict_key!r}, not the state dict")
    plain = repair.check_fit(ckpt.state_dict, target, fill=False)
    missing = plain.missing + [t["key"] for t in plain.tolerated
                               if not repair.torch_fills_num_batches_tracked(t["key"], ckpt.state_dict)]
    problems = [f"{len(v)} {name}" for name, v in (("missing", missing), ("unexpected", plain.unexpected),
                                                   ("shape mismatch", plain.shape_mismatch), ("non-tensor", plain.non_tensor)) if v]
    if problems:
        out.append(f"exact: load_state_dict(strict=True) would fail as saved: {', '.join(problems)}{how}")
    if plain.dtype_mismatch:
        kinds = sorted({f"{r['checkpoint']} vs model {r['model']}" for r in plain.dtype_mismatch})
        out.append(f"exact: {len(plain.dtype_mismatch)} dtypes differ from the model's ({', '.join(kinds)})")
    return out


def _cast_to(fit: repair.Fit, target: repair.Target) -> str | None:
    """``--dtype`` for convert when one cast makes every floating tensor the model's (its floats share one dtype)."""
    floats = {d for d in target.dtypes.values() if d and d.startswith(("float", "bfloat"))}
    if not fit.dtype_mismatch or len(floats) != 1:
        return None
    return _SHORT_DTYPES.get(floats.pop())


def _manifest_entry(path: str, manifest: Any, sha: str, selected: str | None = None) -> dict[str, Any] | None:
    """The fixtures-manifest entry recorded for this very file (name and sha256 agree), if any;
    with EMA weights selected, its ``output`` is the one recorded for them (``ema_output``)."""
    if manifest is None:
        return None
    where = os.path.join(os.path.dirname(os.path.abspath(path)), "manifest.json") if manifest == "auto" else os.fspath(manifest)
    try:
        with open(where, encoding="utf-8") as f:
            table = json.load(f).get("fixtures", {})
    except (OSError, ValueError, AttributeError):
        if manifest == "auto":
            return None
        raise CkptfixError(f"manifest {where}: can't be read as a fixtures manifest.json") from None
    entry = table.get(os.path.basename(path)) if isinstance(table, dict) else None
    if not isinstance(entry, dict) or entry.get("sha256") != sha or "output" not in entry:
        return None
    if selected is not None and selected in (entry.get("ema_keys") or []):
        if "ema_output" not in entry:
            return None
        entry = {**entry, "output": entry["ema_output"]}
    return {**entry, "manifest_path": where}


def _forward_checks(report: VerifyReport, sd: Any, net: Any, source: _ModelSource, reference: Any,
                    input_shape: tuple[int, ...] | None, atol: float | None, rtol: float | None, seed: int,
                    entry: dict[str, Any] | None, map_location: Any, trust: bool) -> None:
    """Load into a fresh model (strictly, as torch does) and compare outputs with the reference/manifest."""
    try:
        net.load_state_dict(sd, strict=True)
    except (RuntimeError, ValueError, TypeError) as e:
        report.failures.append(f"torch's load_state_dict refused the repaired state dict: {str(e).splitlines()[0]}")
        return
    checks = []
    if entry is not None:
        shape, entry_seed = tuple(entry["input"]["shape"]), entry["input"].get("seed", seed)
        out = fwd.run_model(net, fwd.seeded_input(shape, entry_seed))
        checks.append(fwd.compare_outputs("manifest", entry["manifest_path"], out, fwd.as_tensor(entry["output"]),
                                          atol, rtol, shape, entry_seed, recorded=True))
    if reference is not None:
        shape = _input_shape(input_shape, entry, net)
        x = fwd.seeded_input(shape, seed)
        ref_net = _load_reference(reference, source, map_location, trust)
        checks.append(fwd.compare_outputs("reference", os.fspath(reference), fwd.run_model(net, x),
                                          fwd.run_model(ref_net, x), atol, rtol, shape, seed))
    if not checks:
        return
    diffs = [c["max_abs_diff"] for c in checks]
    report.forward = {"max_abs_diff": None if None in diffs else max(diffs), "ok": all(c["ok"] for c in checks),
                      "atol": float(atol or 0.0), "rtol": float(rtol or 0.0), "against": checks}
    for c in checks:
        if not c["ok"]:
            how = "a different output structure" if c["max_abs_diff"] is None else f"max abs diff {c['max_abs_diff']:.3g}"
            report.failures.append(f"forward output differs from the {c['what']} ({how}, {fwd.describe_tolerance(c)})")


def _input_shape(given: tuple[int, ...] | None, entry: dict[str, Any] | None, net: Any) -> tuple[int, ...]:
    if given:
        return tuple(given)
    if entry is not None:
        return tuple(entry["input"]["shape"])
    inferred = models.infer_input_shape(net)
    if inferred is None:
        raise CkptfixError(f"can't tell the input shape of {type(models.unwrap_model(net)).__name__} for the forward "
                           "check; pass --input-shape (library: input_shape=(1, 3, 224, 224)), or --no-forward")
    return inferred


def _load_reference(reference: Any, source: _ModelSource, map_location: Any, trust: bool) -> Any:
    from .api import read

    ref = read(reference, map_location=map_location, trust=trust)
    net = source.fresh()
    target = repair.describe_target(net)
    _, fit = repair.fit_to_model(ref.state_dict, target, source=ref.path)
    if not fit.loads:
        raise CkptfixError(f"reference {ref.path}: does not load into the model ({len(fit.missing)} missing, "
                           f"{len(fit.unexpected)} unexpected, {len(fit.shape_mismatch)} shape mismatch); "
                           "`ckptfix verify` it against the model first")
    net.load_state_dict(fit.state_dict, strict=True)
    return net
