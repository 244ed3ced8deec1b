"""The gate: :data:`CHECKS`, the checks :func:`ckptfix.verify` runs in order over one gate (:mod:`.gate`).

Each check is a function ``(gate, report) -> Findings``: it looks at the checkpoint as read, the model and the
options (the :class:`Gate`), reads what the checks before it found (the report so far) and returns its own
findings, which :func:`ckptfix.model.findings.add` puts into the report. Any failure fails the gate. A new check
is one function here and one entry in :data:`CHECKS`; ``@model_free`` on it when it needs no model (it then runs
in ``verify PATH`` without one too, on a ``FileGate``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from .. import text
from ..core import locations
from ..core.progress import Progress
from ..core.units import shown
from ..errors import GoldenError, LoadError, ModelSpecError, UnsafeCheckpointError
from ..ops import api
from ..parse.format_registry import get as format_of
from ..parse import inert
from ..safety import integrity, scanner, signing
from ..statedict import repair, ties, weights_only
from . import fixes, observe, quant_checks, serving
from . import forward as fwd
from . import golden as gold
from . import spec as models
from .findings import Findings, VerifyReport
from .gate import FileGate, Gate, model_free
from .inputs import InputRecipe, resolve_input


@model_free
def sha256(gate: FileGate, report: VerifyReport) -> Findings:
    """The file's SHA-256 (a directory has no one hash), unless neither the options nor the forward check ask."""
    if not (gate.options.checksum or gate.runs_forward):
        return Findings()
    with gate.phase("hash"):  # the thread that hashed while the file was read; else (a directory's file) now
        digest = gate.digest.result() if gate.digest is not None else None
        digest = digest or integrity.file_sha256(gate.path, "verify" if gate.options.progress else None)
    return Findings(fields={"sha256": digest})


def served_keys(gate: Gate, report: VerifyReport) -> Findings:
    """With ``exact``: the keys as the serving loader returns them (:func:`ckptfix.model.serving.as_served`)."""
    return serving.as_served(report, gate.aliases) if gate.options.exact else Findings()


def fix_command(gate: Gate, report: VerifyReport) -> Findings:
    """The ``ckptfix convert`` line that writes a file the serving loader takes, where the file needs one."""
    exact, ckpt, aliases = gate.options.exact, gate.ckpt, gate.aliases
    cast = fixes.cast_to(gate.fit, gate.target) if exact else None
    as_saved_fails = exact and (ckpt.state_dict_key is not None or not serving.has_loader(ckpt.format))
    if not (gate.chosen.description or cast or aliases.stored or gate.off_device or as_saved_fails):
        return Findings()
    ext = format_of(ckpt.format).fixed_ext  # a safetensors release stays one
    command = fixes.convert_command(gate.path, list(ckpt.state_dict), gate.chosen, gate.target, ckpt.state_dict_key,
                                    dtype=cast, ext=ext, untie=bool(aliases.stored),
                                    map_location="cpu" if gate.off_device else None)
    return Findings(fields={"convert_command": command})


@model_free
def tensor_values(gate: FileGate, report: VerifyReport) -> Findings:
    """NaN/Inf per tensor (with values only; without a model each is a failure here, with one ``key_fit`` fails
    them), and tied parameters that arrive as different tensors."""
    import torch

    sd, found = gate.values, Findings()
    if gate.with_values:
        with gate.phase("values"):
            found.fields["nonfinite"] = _nonfinite(sd, gate.value_keys, gate.options.progress)
        if found.fields["nonfinite"] and not isinstance(gate, Gate):
            found.failures.append(serving.named("non-finite", found.fields["nonfinite"]))
    mismatched = []
    for group in gate.tied:
        present = [k for k in group if isinstance(sd.get(k), torch.Tensor)]
        if len(present) < 2 or all(ties.one_tensor(sd[present[0]], sd[k]) for k in present[1:]):
            continue
        first = sd[present[0]]
        if not gate.with_values:
            found.warnings.append(f"tied parameters {', '.join(present)} are separate tensors in the checkpoint; "
                                  "their values are not compared on meta (run without --structure-only)")
        elif any(not ties.same_values(sd[k].to(first.dtype), first) for k in present[1:]):  # (as load_into refuses)
            mismatched.append({"keys": present, "reason": "the model ties them but their values differ; "
                                                          "only one survives loading"})
    if mismatched:
        found.fields["shared_mismatch"] = report.shared_mismatch + mismatched
    return found


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


