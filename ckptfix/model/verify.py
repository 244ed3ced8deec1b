"""Verify a checkpoint against a model: keys, shapes, dtypes, values, tied weights, forward outputs.

The keys are first adapted to the model with the repair ckptfix knows (:mod:`ckptfix.statedict.repair`).
Without ``exact`` the checkpoint passes when the repaired state dict loads strictly (dtypes are
cast, so they are warnings); with ``exact`` it must load as saved through the serving code's own
loader — plain ``torch.load(weights_only=True)`` for a torch file, ``safetensors.torch.load_file``
for a safetensors file — and ``load_state_dict(strict=True)``, every dtype the model's (in the
serving ``dtype`` when one is given). Forward outputs are compared with a ``reference`` checkpoint's
and with ``golden`` outputs (:mod:`ckptfix.model.golden`).

>>> ckptfix.verify("run.pth", "torchvision:resnet18", reference="orig.pth").ok   # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ops import api
from ..safety import scanner
from . import forward as fwd
from . import golden as gold
from . import serving
from . import spec as models
from ..statedict import repair, wrappers
from ..statedict.transforms import CAST_DTYPES
from .. import text
from ..core.atomic import sha256_file
from ..core.devices import storage_id
from ..core.progress import Progress
from ..errors import DeviceError, GoldenError, LoadError
from .inputs import InputRecipe, resolve_input
from ..parse.format_registry import get as format_of

_SHORT_DTYPES = {long: short for short, long in CAST_DTYPES.items()}  # convert --dtype names


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
    model_dtype: str | None = None
    golden: dict[str, Any] | None = None
    devices: dict[str, int] = field(default_factory=dict)
    serving_device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self) -> str:
        """The readable summary: verdict, repair, then each problem with its keys, counts first."""
        return text.verify_text(self)


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
    seed: int = fwd.INPUT_SEED,
    checksum: bool = True,
    dtype: Any = None,
    input_dtype: str | None = None,
    input_range: tuple[float, float] | None = None,
    inputs: Any = None,
    golden: Any = None,
    record_golden: bool = False,
    serving_device: str | None = None,
    progress: bool = False,
) -> VerifyReport:
    """Check checkpoint ``path`` against ``model`` (an nn.Module, a spec such as
    ``'torchvision:resnet18'`` with ``model_args``, or a factory).

    ``forward=False`` reads on ``meta``: keys, shapes and dtypes only; with ``checksum=False`` too,
    nothing is hashed (``sha256`` is then None). A torch zip's CRC-32s are checked either way.

    ``dtype`` (``"fp16"``, ``"bf16"``, ``"fp32"`` or a torch dtype): the serving dtype. The model is
    built, then ``.to(dtype)``: its dtypes are the ones ``exact`` demands, and the forward runs in it
    (a ``reference`` too, its weights cast to it).

    The input is ``inputs`` (a file path, a tensor, or a dict of tensors → ``model(**dict)``), else a
    recipe seeded with ``seed``: ``input_shape``, ``input_dtype`` (``"float"``, ``"long"``, ``"int"``)
    and ``input_range`` (``(0, 30522)``), inferred where unambiguous
    (:func:`ckptfix.model.inputs.resolve_input`).

    ``golden`` (a ``.safetensors`` path): when it exists, the outputs are compared with the ones it
    records, on the input it records; when it doesn't (or ``record_golden``), this run's outputs are
    written to it — only if everything else passed (``report.golden`` says which).

    ``atol``/``rtol`` (None or 0: not given): with none given, the output is compared bit for bit with
    ``reference``'s (both computed in this run) — within the default of the serving dtype
    (:data:`ckptfix.model.forward.RECORDED_TOLERANCE`) when ``dtype`` is half precision — and within the
    recorded-value default for its dtype with ``golden``'s (recorded elsewhere); given, they apply to
    every comparison. Each ``forward['against']`` row says the atol/rtol it used and why.

    ``exact`` also takes the devices as saved (``report.devices``: where the plain loader puts the tensors,
    no map_location): each must be ``serving_device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``; the CPU always
    does) or, without one, exist on this machine. Tied keys the file holds once pass only where the
    model ties them again after loading (:mod:`ckptfix.model.serving`). ``progress``: a progress line on
    stderr, when it is a terminal, while the values are checked.
    """
    if record_golden and golden is None:
        raise GoldenError("record_golden needs golden=PATH (--golden PATH): where to write the outputs")
    if serving_device is not None and not exact:
        raise DeviceError(f"serving_device={serving_device!r} (--serving-device) is what --exact's plain load is "
                          "checked against: pass exact=True (--exact) too")
    path = os.fspath(path)
    forward = forward and str(map_location).strip().lower() != "meta"  # meta holds no values to run
    request = fwd.ForwardRequest(reference, golden, record_golden, atol, rtol, input_shape, input_dtype, input_range,
                                 inputs, seed)
    source = models.ModelSource(model, model_args, dtype)
    ckpt = api.read(path, map_location=map_location if forward else "meta", trust=trust, select=select)
    structure, is_fresh = source.structure(meta=not forward)
    target = repair.describe_target(structure, float_dtype=source.dtype)
    chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=path)
    sha = _hash(path, progress) if (checksum or forward) and os.path.isfile(path) else None  # a directory: no one hash
    report = VerifyReport(
        ok=False, checkpoint=path, model=source.label, fix=chosen.description, missing=fit.missing,
        unexpected=fit.unexpected, shape_mismatch=fit.shape_mismatch, dtype_mismatch=fit.dtype_mismatch,
        nonfinite=None, forward=None, sha256=sha, exact=exact, format=ckpt.format,
        state_dict_key=ckpt.state_dict_key, matched=chosen.matched, total=chosen.total,
        non_tensor=fit.non_tensor, tolerated=fit.tolerated, notes=list(ckpt.notes), model_dtype=source.dtype_name,
        devices=dict(ckpt.devices), serving_device=serving_device,
    )
    cast = _cast_to(fit, target) if exact else None
    aliases, off_device = serving.Aliases(), []
    if exact:
        loaded = serving.plainly_loaded(ckpt)
        aliases = serving.check_aliases(ckpt.state_dict, loaded, chosen.fn, target, serving.retie_hook(structure))
        serving.as_served(report, aliases)
        off_device = serving.device_failures(ckpt.devices, serving_device, serving.loader(ckpt.format))
    if chosen.description or cast or aliases.stored or off_device or \
            (exact and (ckpt.state_dict_key is not None or not format_of(ckpt.format).exact_loader)):
        ext = format_of(ckpt.format).fixed_ext  # a safetensors release stays one
        report.convert_command = repair.convert_command(path, list(ckpt.state_dict), chosen, target,
                                                        ckpt.state_dict_key, dtype=cast, ext=ext,
                                                        untie=bool(aliases.stored),
                                                        map_location="cpu" if off_device else None)
    _check_values(report, fit, target, has_data=forward, progress=progress)
    _judge_structure(report, fit, exact, ckpt, target, aliases)
    report.failures += off_device
    report.failures += crc_failures(path, ckpt.format)  # with or without the forward check
    if forward and fit.loads:
        net = structure if is_fresh else source.fresh()
        _forward_checks(report, fit.state_dict, net, source, request, map_location, trust)
    elif forward:
        report.notes.append("forward check skipped: the checkpoint does not load into the model" + request.ignored)
    else:
        report.notes.append("structure only (--no-forward): read on meta; NaN/Inf and forward not checked"
                            + request.ignored)
    if golden is not None and report.golden is None:
        report.golden = {"path": os.fspath(golden), "action": "skipped", "input": None, "outputs": None}
    report.ok = not report.failures
    return report


def _check_values(report: VerifyReport, fit: repair.Fit, target: repair.Target, has_data: bool,
                  progress: bool = False) -> None:
    """NaN/Inf per tensor, and tied parameters that arrive as different tensors."""
    import torch

    sd = fit.state_dict
    if has_data:
        report.nonfinite = _nonfinite(sd, list(target.shapes), progress)
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


def _hash(path: str, progress: bool) -> str:
    """The file's SHA-256, with a progress line on a terminal (a multi-GB release takes seconds)."""
    with Progress(os.path.getsize(path), 1, enabled=progress, label="verify: SHA-256") as bar:
        digest = sha256_file(path, bar.advance)
        bar.tensor_done()
    return digest


