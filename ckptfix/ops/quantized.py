"""Quantized groups where a verb changes values: a cast keeps them as stored, a dequantization writes each as one
plain weight (``convert --dtype`` / ``--dequantize``, ``load(dequantize=True)``, ``load_into``).

The schemes, how their groups are found, checked and dequantized are :mod:`ckptfix.statedict.quant_schemes`'s table;
this module reads the configs beside a checkpoint (``config.json``'s ``quantization_config``, modelopt's
``hf_quant_config.json``) and applies the table to a whole state dict, so the verbs say the same thing the same way.
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import locations
from ..core.units import dtype_name, few, shown
from ..errors import FormatError, KeyCollisionError, pass_flag
from ..statedict import quant_dequant, quant_groups
from ..statedict.quant_groups import QuantGroup, QuantLayout
from ..statedict.transforms import CAST_DTYPES

CONFIG = "config.json"
#: modelopt's own file: it says the checkpoint is quantized, so a dequantized output never carries it
HF_QUANT_CONFIG = "hf_quant_config.json"
#: ``torch_dtype`` values a dequantization keeps by default (the release's compute dtype); anything else: float32
_DEFAULT_DTYPES = ("bfloat16", "float16")
#: a config file bigger than this is not read (a config is kilobytes; the tensors' names still name the schemes)
_CONFIG_MAX_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Configs:
    """The JSON configs beside a checkpoint, as ``find_groups`` reads them (None: absent, or a URL)."""

    config: dict[str, Any] | None = None
    hf_quant: dict[str, Any] | None = None

    def for_schemes(self) -> dict[str, Any] | None:
        """What selects among look-alike schemes: config.json where it holds a ``quantization_config``, else
        hf_quant_config.json (modelopt's export), else config.json (None: neither)."""
        if self.config is not None and "quantization_config" in self.config:
            return self.config
        return self.hf_quant if self.hf_quant is not None else self.config

    def default_dtype(self) -> str:
        """The dtype a dequantization writes unless told: the config's ``torch_dtype`` (``dtype`` in transformers 5)
        where it is bfloat16 or float16, else float32 (the dequantized values exactly, as far as float32 holds them)."""
        config = self.config or {}
        named = config.get("torch_dtype", config.get("dtype"))
        return named if named in _DEFAULT_DTYPES else "float32"

    def unquantized(self) -> dict[str, Any] | None:
        """config.json without ``quantization_config``: what a dequantized directory output gets."""
        if self.config is None:
            return None
        return {k: v for k, v in self.config.items() if k != "quantization_config"}


def read_configs(path: str) -> Configs:
    """``config.json`` and ``hf_quant_config.json`` of a local checkpoint's folder (the directory itself, or the folder
    of a file or index); a URL, or a file that isn't a JSON object, reads as absent."""
    if locations.is_remote(path):
        return Configs()
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return Configs(_json_object(os.path.join(folder, CONFIG)), _json_object(os.path.join(folder, HF_QUANT_CONFIG)))


def _json_object(path: str) -> dict[str, Any] | None:
    """A JSON object read from ``path``; None where it is missing, too big for a config, or not an object."""
    try:
        if os.path.getsize(path) > _CONFIG_MAX_BYTES:
            return None
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def find(state_dict: Mapping[str, Any], configs: Configs) -> QuantLayout:
    """The state dict's :class:`~ckptfix.statedict.quant_groups.QuantLayout` (tensors or TensorInfo, on meta too)."""
    infos = {k: (v.dtype if isinstance(v.dtype, str) else dtype_name(v.dtype), tuple(v.shape))
             for k, v in state_dict.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
    return quant_groups.find_groups(infos, configs.for_schemes())


def grouped_keys(layout: QuantLayout) -> frozenset[str]:
    """Every key a quantized group holds: its weight and its companions (scales, zero points, …)."""
    return frozenset(k for g in layout.groups for k in (g.weight, *g.companions.values()))


def schemes(groups: list[QuantGroup]) -> str:
    """``fp8-block`` / ``fp8-block ×2, nvfp4 ×1``: the schemes of ``groups``, with counts where there are several."""
    counts = Counter(g.scheme for g in groups)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name} ×{n}" for name, n in counts.items())


def kept_note(layout: QuantLayout) -> str | None:
    """``kept 3 quantized groups (fp8-block) as stored``: what a cast left alone, or None where it left no group."""
    n = len(layout.groups)
    return f"kept {n} quantized group{'s' if n != 1 else ''} ({schemes(layout.groups)}) as stored" if n else None


def refuse_cast(layout: QuantLayout, state_dict: Mapping[str, Any], source: str, what: str) -> None:
    """A float8 or packed-integer tensor beside scales of no scheme ckptfix knows, or a broken group's tensor (a weight
    without its scales, an orphan scale): ``what`` (a cast) would change it without the rest. Refused in one line
    naming the key and the option that treats such tensors as plain."""
    odd = list(layout.unknown) + [p.key for p in layout.problems]
    if not odd:
        return
    key = odd[0]
    value = state_dict[key]
    dtype = value.dtype if isinstance(value.dtype, str) else dtype_name(value.dtype)
    why = ("beside scale tensors of no quantization scheme ckptfix knows" if layout.unknown else
           f"of a broken quantized group ({layout.problems[0].message})")
    more = f" (and {len(odd) - 1} more: {few(odd[1:])})" if len(odd) > 1 else ""
    raise FormatError(f"{source}: {shown(key)} is {dtype} {why}{more}; {what} would change what it stands for. To "
                      "cast such tensors as plain ones, " + pass_flag("cast_unknown_quantized"))


def refuse_problems(layout: QuantLayout, source: str, what: str) -> None:
    """A broken group (a weight without its scales, an orphan scale, a wrong grid …) can't be ``what``: refused,
    naming the module."""
    if not layout.problems:
        return
    first = layout.problems[0]
    more = f" ({len(layout.problems) - 1} more problem(s))" if len(layout.problems) > 1 else ""
    raise FormatError(f"{source}: can't {what} module {shown(first.module)}: {first.message}{more}")


def torch_dtype(name: str) -> Any:
    """``bf16`` / ``bfloat16`` → ``torch.bfloat16``."""
    import torch

    return getattr(torch, CAST_DTYPES.get(name, name))


def dequantize_groups(state_dict: Mapping[str, Any], groups: list[QuantGroup], dtype: Any, source: str,
                      dtypes: Mapping[str, Any] | None = None) -> OrderedDict:
    """``state_dict`` with each of ``groups`` replaced by its dequantized weight in ``dtype`` (a torch dtype; ``dtypes``:
    another one by weight key), at its weight's place under its ``dequantized_key``, its companions dropped; each
    group's values checked first (``check_values``: scales finite and positive …), a bad one refused naming its module."""
    by_weight = {g.weight: g for g in groups}
    dropped = {k for g in groups for k in g.companions.values()}
    out: OrderedDict = OrderedDict()
    for key, value in state_dict.items():
        if key in dropped:
            continue
        group = by_weight.get(key)
        if group is None:
            if key in out:
                raise KeyCollisionError(f"{source}: {shown(key)} is both a tensor and a dequantized group's weight")
            out[key] = value
            continue
        tensors = {k: state_dict[k] for k in (group.weight, *group.companions.values())}
        problems = quant_groups.check_values(group, tensors)
        if problems:
            raise FormatError(f"{source}: can't dequantize module {shown(group.module)}: {problems[0].message}")
        new = group.dequantized_key
        if new in out or (new != key and new in state_dict and new not in dropped and new not in by_weight):
            raise KeyCollisionError(f"{source}: the dequantized {shown(group.module)} would be {shown(new)}, a key the "
                                    "checkpoint already holds")
        out[new] = quant_dequant.dequantize(group, tensors, dtype=(dtypes or {}).get(key, dtype))
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def dequantized_note(groups: list[QuantGroup], dtype: Any, dropped: int) -> str:
    """``dequantized 3 quantized groups (fp8-block) to bfloat16; 3 scale tensor(s) dropped``."""
    n = len(groups)
    return (f"dequantized {n} quantized group{'s' if n != 1 else ''} ({schemes(groups)}) to {dtype_name(dtype)}; "
            f"{dropped} companion tensor(s) (scales …) dropped")


@dataclass
class Applied:
    """What the quantized groups made of a state dict: the state dict, the keys a cast leaves alone, notes, and
    ``summary`` (:func:`summary`: what a report records, None where no group or odd tensor was met)."""

    state_dict: Any
    keep: frozenset[str] = frozenset()
    notes: list[str] = field(default_factory=list)
    dequantized: bool = False
    summary: dict[str, Any] | None = None


def summary(kept: list[QuantGroup], dequantized: list[QuantGroup], dtype: Any, dropped: int,
            unknown: list[str]) -> dict[str, Any] | None:
    """``ConvertReport.quantized``: groups kept as stored and dequantized, by scheme, the dequantized weights' dtype,
    the companions dropped, and the tensors of no known scheme or of a broken group (cast as plain tensors by a cast,
    else kept as stored); None where there are none of these."""
    if not kept and not dequantized and not unknown:
        return None
    return {"kept": dict(Counter(g.scheme for g in kept)), "dequantized": dict(Counter(g.scheme for g in dequantized)),
            "dtype": dtype_name(dtype) if dequantized else None, "dropped": dropped, "unknown": unknown}


def apply(state_dict: Any, source: str, configs: Configs, dtype: str | None, dequantize: bool, cast_unknown: bool,
          what: str) -> Applied:
    """A cast (``dtype``, spelled ``what`` in a refusal) and/or a dequantization on ``state_dict``: with ``dequantize``
    each group becomes its plain weight (in ``dtype``, else the config's default), else every group's keys are kept
    as stored. Tensors beside scales of no known scheme, and a broken group's, refuse a cast unless ``cast_unknown``
    (then they are cast as plain tensors); a broken group refuses a dequantization. Neither asked: ``state_dict``."""
    if dtype is None and not dequantize:
        return Applied(state_dict)
    layout = find(state_dict, configs)
    notes: list[str] = []
    odd = list(layout.unknown) + ([p.key for p in layout.problems] if not dequantize else [])
    if odd and dtype is not None and not cast_unknown:
        refuse_cast(layout, state_dict, source, what)
    if odd:
        notes.append(f"{len(odd)} tensor(s) of no known quantization scheme or of a broken group "
                     + ("cast as plain tensors" if dtype is not None else "kept as stored") + f": {few(odd)}")
    if not dequantize:
        kept = kept_note(layout)
        return Applied(state_dict, grouped_keys(layout), ([kept] if kept else []) + notes,
                       summary=summary(layout.groups, [], None, 0, odd))
    refuse_problems(layout, source, "dequantize")
    target = torch_dtype(dtype or configs.default_dtype())
    out = dequantize_groups(state_dict, layout.groups, target, source)
    if not layout.groups:
        return Applied(out, notes=["dequantize: no quantized group to dequantize"] + notes,
                       summary=summary([], [], None, 0, odd))
    dropped = len(state_dict) - len(out)
    return Applied(out, notes=[dequantized_note(layout.groups, target, dropped)] + notes, dequantized=True,
                   summary=summary([], layout.groups, target, dropped, odd))