def _keys(rows: list[Any]) -> list[str]:
    """Key names from a report list: keys, ``{key, …}`` rows, or ``{keys: [...]}`` rows (as ``a/b``)."""
    return [r if isinstance(r, str) else r["key"] if "key" in r else "/".join(r["keys"]) for r in rows]


def key_fit(gate: Gate, report: VerifyReport) -> Findings:
    """What keeps the repaired state dict from loading strictly and serving (missing, unexpected, shape mismatch,
    non-tensor, non-finite, tied weights that differ), with the renames that would fit; the casts on load
    (warnings) without ``exact``."""
    fit, found = gate.fit, Findings()
    problems = [serving.named(name, _keys(v)) for name, v in (
        ("missing", fit.missing), ("unexpected", fit.unexpected), ("shape mismatch", fit.shape_mismatch),
        ("non-tensor", fit.non_tensor), ("non-finite", report.nonfinite or []),
        ("tied-weight mismatch", report.shared_mismatch)) if v]
    if problems:
        line = ("after the repair: " if report.fix else "") + "; ".join(problems)
        if fit.missing and fit.unexpected:
            line += " (names differ: a renamed layer, or a different architecture)"
            found.fields["suggestions"] = fixes.for_renamed_keys(fit, gate.target, gate.ckpt.path)
        elif fit.missing or fit.shape_mismatch:
            line += " (a different architecture or configuration than the checkpoint's?)"
        found.failures.append(line)
    if fit.dtype_mismatch and not gate.options.exact:
        counts = sorted({f"{r['checkpoint']} -> {r['model']}" for r in fit.dtype_mismatch})
        found.warnings.append(f"{len(fit.dtype_mismatch)} tensors are cast on load ({', '.join(counts)})")
    return found


@model_free
def module_metadata(gate: FileGate, report: VerifyReport) -> Findings:
    """What the state dict's ``_metadata`` holds that torch's loaders can't take (a placeholder, a version that is not
    a number, a module entry that is not a dict …): a failure per module key, with why
    (:mod:`ckptfix.statedict.metadata`). ckptfix's load, load_into and convert drop it; the file as saved keeps it."""
    return Findings(failures=[f"state dict {line}" for line in gate.ckpt.metadata_dropped])


@model_free
def unsafe_globals(gate: FileGate, report: VerifyReport) -> Findings:
    """Globals outside the allow-list anywhere in the file (read as inert placeholders, never imported): a finding in
    every mode, named with where (:mod:`ckptfix.statedict.weights_only`); ckptfix's own load still takes the weights."""
    found = inert.find(gate.ckpt.raw)
    if not found:
        return Findings()
    return Findings(failures=[f"unsafe: the file holds {weights_only.described(found)}, globals outside the allow-list "
                              "(read as inert placeholders, never imported or called): torch.load(weights_only=True) "
                              "refuses the file, torch.load(weights_only=False) would import and call them"])


def as_saved(gate: Gate, report: VerifyReport) -> Findings:
    """With ``exact``: why the serving loader — ``torch.load(PATH, weights_only=True)`` or
    ``safetensors.torch.load_file(PATH)`` — then ``load_state_dict(…, strict=True)`` would not take the file as is."""
    if not gate.options.exact:
        return Findings()
    ckpt, aliases, out = gate.ckpt, gate.aliases, []
    how = f" (the repair: {report.fix})" if report.fix else ""
    if not serving.has_loader(ckpt.format):
        what = "directory" if os.path.isdir(ckpt.path) else "file"
        out.append(f"exact: neither torch.load nor safetensors.torch.load_file reads a {ckpt.format} {what}")
    beside = weights_only.refused(ckpt.extra) if ckpt.state_dict_key is not None else []
    if beside and not report_unsafe(report):  # torch raises before it returns anything: that is the reason
        needs = weights_only.globals_named(beside)
        out.append(f"exact: torch.load(weights_only=True) refuses the file: beside the state dict it holds "
                   f"{weights_only.described(beside)} (the server would need add_safe_globals([{needs}]); "
                   "or write the state dict alone: the convert line)")
    elif ckpt.state_dict_key is not None and not beside:
        out.append(f"exact: torch.load returns a dict with the state dict under {ckpt.state_dict_key!r}, not the state dict")
    as_loaded = serving.plainly_loaded(ckpt)
    plain = repair.check_fit(as_loaded, gate.target, fill=False)
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
    return Findings(failures=out)