def _nonfinite(sd: Any, keys: list[str], progress: bool) -> list[str]:
    """:func:`repair.nonfinite_keys`, tensor by tensor, with a progress line on a terminal (the long part)."""
    import torch

    tensors = [k for k in keys if isinstance(sd.get(k), torch.Tensor)]
    total = sum(sd[k].numel() * sd[k].element_size() for k in tensors)
    out: list[str] = []
    with Progress(total, len(tensors), enabled=progress, label="verify: NaN/Inf") as bar:
        for k in tensors:
            out += repair.nonfinite_keys(sd, [k])
            bar.advance(sd[k].numel() * sd[k].element_size())
            bar.tensor_done()
    return out


def crc_failures(path: str, fmt: str) -> list[str]:
    """One line per zip member whose stored CRC-32 doesn't match its bytes, in a torch zip or
    TorchScript file or each torch-zip shard of a sharded checkpoint: the file changed after it
    was written. Reads every byte once (safetensors, legacy and DCP files carry no checksums)."""
    if not format_of(fmt).zip:
        return []

    report = scanner.scan(path, check_crc=True)
    return [f"integrity: {f.where}: its CRC-32 does not match its bytes: the file was damaged or altered after "
            "it was written (a truncated copy, a bad download or disk); copy or download it again from the original"
            for f in report.findings if f.kind == "crc-mismatch"]


