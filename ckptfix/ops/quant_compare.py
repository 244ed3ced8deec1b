"""A checkpoint's quantized groups as the verbs that judge values see them (``verify``, ``diff``): the configs
beside the file (:func:`ckptfix.ops.quantized.read_configs`), the groups the schemes table finds
(:mod:`ckptfix.statedict.quant_groups`), and a dequantized weight compared with the original's — max, mean and
relative error, within the scheme's step bound or a tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.units import dtype_name
from ..statedict import quant_dequant, quant_groups
from . import quantized

#: a dequantized weight may exceed its step bound by this fraction (float32 rounding of scale × value)
BOUND_SLACK = 1e-3


@dataclass(frozen=True)
class Quantized:
    """The quantized groups of one state dict: ``layout`` (None: no quantized tensors) and the keys they hold."""

    layout: Any
    grouped: frozenset[str]

    @property
    def groups(self) -> list[Any]:
        return list(self.layout.groups) if self.layout is not None else []


def find(path: str, state_dict: Mapping[str, Any]) -> Quantized:
    """The quantized groups of ``state_dict`` (read from ``path``), the config beside it deciding look-alikes."""
    import torch

    infos = {k: (dtype_name(t.dtype), tuple(t.shape)) for k, t in state_dict.items()  # sparse, nested: no scheme's
             if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested}
    layout = quant_groups.find_groups(infos, quantized.read_configs(path).for_schemes())
    if not (layout.groups or layout.problems or layout.unknown):
        return Quantized(None, frozenset())
    return Quantized(layout, frozenset(k for k in infos if k not in layout.plain))


def original_key(group: Any, original: Mapping[str, Any]) -> str | None:
    """The key of the original's weight a group dequantizes to: the group's module + ``.weight``, else the
    module itself (gpt-oss ``experts.gate_up_proj_blocks`` → ``experts.gate_up_proj``), else the weight key."""
    for key in (f"{group.module}.weight" if group.module else "weight", group.module, group.weight):
        if key in original:
            return str(key)
    return None


def compare(group: Any, tensors: Mapping[str, Any], original: Any, atol: float | None = None,
            rtol: float | None = None) -> dict[str, Any]:
    """One dequantized weight against the ``original``: ``{key, module, scheme, max_abs_diff, mean_abs_diff,
    rel_error, tolerance, ok}``. ``tolerance``: ``"atol/rtol"`` where either is given (``|d - o| <= atol + rtol·|o|``),
    else ``"step bound"`` for a round-to-nearest scheme (``|d - o|`` within its step bound), else ``"reported"``
    (GPTQ, AWQ, rotated: error-compensating, so no bound; ``ok`` is then None)."""
    import torch

    got = quant_dequant.dequantize(group, tensors, dtype=torch.float32)
    row: dict[str, Any] = {"module": group.module, "scheme": group.scheme, "shape": list(got.shape),
                           "original_shape": list(original.shape)}
    if tuple(got.shape) != tuple(original.shape):
        return {**row, "max_abs_diff": None, "mean_abs_diff": None, "rel_error": None, "tolerance": "shape", "ok": False}
    want = original.detach().to(torch.float32)
    err = (got - want).abs().nan_to_num(nan=float("inf"))
    norm = float(torch.linalg.vector_norm(want))
    off = float(torch.linalg.vector_norm(err))
    rel = off / norm if norm else (0.0 if off == 0 else float("inf"))
    row.update(max_abs_diff=float(err.max()) if err.numel() else 0.0,
               mean_abs_diff=float(err.mean()) if err.numel() else 0.0, rel_error=rel)
    if atol or rtol:
        allowed = (atol or 0.0) + (rtol or 0.0) * want.abs()
        return {**row, "tolerance": "atol/rtol", "ok": bool((err <= allowed).all())}
    bound = quant_dequant.step_bound(group, tensors)
    if bound is None:
        return {**row, "tolerance": "reported", "ok": None}
    beyond = err > bound.to(torch.float32) * (1 + BOUND_SLACK)
    return {**row, "tolerance": "step bound", "ok": not bool(beyond.any()), "beyond": int(beyond.sum())}


def failed_line(key: str, row: dict[str, Any]) -> str:
    """``'quantized model.0 (fp8-block): dequantized weight is off the original's beyond its step bound (…)'``."""
    where = f"quantized {row['module']} ({row['scheme']})"
    if row["tolerance"] == "shape":
        return f"{where}: dequantized to {row['shape']}, the original {key} is {row['original_shape']}"
    how = ("beyond its step bound, at " + f"{row['beyond']} elements" if row["tolerance"] == "step bound"
           else "beyond atol/rtol")
    return (f"{where}: dequantized weight differs from the original {key} {how} (max abs {row['max_abs_diff']:.3g}, "
            f"mean abs {row['mean_abs_diff']:.3g}, relative {row['rel_error']:.3g})")