def report_unsafe(report: VerifyReport) -> bool:
    """Has :func:`unsafe_globals` failed the gate already?"""
    return any(f.startswith("unsafe: ") for f in report.failures)


def observed_load(gate: Gate, report: VerifyReport) -> Findings:
    """With ``exact``: the serving loader's own verdict on the file as saved, run in a child process
    (:mod:`ckptfix.model.observe`), and every tensor it returned against ckptfix's read, bit for bit."""
    if not gate.options.exact or not serving.has_loader(gate.ckpt.format):
        return Findings()
    if gate.options.serving_loader == "transformers" and importlib.util.find_spec("transformers") is None:
        raise ModelSpecError("--serving-loader transformers (serving_loader='transformers'): transformers is not "
                             "installed here; pip install transformers, or observe the plain load (--serving-loader torch)")
    if gate.observing is not None:  # started in a forked child once the read had passed: collected now
        with gate.phase("observe"):
            obs = gate.observing.result()
    else:
        with observe.local_copy(gate.path, gate.ckpt.format) as local:  # a URL: fetched once, deleted after
            if not gate.options.trust:  # the static scan first: a file whose pickles name code never reaches the loader
                try:
                    scanner.ensure_safe(local, gate.ckpt.format)
                except UnsafeCheckpointError as e:
                    return Findings(failures=[f"exact: not handed to the serving loader: {str(e).replace(local, gate.path)}"])
            with gate.phase("observe"):
                obs = observe.observe(local, gate.ckpt.format, gate.source.model, gate.options, dict(gate.ckpt.devices),
                                      gate.ckpt.state_dict_key)
        obs.error = obs.error.replace(local, gate.path) if obs.error else obs.error  # (a URL's temp copy: the URL)
    found = Findings(notes=list(obs.notes), fields={"observed": obs.to_dict()})
    if obs.error is not None:
        where = {"process": "", "build": "building the model: ", "load": "the load: ",
                 "strict": "the strict load: "}[obs.stage or "process"]
        found.failures.append(f"exact: the serving loader failed as saved: {obs.call}: {where}{shown(obs.error, 400)}"
                              + serving.loader_hint(obs, gate.aliases))
    differ = observe.read_differs(obs, serving.plainly_loaded(gate.ckpt), gate.with_values) if obs.digests else []
    if differ:
        why = ("the file changed at the URL between the two reads, or a ckptfix reader bug" if locations.is_remote(gate.path)
               else "a ckptfix reader bug: please report it")
        found.failures.append(f"exact: ckptfix's read and {obs.call.split(' + ')[0]} part: {'; '.join(differ)} ({why})")
    return found


def devices(gate: Gate, report: VerifyReport) -> Findings:
    """With ``exact``: the saved devices the serving code can't load on (``serving_device``, else this machine's)."""
    return Findings(failures=list(gate.off_device))


@model_free
def zip_crcs(gate: FileGate, report: VerifyReport) -> Findings:
    """The CRC-32 a zip stores for each member, against its bytes (with or without the forward check); a zip that
    records none (torch's CRC-less saves) is a warning, not damage."""
    if not format_of(gate.ckpt.format).zip:
        return Findings()
    with gate.phase("crc"):
        failures, unchecked = integrity.crc_findings(gate.path, gate.ckpt.format)
        return Findings(failures=failures, warnings=[f"integrity: {line}" for line in unchecked], supersedes=unchecked)