def _keys(rows: list[Any]) -> list[str]:
    """Key names from a report list: keys, ``{key, …}`` rows, or ``{keys: [...]}`` rows (as ``a/b``)."""
    return [r if isinstance(r, str) else r["key"] if "key" in r else "/".join(r["keys"]) for r in rows]


def _judge_structure(report: VerifyReport, fit: repair.Fit, exact: bool, ckpt: Any, target: repair.Target,
                     aliases: serving.Aliases) -> None:
    fails = report.failures
    problems = [serving.named(name, _keys(v)) for name, v in (
        ("missing", fit.missing), ("unexpected", fit.unexpected), ("shape mismatch", fit.shape_mismatch),
        ("non-tensor", fit.non_tensor), ("non-finite", report.nonfinite or []),
        ("tied-weight mismatch", report.shared_mismatch)) if v]
    if problems:
        fails.append(("after the repair: " if report.fix else "") + "; ".join(problems))
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
        fails += _exact_failures(ckpt, target, report, aliases)


def _exact_failures(ckpt: Any, target: repair.Target, report: VerifyReport, aliases: serving.Aliases) -> list[str]:
    """Why the serving loader — ``torch.load(PATH, weights_only=True)`` or ``safetensors.torch.load_file(PATH)``
    — followed by ``load_state_dict(…, strict=True)`` would not take the file as is."""
    out = []
    how = f" (the repair: {report.fix})" if report.fix else ""
    if not format_of(ckpt.format).exact_loader:
        what = "directory" if os.path.isdir(ckpt.path) else "file"
        out.append(f"exact: neither torch.load nor safetensors.torch.load_file reads a {ckpt.format} {what}")
    if ckpt.state_dict_key is not None:
        out.append(f"exact: torch.load returns a dict with the state dict under {ckpt.state_dict_key!r}, not the state dict")
    as_loaded = serving.plainly_loaded(ckpt)
    plain = repair.check_fit(as_loaded, target, fill=False)
    missing = plain.missing + [t["key"] for t in plain.tolerated if t["key"] not in aliases.retied
                               and not repair.torch_fills_num_batches_tracked(t["key"], as_loaded)]
    problems = [serving.named(name, _keys(v)) for name, v in (
        ("missing", missing), ("unexpected", plain.unexpected), ("shape mismatch", plain.shape_mismatch),
        ("non-tensor", plain.non_tensor)) if v]
    if problems:
        why = "".join(f"; {serving.alias_reason(k, aliases, ckpt.format)}" for k in missing if k in aliases.absent)
        out.append(f"exact: load_state_dict(strict=True) would fail as saved: {'; '.join(problems)}{how}{why}")
    if plain.dtype_mismatch:
        kinds = sorted({f"{r['checkpoint']} vs model {r['model']}" for r in plain.dtype_mismatch})
        out.append(f"exact: {len(plain.dtype_mismatch)} dtypes differ from the model's ({', '.join(kinds)}): "
                   + serving.shown(_keys(plain.dtype_mismatch)))
    return out


def _cast_to(fit: repair.Fit, target: repair.Target) -> str | None:
    """``--dtype`` for convert when one cast makes every floating tensor the model's (its floats share one dtype)."""
    floats = {d for d in target.dtypes.values() if d and d.startswith(("float", "bfloat"))}
    if not fit.dtype_mismatch or len(floats) != 1:
        return None
    return _SHORT_DTYPES.get(floats.pop())


