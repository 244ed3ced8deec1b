"""The gate the checks look at: :class:`FileGate` (the checkpoint as read, the options) and, with a model,
:class:`Gate` (the model and the key repair that fits it too); the report before any check (:func:`first_report`).

A check declares with :func:`model_free` that it needs no model: ``verify PATH`` without ``--model`` runs only
those, on a :class:`FileGate`; every other check runs with a model, on a :class:`Gate`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from ..core import locations
from ..core.progress import Phases
from ..errors import UnsafeCheckpointError
from ..ops import quant_compare, reading
from ..reports import Checkpoint
from ..safety import integrity, scanner
from ..statedict import metadata, repair
from . import observe, serving
from . import spec as models
from .findings import Findings, VerifyReport
from .verify_options import VerifyOptions


@dataclass
class FileGate:
    """What the model-free checks look at: the options and the checkpoint as read (``verify PATH`` without a model
    builds only this; :class:`Gate` adds the model)."""

    options: VerifyOptions
    path: str  #: what was read: the path given, or the one file of a save_pretrained directory
    #: the tensors were read with their values (not on meta): NaN/Inf checked, and the forward check runs unless
    #: ``forward`` is off
    with_values: bool
    ckpt: Checkpoint
    phase: Phases  #: ``with gate.phase("hash"):`` a line on stderr as the step ends (not on a terminal)
    #: the file's SHA-256, computed on a thread while it was read (None: not asked for, a URL, or a directory)
    digest: integrity.HashAlongside | None = field(default=None, kw_only=True)
    #: a URL's digest findings, checked inside the read's session on the CRC-32s of the storages it fetched (the
    #: same version of the file, nothing fetched again); None: a local file's, which the check reads itself
    url_digests: list[str] | None = field(default=None, kw_only=True)

    @property
    def runs_forward(self) -> bool:
        """The model is loaded (and run, with a reference or golden outputs): never without a model."""
        return False

    @property
    def values(self) -> Any:
        """The state dict whose values the checks read: as read (with a model: as repaired to fit it)."""
        return self.ckpt.state_dict

    @property
    def value_keys(self) -> list[str]:
        """The keys whose values are checked for NaN/Inf as they are (with a model: the model's keys); a quantized
        group's tensors are checked after dequantization instead (:mod:`ckptfix.model.quant_checks`)."""
        grouped = set(self.quant.grouped)
        return [k for k in self.ckpt.state_dict if k not in grouped]

    @property
    def tied(self) -> list[list[str]]:
        """The groups of keys the model ties (none without a model)."""
        return []

    @cached_property
    def quant(self) -> quant_compare.Quantized:
        """The file's quantized groups, found once (:func:`ckptfix.ops.quant_compare.find`)."""
        return quant_compare.find(self.ckpt.path, self.ckpt.state_dict)


@dataclass
class Gate(FileGate):
    """What every check looks at: :class:`FileGate`, the model, and the key repair that fits them."""

    source: models.ModelSource
    structure: Any  #: the model as built for the read: on meta without values
    is_fresh: bool  #: ``structure`` is a fresh model the forward check may load into
    target: repair.Target
    chosen: repair.Repair
    fit: repair.Fit
    #: with ``exact``: the serving loader already running in a forked child beside the gate (None: observed at the
    #: check, in a fresh process — :func:`ckptfix.model.observe.start` says where)
    observing: observe.Forked | None = field(default=None, kw_only=True)

    def close(self) -> None:
        """End what the gate started and no check collected (the observing child, when a step before it raised)."""
        if self.observing is not None:
            self.observing.close()

    @property
    def runs_forward(self) -> bool:
        """The model is loaded (and run, with a reference or golden outputs): values read, ``forward`` on."""
        return self.with_values and self.options.forward

    @property
    def values(self) -> Any:
        return self.fit.state_dict

    @property
    def value_keys(self) -> list[str]:
        return list(self.target.shapes)

    @property
    def tied(self) -> list[list[str]]:
        return [list(group) for group in self.target.tied]

    @cached_property
    def aliases(self) -> serving.Aliases:
        """With ``exact``: the tied keys the serving loader does not return (none without)."""
        if not self.options.exact:
            return serving.Aliases()
        loaded = serving.plainly_loaded(self.ckpt)
        return serving.check_aliases(self.ckpt.state_dict, loaded, self.chosen.fn, self.target,
                                     serving.retie_hook(self.structure), self.options.serving_loader)

    @cached_property
    def off_device(self) -> list[str]:
        """With ``exact``: a failure line per saved device the serving code can't load on (none without)."""
        if not self.options.exact:
            return []
        return serving.device_failures(self.ckpt.devices, self.options.serving_device, serving.loader(self.ckpt.format))


Check = TypeVar("Check", bound=Callable[..., Findings])


def model_free(check: Check) -> Check:
    """Declare a check that needs no model: ``verify PATH`` without one runs it too, on a :class:`FileGate`
    (a check without this runs only with a model, on a :class:`Gate`)."""
    check.needs_model = False  # type: ignore[attr-defined]
    return check


def needs_model(check: Callable[..., Findings]) -> bool:
    """Whether ``check`` runs only with a model (:func:`model_free` says it doesn't)."""
    return bool(getattr(check, "needs_model", True))


def open_gate(path: Any, model: Any, options: VerifyOptions) -> FileGate:
    """Read the checkpoint (on meta with ``structure_only``); with a model, build it (on meta without the forward
    check) and fit its keys to the model's."""
    phase = Phases("verify", options.progress)
    with_values = not options.structure_only and str(options.map_location).strip().lower() != "meta"  # meta: no values
    # the model spec's builder found before anything is read (a spec naming nothing fails first)
    source = models.ModelSource(model, options.model_args, options.dtype) if model is not None else None
    hashed = options.checksum or (model is not None and with_values and options.forward)  # (what sha256 asks for)
    digest = integrity.HashAlongside(os.fspath(path)) if hashed and not locations.is_remote(os.fspath(path)) else None
    with phase("read"), locations.session() as session:
        try:
            ckpt = reading.read_checkpoint(os.fspath(path), options.map_location if with_values else "meta",
                                           options.trust, options.select, refuse=True, judged=True)
        except UnsafeCheckpointError as e:
            e.finding = True  # the file judged is unsafe: a finding (an --input's or --reference's is an error)
            raise
        ckpt.require_state_dict()
        url_digests = (integrity.digest_failures(ckpt.path, ckpt.format, session.fetched)
                       if locations.is_remote(ckpt.path) else None)
    if source is None:
        return FileGate(options, ckpt.path, with_values, ckpt, phase, digest=digest, url_digests=url_digests)
    observing = _observe_early(ckpt, source, options, with_values)
    try:
        with phase("build"):
            structure, is_fresh = source.structure(meta=not (with_values and options.forward))
        target = repair.describe_target(structure, float_dtype=source.dtype)
        chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=ckpt.path)
    except BaseException:
        if observing is not None:
            observing.close()
        raise
    return Gate(options, ckpt.path, with_values, ckpt, phase, source, structure, is_fresh, target, chosen, fit,
                digest=digest, url_digests=url_digests, observing=observing)