@model_free
def tensor_digests(gate: FileGate, report: VerifyReport) -> Findings:
    """Model-free: the per-tensor digests a ckptfix output records, against its bytes, naming each tensor that
    doesn't match (docs/digests.md); a file that records none has nothing to check. A URL's: checked as it was read,
    on the bytes the read fetched (:func:`ckptfix.model.gate.open_gate`)."""
    if gate.url_digests is not None:
        return Findings(failures=gate.url_digests)
    return Findings(failures=integrity.digest_failures(gate.path, gate.ckpt.format))


def forward_outputs(gate: Gate, report: VerifyReport) -> Findings:
    """With values, where the file loads: the forward check (:func:`_run_forward`); else a note of why not."""
    o = gate.options
    request = fwd.ForwardRequest(o.reference, o.golden, o.record_golden, o.atol, o.rtol, o.input_shape, o.input_dtype,
                                 o.input_range, o.inputs, o.seed)
    found = Findings()
    if gate.runs_forward and gate.fit.loads:
        found = _run_forward(gate, report, gate.structure if gate.is_fresh else gate.source.fresh(), request)
    elif gate.runs_forward:
        found.notes.append("forward check skipped: the checkpoint does not load into the model" + request.ignored)
    elif gate.with_values:
        found.notes.append("no forward check (--no-forward): the model was not loaded; NaN/Inf checked on the "
                           "values as read" + request.ignored)
    else:
        why = "--structure-only" if o.structure_only else "map_location meta"
        found.notes.append(f"structure only ({why}): read on meta; NaN/Inf and forward not checked" + request.ignored)
    if o.golden is not None and found.fields.get("golden", report.golden) is None:
        found.fields["golden"] = {"path": os.fspath(o.golden), "action": "skipped", "input": None, "outputs": None}
    return found


def _run_forward(gate: Gate, report: VerifyReport, net: Any, req: fwd.ForwardRequest) -> Findings:
    """Load into a fresh model (strictly, as torch does); with a reference or golden outputs, run it
    (:func:`_outputs`)."""
    try:
        with gate.phase("load"):
            net.load_state_dict(gate.fit.state_dict, strict=True)
    except (RuntimeError, ValueError, TypeError) as e:
        return Findings(failures=[f"torch's load_state_dict refused the repaired state dict: {str(e).splitlines()[0]}"])
    if req.reference is None and req.golden is None:
        return Findings()
    with gate.phase("forward"):
        return _outputs(gate, report, net, req)


def _outputs(gate: Gate, report: VerifyReport, net: Any, req: fwd.ForwardRequest) -> Findings:
    """Run the loaded model on one input and compare its outputs with the reference's and the golden file's;
    record the golden file when asked."""
    found = Findings()
    recorded = _golden_to_compare(req, net)
    recipe = resolve_input(net, req.input_shape, req.input_dtype, req.input_range, req.seed, req.inputs,
                           recorded=recorded.input if recorded else None)
    args, kwargs = recipe.make()
    out = fwd.named_outputs(fwd.run_model(net, args, kwargs, recipe.describe()))
    checks = []
    if recorded is not None:
        checks.append(fwd.compare_outputs("golden", recorded.path, out, recorded.outputs, req.atol, req.rtol, recipe,
                                          default="recorded"))
        found.fields["golden"] = {"path": recorded.path, "action": "compared", "input": recipe.to_dict(),
                                  "outputs": gold.summary(recorded.outputs)}
    if req.reference is not None:
        ref_net = _load_reference(req.reference, gate.source, gate.options.map_location, gate.options.trust)
        want = fwd.named_outputs(fwd.run_model(ref_net, args, kwargs, recipe.describe()))
        half = gate.source.dtype_name not in (None, "float32")
        checks.append(fwd.compare_outputs("reference", os.fspath(req.reference), out, want, req.atol, req.rtol, recipe,
                                          default="dtype" if half else "exact"))
    if checks:
        diffs = [c["max_abs_diff"] for c in checks]
        found.fields["forward"] = {"max_abs_diff": None if None in diffs else max(diffs), "ok": all(c["ok"] for c in checks),
                                   "atol": float(req.atol or 0.0), "rtol": float(req.rtol or 0.0), "against": checks}
    for c in checks:
        if not c["ok"]:
            how = "a different output structure" if c["max_abs_diff"] is None else f"max abs diff {c['max_abs_diff']:.3g}"
            found.failures.append(f"forward output differs from the {c['what']} ({how}, {text.describe_tolerance(c)})")
    if req.golden is not None and recorded is None:
        passed = not (report.failures or found.failures)
        _record_golden(found, passed, report, os.fspath(req.golden), out, recipe, net, gate.source.label)
    return found


