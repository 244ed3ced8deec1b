"""What the gate found: each check's :class:`Findings`, and the :class:`VerifyReport` they add up to.

A check returns its findings; :func:`add` puts them into the report in the order the checks run, so the
report's lists read as the checks do (:data:`ckptfix.model.checks.CHECKS`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .. import text


@dataclass
class VerifyReport:
    """The outcome of :func:`ckptfix.verify`; ``to_dict()`` is the CLI's ``--json`` object."""

    ok: bool
    checkpoint: str
    model: str | None  #: the model spec; None: the model-free gate (no model given)
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
    #: with ``exact``: what the serving loader did with the file as saved (``observe.Observation.to_dict``)
    observed: dict[str, Any] | None = None
    #: with ``signature``: the OpenSSF model signature's check (``signing.SignatureCheck.to_dict``: signer, files, verdict)
    signature: dict[str, Any] | None = None
    #: the quantized groups (:mod:`ckptfix.model.quant_checks`): counts per scheme, problems, ``--original``'s errors
    quantization: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_text(self) -> str:
        """The readable summary: verdict, repair, then each problem with its keys, counts first."""
        return text.verify_text(self)


@dataclass
class Findings:
    """What one check found: lines for the report's ``failures`` (any fails the gate), ``warnings`` and ``notes``,
    and the report fields it fills (``{"sha256": …}``, ``{"nonfinite": […]}``)."""

    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    #: the read's notes its lines say instead (a zip recording no CRC-32s: a warning here), left out of ``notes``
    supersedes: list[str] = field(default_factory=list)


def add(report: VerifyReport, found: Findings) -> None:
    """Put one check's findings into the report: its lines after the earlier checks', its fields set."""
    for name, value in found.fields.items():
        if not hasattr(report, name):
            raise AttributeError(f"a gate check filled {name!r}, which VerifyReport has no field for")
        setattr(report, name, value)
    report.failures += found.failures
    report.warnings += found.warnings
    report.notes = [n for n in report.notes if n not in found.supersedes] + found.notes