def _forward_checks(report: VerifyReport, sd: Any, net: Any, source: models.ModelSource, req: fwd.ForwardRequest,
                    map_location: Any, trust: bool) -> None:
    """Load into a fresh model (strictly, as torch does); run it on one input and compare its outputs
    with the reference's and the golden file's; record the golden file when asked."""
    try:
        net.load_state_dict(sd, strict=True)
    except (RuntimeError, ValueError, TypeError) as e:
        report.failures.append(f"torch's load_state_dict refused the repaired state dict: {str(e).splitlines()[0]}")
        return
    if req.reference is None and req.golden is None:
        return
    recorded = _golden_to_compare(req, net)
    recipe = resolve_input(net, req.input_shape, req.input_dtype, req.input_range, req.seed, req.inputs,
                           recorded=recorded.input if recorded else None)
    args, kwargs = recipe.make()
    out = fwd.named_outputs(fwd.run_model(net, args, kwargs, recipe.describe()))
    checks = []
    if recorded is not None:
        checks.append(fwd.compare_outputs("golden", recorded.path, out, recorded.outputs, req.atol, req.rtol, recipe,
                                          default="recorded"))
        report.golden = {"path": recorded.path, "action": "compared", "input": recipe.to_dict(),
                         "outputs": gold.summary(recorded.outputs)}
    if req.reference is not None:
        ref_net = _load_reference(req.reference, source, map_location, trust)
        want = fwd.named_outputs(fwd.run_model(ref_net, args, kwargs, recipe.describe()))
        half = source.dtype_name not in (None, "float32")
        checks.append(fwd.compare_outputs("reference", os.fspath(req.reference), out, want, req.atol, req.rtol, recipe,
                                          default="dtype" if half else "exact"))
    if checks:
        diffs = [c["max_abs_diff"] for c in checks]
        report.forward = {"max_abs_diff": None if None in diffs else max(diffs), "ok": all(c["ok"] for c in checks),
                          "atol": float(req.atol or 0.0), "rtol": float(req.rtol or 0.0), "against": checks}
    for c in checks:
        if not c["ok"]:
            how = "a different output structure" if c["max_abs_diff"] is None else f"max abs diff {c['max_abs_diff']:.3g}"
            report.failures.append(f"forward output differs from the {c['what']} ({how}, {text.describe_tolerance(c)})")
    if req.golden is not None and recorded is None:
        _record_golden(report, os.fspath(req.golden), out, recipe, net, source.label)


def _golden_to_compare(req: fwd.ForwardRequest, net: Any) -> gold.Golden | None:
    """The golden file to compare with: None when there is none yet or it is to be recorded again."""
    if req.golden is None or req.record_golden or not os.path.lexists(req.golden):
        return None
    recorded = gold.read_golden(req.golden)
    runs_in = models.float_dtype(net)
    if recorded.dtype != runs_in:
        short = _SHORT_DTYPES.get(recorded.dtype, recorded.dtype)
        raise GoldenError(f"golden {recorded.path}: recorded with the model in {recorded.dtype}, but it runs in "
                          f"{runs_in} here; pass --dtype {short} (library: dtype={short!r}), or record it again "
                          "(--record-golden)")
    return recorded


def _record_golden(report: VerifyReport, where: str, out: dict[str, Any], recipe: InputRecipe, net: Any,
                   label: str) -> None:
    """Write this run's outputs as the golden file, only when everything else passed."""
    entry: dict[str, Any] = {"path": where, "input": recipe.to_dict(), "outputs": gold.summary(out)}
    if report.failures:
        report.golden = {**entry, "action": "skipped"}
        report.notes.append(f"golden outputs not recorded to {where}: the checkpoint failed verification")
        return
    gold.write_golden(where, out, entry["input"], models.float_dtype(net), model=label,
                      checkpoint=os.path.basename(report.checkpoint.rstrip("/")), checkpoint_sha256=report.sha256)
    report.golden = {**entry, "action": "recorded"}


def _load_reference(reference: Any, source: models.ModelSource, map_location: Any, trust: bool) -> Any:
    ref = api.read(reference, map_location=map_location, trust=trust)
    net = source.fresh()
    target = repair.describe_target(net)
    _, fit = repair.fit_to_model(ref.state_dict, target, source=ref.path)
    if not fit.loads:
        raise LoadError(f"reference {ref.path}: does not load into the model ({len(fit.missing)} missing, "
                        f"{len(fit.unexpected)} unexpected, {len(fit.shape_mismatch)} shape mismatch); "
                        "`ckptfix verify` it against the model first")
    net.load_state_dict(fit.state_dict, strict=True)
    return net