def _golden_to_compare(req: fwd.ForwardRequest, net: Any) -> gold.Golden | None:
    """The golden file to compare with: None when there is none yet or it is to be recorded again."""
    if req.golden is None or req.record_golden or not os.path.lexists(req.golden):
        return None
    recorded = gold.read_golden(req.golden)
    runs_in = models.float_dtype(net)
    if recorded.dtype != runs_in:
        short = fixes.SHORT_DTYPES.get(recorded.dtype, recorded.dtype)
        raise GoldenError(f"golden {recorded.path}: recorded with the model in {recorded.dtype}, but it runs in "
                          f"{runs_in} here; pass --dtype {short} (library: dtype={short!r}), or record it again "
                          "(--record-golden)")
    return recorded


def _record_golden(found: Findings, passed: bool, report: VerifyReport, where: str, out: dict[str, Any],
                   recipe: InputRecipe, net: Any, label: str) -> None:
    """Write this run's outputs as the golden file, only when everything else ``passed``."""
    entry: dict[str, Any] = {"path": where, "input": recipe.to_dict(), "outputs": gold.summary(out)}
    if not passed:
        found.fields["golden"] = {**entry, "action": "skipped"}
        found.notes.append(f"golden outputs not recorded to {where}: the checkpoint failed verification")
        return
    gold.write_golden(where, out, entry["input"], models.float_dtype(net), model=label,
                      checkpoint=os.path.basename(report.checkpoint.rstrip("/")), checkpoint_sha256=report.sha256)
    found.fields["golden"] = {**entry, "action": "recorded"}


def _load_reference(reference: Any, source: models.ModelSource, map_location: Any, trust: bool) -> Any:
    ref = api.read(reference, map_location=map_location, trust=trust)
    ref.require_state_dict()
    net = source.fresh()
    target = repair.describe_target(net)
    _, fit = repair.fit_to_model(ref.state_dict, target, source=ref.path)
    if not fit.loads:
        raise LoadError(f"reference {ref.path}: does not load into the model ({len(fit.missing)} missing, "
                        f"{len(fit.unexpected)} unexpected, {len(fit.shape_mismatch)} shape mismatch); "
                        "`ckptfix verify` it against the model first")
    net.load_state_dict(fit.state_dict, strict=True)
    return net


@model_free
def signature(gate: FileGate, report: VerifyReport) -> Findings:
    """With ``signature``: PATH against its OpenSSF model signature, offline; each changed, missing or extra file,
    a wrong key or Sigstore signer, a renamed file fails."""
    opts = gate.options
    if opts.signature is None:
        return Findings()
    with gate.phase("signature"):
        signer = (signing.SigstoreSigner(opts.sigstore_identity, opts.sigstore_issuer, opts.trust_config)
                  if opts.sigstore_identity is not None and opts.sigstore_issuer is not None else None)
        check = signing.verify_signature(gate.path, opts.signature, opts.public_key, opts.certificate_chain, signer)
    notes = [f"signature: {len(check.files)} file(s) verified against {opts.signature}"] if check.ok else []
    return Findings(failures=check.failures, notes=notes, fields={"signature": check.to_dict()})


#: the gate's checks, run in this order: each adds its findings after the earlier ones' (failures, warnings,
#: notes read in this order); a later check may read what an earlier one found (``key_fit`` the ``tensor_values``)
CHECKS: tuple[Callable[[Any, VerifyReport], Findings], ...] = (
    sha256, signature, served_keys, fix_command, tensor_values, key_fit, module_metadata, unsafe_globals,
    quant_checks.quantized_groups, quant_checks.against_original,  # issue 28: quantized groups (model-free)
    as_saved, devices, zip_crcs, tensor_digests, observed_load, forward_outputs)
