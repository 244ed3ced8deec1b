"""Compare two checkpoints tensor by tensor: keys on one side only, shapes, dtypes, values.

Both sides are normalised to the single form (no wrapper segments) first unless ``raw``, so a
DDP original and its converted copy compare as identical. Where one side is quantized and the other is not (a
release against its original), each quantized group is dequantized and compared with the other side's weight
(:func:`ckptfix.ops.quant_compare.compare`): max, mean and relative error, within ``atol``/``rtol`` where given, else
within the scheme's step bound.

>>> ckptfix.diff("ddp_run.pth", "model.safetensors").identical   # doctest: +SKIP
True
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import text
from ..core import locations
from . import quant_compare
from .api import load, read
from ..errors import DeviceError
from ..core.units import dtype_name, shown


@dataclass
class DiffReport:
    """What differs between checkpoints ``a`` and ``b``; ``identical`` within (atol, rtol)."""

    a: str
    b: str
    raw: bool
    atol: float
    rtol: float
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    shape_mismatch: list[dict[str, Any]] = field(default_factory=list)
    dtype_mismatch: list[dict[str, Any]] = field(default_factory=list)
    value_mismatch: list[dict[str, Any]] = field(default_factory=list)
    max_abs_diff: dict[str, float | None] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    #: a quantized side's groups, each dequantized against the other side's weight (:func:`quant_compare.compare`)
    dequantized: list[dict[str, Any]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.shape_mismatch or self.dtype_mismatch or self.value_mismatch)

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, **asdict(self)}

    def format_text(self) -> str:
        return text.diff_text(self)


def diff(
    a: Any,
    b: Any,
    raw: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    map_location: Any = "cpu",
    select: str = "auto",
    trust: bool = False,
) -> DiffReport:
    """Compare the state dicts of checkpoints ``a`` and ``b`` (normalised to the single form unless ``raw``); a
    quantized release against its unquantized original after dequantization."""
    if str(map_location).strip().lower() == "meta":
        raise DeviceError("diff compares tensor values; map_location='meta' reads none (use cpu)")

    def state_dict(path: Any) -> Any:
        if raw:
            ckpt = read(path, map_location=map_location, trust=trust, select=select)
            ckpt.require_state_dict()
            return ckpt.state_dict
        return load(path, map_location=map_location, select=select, trust=trust)

    with locations.holding():  # both files' read leases held until the last value is compared (no SIGBUS)
        sa, sb = state_dict(a), state_dict(b)
        report = DiffReport(os.fspath(a), os.fspath(b), raw, atol, rtol)
        sa, sb = _dequantized(report, a, sa, b, sb)
        report.only_a, report.only_b = [k for k in sa if k not in sb], [k for k in sb if k not in sa]
        common = [k for k in sa if k in sb]
        equal = sum(_compare(report, key, sa[key], sb[key], (os.fspath(a), os.fspath(b))) for key in common)
        report.counts = {
            "common": len(common), "equal": equal, "values": len(report.value_mismatch),
            "shape": len(report.shape_mismatch), "dtype": len(report.dtype_mismatch),
            "only_a": len(report.only_a), "only_b": len(report.only_b),
        }
        return report


def _compare(report: DiffReport, key: str, x: Any, y: Any, paths: tuple[str, str]) -> bool:
    """One common key: its row in ``report`` where the two differ; whether they are equal (within tolerance)."""
    import torch

    atol, rtol = report.atol, report.rtol
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        report.max_abs_diff[key] = None
        if type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y:
            return True
        report.value_mismatch.append({"key": key, "max_abs_diff": None})
        return False
    for path, t in zip(paths, (x, y)):
        if t.is_meta:  # torch rebuilds it (_rebuild_meta_tensor_no_storage) holding no values to compare
            raise DeviceError(f"diff compares tensor values; {path}: {shown(repr(key))} was saved on "
                              "meta and holds none")
    x, y = _values_of(x), _values_of(y)
    if x.shape != y.shape:
        report.shape_mismatch.append({"key": key, "a": list(x.shape), "b": list(y.shape)})
        return False
    if x.dtype != y.dtype:
        report.dtype_mismatch.append({"key": key, "a": dtype_name(x.dtype), "b": dtype_name(y.dtype)})
    d, close = tensor_diff(x, y, atol, rtol)
    report.max_abs_diff[key] = d
    if not close:
        report.value_mismatch.append({"key": key, "max_abs_diff": d})
    return close and x.dtype == y.dtype


def _dequantized(report: DiffReport, a: Any, sa: Any, b: Any, sb: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where exactly one side is quantized: each of its groups dequantized and compared with the other side's
    weight (a row of ``report.dequantized``; beyond the bound: a ``value_mismatch`` too); both state dicts returned
    without what was compared so. Two quantized sides (or none) compare as stored."""
    qa, qb = quant_compare.find(os.fspath(a), sa), quant_compare.find(os.fspath(b), sb)
    if bool(qa.groups) == bool(qb.groups):
        return dict(sa), dict(sb)
    (q, packed, plain) = (qa, dict(sa), dict(sb)) if qa.groups else (qb, dict(sb), dict(sa))
    atol, rtol = report.atol or None, report.rtol or None
    laid_out_wrong = {p.module for p in q.layout.problems}
    for group in q.groups:
        key = quant_compare.original_key(group, plain)
        if key is None or group.module in laid_out_wrong:
            continue  # no weight on the other side, or a broken group: its keys stay, compared as stored
        row = {"key": key, **quant_compare.compare(group, packed, plain[key], atol, rtol)}
        report.dequantized.append(row)
        report.max_abs_diff[key] = row["max_abs_diff"]
        if row["ok"] is False:
            report.value_mismatch.append({"key": key, "max_abs_diff": row["max_abs_diff"]})
        for k in group.keys:
            packed.pop(k, None)
        plain.pop(key)
    return (packed, plain) if qa.groups else (plain, packed)


def tensor_diff(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0) -> tuple[float, bool]:
    """``(max |a - b|, all close)`` for same-shaped tensors; NaN equals NaN, exact when atol=rtol=0. Sparse, nested
    and quantized tensors are compared by the values they stand for (dense, padded with zeros, dequantized)."""
    import torch

    a, b = _values_of(a), _values_of(b)
    if a.dtype == b.dtype and torch.equal(a, b):
        return 0.0, True
    if not any(t.is_floating_point() or t.is_complex() for t in (a, b)):  # integers, bools: exact in int64
        x, y = (t.detach().cpu().to(torch.int64) for t in (a, b))
        d = (x - y).abs()
        return (float(d.max()) if d.numel() else 0.0), bool((d <= atol + rtol * y.abs()).all())
    if a.is_complex() or b.is_complex():
        x, y = (torch.view_as_real(t.detach().cpu().to(torch.complex128)) for t in (a, b))
    else:
        x, y = (t.detach().cpu().to(torch.float64) for t in (a, b))
    same = (x == y) | (x.isnan() & y.isnan())
    d = torch.where(same, torch.zeros_like(x), (x - y).abs()).nan_to_num(nan=math.inf)
    close = bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all())
    return (float(d.max()) if d.numel() else 0.0), close


def _values_of(t: Any) -> Any:
    """A strided tensor of the values ``t`` stands for: a sparse one made dense, a nested one padded with zeros, a
    quantized one dequantized (``torch.equal`` and the arithmetic below take strided tensors only)."""
    import torch

    if t.is_nested:
        return torch.nested.to_padded_tensor(t, 0.0)
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.dequantize() if t.is_quantized else t