def _observe_early(ckpt: Checkpoint, source: models.ModelSource, options: VerifyOptions,
                   with_values: bool) -> observe.Forked | None:
    """With ``exact``, a local file the static scan passes: the serving loader started now in a forked child, beside
    the model's build and the checks (:func:`ckptfix.model.observe.start`); None: observed at its check instead."""
    if not options.exact or not serving.has_loader(ckpt.format) or locations.is_remote(ckpt.path):
        return None
    if not options.trust:
        try:
            scanner.ensure_safe(ckpt.path, ckpt.format)
        except UnsafeCheckpointError:
            return None  # the check scans again and says why nothing was handed to the loader
    return observe.start(ckpt.path, ckpt.format, source.model, options, dict(ckpt.devices), ckpt.state_dict_key,
                         serving.plainly_loaded(ckpt), with_values)


def first_report(gate: FileGate) -> VerifyReport:
    """The report before any check: what the read and (with a model) the key repair found."""
    ckpt, o = gate.ckpt, gate.options
    report = VerifyReport(
        ok=False, checkpoint=gate.path, model=None, fix=None, missing=[], unexpected=[], shape_mismatch=[],
        dtype_mismatch=[], nonfinite=None, forward=None, sha256=None, exact=o.exact, format=ckpt.format,
        state_dict_key=ckpt.state_dict_key, notes=_notes(ckpt), devices=dict(ckpt.devices),
        serving_device=o.serving_device)
    if isinstance(gate, Gate):
        fit = gate.fit
        report.model, report.fix, report.model_dtype = gate.source.label, gate.chosen.description, gate.source.dtype_name
        report.missing, report.unexpected, report.shape_mismatch = fit.missing, fit.unexpected, fit.shape_mismatch
        report.dtype_mismatch, report.non_tensor, report.tolerated = fit.dtype_mismatch, fit.non_tensor, fit.tolerated
        report.matched, report.total = gate.chosen.matched, gate.chosen.total
    return report


def _notes(ckpt: Checkpoint) -> list[str]:
    """The read's notes, less what :func:`ckptfix.model.checks.module_metadata` reports as failures."""
    dropped = {metadata.note(line) for line in ckpt.metadata_dropped}
    return [n for n in ckpt.notes if n not in dropped]
