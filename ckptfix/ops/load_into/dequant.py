"""``load_into``'s quantized groups: loaded as stored into a model that holds them quantized (bit-exact), dequantized
into one whose parameters are plain floats (``dequantize=True``; without it a LoadError, never a raw cast)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.units import dtype_name, shown
from ...errors import LoadError
from ...statedict import repair
from .. import quantized


def plain_groups(ckpt: Any, target: repair.Target, model_state: Mapping[str, Any],
                 dequantize: bool) -> dict[str, Any]:
    """The checkpoint's quantized groups the model takes as a plain float weight (it has no place for their scales),
    by weight key, with the model's dtype for each. Without ``dequantize`` any such group is refused, naming its key."""
    layout = quantized.find(ckpt.state_dict, quantized.read_configs(ckpt.path))
    if not layout.groups:
        return {}
    fn = repair.find_repair(ckpt.state_dict, target, ckpt.path).fn
    wanted: dict[str, Any] = {}
    for group in layout.groups:
        if any(fn(k) in model_state for k in group.companions.values()):
            continue  # the model holds the quantized form: loaded as stored
        into = model_state.get(fn(group.dequantized_key))
        if into is None or not into.is_floating_point() or into.element_size() == 1:
            continue  # not a plain float weight: the fit reports what doesn't match
        if not dequantize:
            raise LoadError(f"{ckpt.path}: {shown(group.weight)} is quantized ({group.scheme}, with "
                            f"{', '.join(map(shown, group.companions.values()))}) but the model's "
                            f"{shown(fn(group.dequantized_key))} is a plain {dtype_name(into.dtype)} weight; "
                            "casting the stored values would drop their scales: pass dequantize=True to load the "
                            "dequantized weight; nothing was loaded")
        wanted[group.weight] = (group, into.dtype)
    return wanted


def dequantized(ckpt: Any, wanted: Mapping[str, Any]) -> Any:
    """``ckpt`` (its values read) with the ``wanted`` groups dequantized, each to the model's dtype, and a note."""
    groups = [g for g, _dtype in wanted.values()]
    before = len(ckpt.state_dict)
    ckpt.state_dict = quantized.dequantize_groups(ckpt.state_dict, groups, None, ckpt.path,
                                                  dtypes={k: dtype for k, (_g, dtype) in wanted.items()})
    ckpt.notes.append(f"{quantized.dequantized_note(groups, wanted[groups[0].weight][1], before - len(ckpt.state_dict))}"
                      " (dequantize=True: the model's parameters are plain floats)")
    return ckpt
