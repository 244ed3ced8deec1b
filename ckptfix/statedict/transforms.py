"""State-dict transforms beyond wrappers: dtype casts, regex renames, mapping onto a model by order.

Small pure functions over (Ordered)dicts of tensors; each returns the new state dict and what it
did, and refuses (CkptfixError) rather than guess.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConversionError, KeyCollisionError, pass_flag
from ..core.units import dtype_name
from .wrappers import rename_state_dict

#: ``--dtype`` names → torch dtype names (the CLI's choices are these keys)
CAST_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: other spellings ``parse_dtype`` accepts from Python callers
_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


@dataclass
class CastReport:
    """Which tensors a dtype cast changed, which it left alone, and infs it produced."""

    dtype: str
    cast: dict[str, int] = field(default_factory=dict)  # "float32->float16" -> count
    kept: dict[str, int] = field(default_factory=dict)  # dtype left alone (int, bool, …) -> count
    overflow_keys: list[str] = field(default_factory=list)
    infs_produced: int = 0
    #: (key, source tensor, cast tensor) for tensors on meta, whose values are checked when
    #: the writer computes them (see ``check_values``)
    deferred: list[tuple[str, Any, Any]] = field(default_factory=list)
    allow_overflow: bool = False

    def check_values(self, key: str, before: Any, after: Any) -> None:
        """Count the infs a cast produced; refuse an overflow to inf unless allowed.

        Cheap in the common case (one boolean pass over ``after``), as it runs on every tensor.
        """
        import torch

        if not after.numel() or not after.is_floating_point():
            return
        inf_after = torch.isinf(after)
        if not bool(inf_after.any()):
            return
        new = inf_after & torch.isfinite(before)
        del inf_after
        produced = int(new.sum())
        if not produced:
            return
        self.overflow_keys.append(key)
        if not self.allow_overflow:
            limit = "±65504 (float16)" if after.dtype == torch.float16 else f"{after.dtype}'s range"
            raise ConversionError(
                f"casting to {self.dtype} would overflow to inf in {key!r}: values beyond {limit}; "
                + ("use bf16, or " if after.dtype == torch.float16 else "")
                + pass_flag("allow_overflow")
            )
        self.infs_produced += produced


def parse_dtype(name: str) -> Any:
    import torch

    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in CAST_DTYPES:
        raise ConversionError(f"unknown dtype {name!r}; choose {', '.join(CAST_DTYPES)}")
    return getattr(torch, CAST_DTYPES[key])


def cast_floating(state_dict: Mapping[str, Any], dtype: str, allow_overflow: bool = False,
                  keep: Collection[str] = ()) -> tuple[OrderedDict, CastReport]:
    """Cast floating-point tensors to ``dtype``; integer buffers (num_batches_tracked), bool and the ``keep`` keys
    (a quantized group's weight and scales: a cast would change what they stand for) stay as stored.

    Values beyond float16's range would become inf: refused unless ``allow_overflow``.
    Tensors that shared storage still share it afterwards. Tensors on ``meta`` (a streaming
    conversion) are cast in shape only; their values are checked as they are written
    (``report.deferred``).
    """
    import torch

    target = parse_dtype(dtype)
    report = CastReport(dtype=dtype_name(target), allow_overflow=allow_overflow)
    cast_cache: dict[tuple, Any] = {}
    out: OrderedDict = OrderedDict()
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == target \
                or t.layout != torch.strided or key in keep:  # (a sparse tensor is kept as saved: its values aren't cast)
            out[key] = t
            if isinstance(t, torch.Tensor):
                name = dtype_name(t.dtype)
                report.kept[name] = report.kept.get(name, 0) + 1
            continue
        view = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
                t.is_conj(), t.is_neg())  # (a conjugate or negative view of the same bytes is another tensor)
        if view in cast_cache:
            out[key] = cast_cache[view]
            continue
        new = t.to(target)
        if t.device.type == "meta":
            report.deferred.append((key, t, new))
        else:
            report.check_values(key, t, new)
        cast_cache[view] = new
        out[key] = new
        label = f"{dtype_name(t.dtype)}->{report.dtype}"
        report.cast[label] = report.cast.get(label, 0) + 1
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out, report


def parse_rename(rule: str) -> tuple[re.Pattern, str]:
    """``'REGEX=REPLACEMENT'`` (split at the first ``=``) → compiled pattern and replacement."""
    if "=" not in rule:
        raise ConversionError(f"--rename {rule!r}: expected REGEX=REPLACEMENT, e.g. 'layer4\\.(.*)=stage4.\\1'")
    pattern, replacement = rule.split("=", 1)
    try:
        return re.compile(pattern), replacement
    except re.error as e:
        raise ConversionError(f"--rename {rule!r}: bad regular expression: {e}") from None


def rename_keys(state_dict: Mapping[str, Any], rules: Iterable[str], source: str = "checkpoint") -> tuple[OrderedDict, int]:
    """Apply regex renames in order (full match on each key); ``_metadata`` follows; collisions refused.

    Returns the new state dict and how many keys changed.
    """
    compiled = [parse_rename(r) for r in rules]

    def fn(key: str) -> str:
        for pattern, replacement in compiled:
            m = pattern.fullmatch(key)
            if m:
                try:
                    key = m.expand(replacement)
                except (re.error, IndexError) as e:
                    raise ConversionError(f"--rename {pattern.pattern}={replacement}: {e}") from None
        return key

    out = rename_state_dict(state_dict, fn, source=source)
    changed = sum(1 for a, b in zip(state_dict.keys(), out.keys()) if a != b)
    return out, changed


def map_by_order(state_dict: Mapping[str, Any], model_state: Mapping[str, Any],
                 source: str = "checkpoint") -> tuple[OrderedDict, list[tuple[str, str]]]:
    """Give the checkpoint's tensors the model's names by position — only when counts match and
    every shape agrees in order; otherwise refuse naming the first disagreement."""
    import torch

    ckpt = [(k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor)]
    model = [(k, v) for k, v in model_state.items() if isinstance(v, torch.Tensor)]
    if len(ckpt) != len(model):
        raise ConversionError(
            f"{source}: --by-order needs the same number of tensors: checkpoint has {len(ckpt)}, model has {len(model)}"
        )
    for i, ((ck, cv), (mk, mv)) in enumerate(zip(ckpt, model)):
        if tuple(cv.shape) != tuple(mv.shape):
            raise ConversionError(
                f"{source}: --by-order refused: tensor #{i} {ck!r} has shape {list(cv.shape)} but the model's "
                f"#{i} {mk!r} has {list(mv.shape)}; the orders differ, rename with --rename instead"
            )
    mapping = [(ck, mk) for (ck, _), (mk, _) in zip(ckpt, model)]
    dup = [k for k, n in Counter(mk for _, mk in mapping).items() if n > 1]
    if dup:
        raise KeyCollisionError(f"{source}: model keys {dup[:3]} appear twice")
    out: OrderedDict = OrderedDict((mk, state_dict[ck]) for ck, mk in mapping)
    meta = getattr(model_state, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict(meta)  # type: ignore[attr-defined]
    return out, mapping
