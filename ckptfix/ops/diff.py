"""Compare two checkpoints tensor by tensor: keys on one side only, shapes, dtypes, values.

Both sides are normalised to the single form (no wrapper segments) first unless ``raw``, so a
DDP original and its converted copy compare as identical.

>>> ckptfix.diff("ddp_run.pth", "model.safetensors").identical   # doctest: +SKIP
True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import text
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
    """Compare the state dicts of checkpoints ``a`` and ``b`` (normalised to the single form unless ``raw``)."""
    import os

    import torch

    if str(map_location).strip().lower() == "meta":
        raise DeviceError("diff compares tensor values; map_location='meta' reads none (use cpu)")

    def state_dict(path: Any) -> Any:
        if raw:
            ckpt = read(path, map_location=map_location, trust=trust, select=select)
            ckpt.require_state_dict()
            return ckpt.state_dict
        return load(path, map_location=map_location, select=select, trust=trust)

    sa, sb = state_dict(a), state_dict(b)
    report = DiffReport(os.fspath(a), os.fspath(b), raw, atol, rtol)
    report.only_a, report.only_b = [k for k in sa if k not in sb], [k for k in sb if k not in sa]
    common = [k for k in sa if k in sb]
    equal = 0
    for key in common:
        x, y = sa[key], sb[key]
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            report.max_abs_diff[key] = None
            if type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y:
                equal += 1
            else:
                report.value_mismatch.append({"key": key, "max_abs_diff": None})
            continue
        for path, t in ((a, x), (b, y)):
            if t.is_meta:  # torch rebuilds it (_rebuild_meta_tensor_no_storage) holding no values to compare
                raise DeviceError(f"diff compares tensor values; {os.fspath(path)}: {shown(repr(key))} was saved on "
                                  "meta and holds none")
        x, y = _values_of(x), _values_of(y)
        if x.shape != y.shape:
            report.shape_mismatch.append({"key": key, "a": list(x.shape), "b": list(y.shape)})
            continue
        if x.dtype != y.dtype:
            report.dtype_mismatch.append({"key": key, "a": dtype_name(x.dtype), "b": dtype_name(y.dtype)})
        d, close = tensor_diff(x, y, atol, rtol)
        report.max_abs_diff[key] = d
        if not close:
            report.value_mismatch.append({"key": key, "max_abs_diff": d})
        equal += close and x.dtype == y.dtype
    report.counts = {
        "common": len(common), "equal": equal, "values": len(report.value_mismatch),
        "shape": len(report.shape_mismatch), "dtype": len(report.dtype_mismatch),
        "only_a": len(report.only_a), "only_b": len(report.only_b),
    }
    return report

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

