"""``convert``'s quantized groups: ``--dtype`` keeps them bit-exact, ``--dequantize`` writes each as one plain weight.

A cast would change a group's values without its scales (issue 28's silent corruption): ``--dtype`` casts only the
plain float tensors. Float8 or packed-integer tensors beside scales of no known scheme are refused unless
``--cast-unknown-quantized`` says to treat them as plain. ``--dequantize`` needs the values (torch reads the file) and
drops the scales; a sharded directory output gets ``config.json`` without ``quantization_config``, its
``torch_dtype`` / ``dtype`` the dequantized weights'.

torchao's pickled tensor subclasses are read as their inner tensors under torchao's flattened names
(:mod:`ckptfix.safety.subclasses`); ckptfix can't write a subclass back, and those inner tensors without torchao's
per-tensor metadata are a layout no loader rebuilds (neither as .pth nor as safetensors): ``--dequantize`` writes
them as plain weights, ``--dtype`` alone is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...core import locations
from ...core.atomic import atomic_path
from ...core.units import few
from ...errors import FormatError
from ...parse import format_registry as registry
from .. import quantized
from ..quantized import CONFIG, HF_QUANT_CONFIG

#: the schemes of torchao's tensor subclasses (a torch pickle holds them as subclasses, read as inner tensors)
TORCHAO_PREFIX = "torchao-"


def apply(req: Any, state_dict: Any) -> quantized.Applied:
    """``--dtype`` / ``--dequantize`` on the (renamed) state dict of the request ``req``; nothing for other requests."""
    what = f"--dtype {req.dtype}"
    applied = quantized.apply(state_dict, req.src, req.configs, req.dtype, req.dequantize, req.cast_unknown_quantized,
                              what)
    if applied.summary is not None and req.dtype is not None and not req.dequantize:
        _refuse_subclasses(req, applied.summary["kept"])
    if applied.dequantized and applied.summary is not None:
        applied.notes += _config_notes(req, applied.summary["dtype"])
    return applied


def _refuse_subclasses(req: Any, kept: dict[str, int]) -> None:
    """``--dtype`` of a torch pickle holding torchao tensor subclasses: the groups would be kept as stored, but as
    plain inner tensors under flattened names that no loader rebuilds (ckptfix can't write a subclass back);
    refused in one line, pointing at --dequantize."""
    torchao = sorted(name for name in kept if name.startswith(TORCHAO_PREFIX))
    spec = registry.get(req.fmt_in)
    pickled = spec.family == "torchsave" or (spec.shard_format is not None
                                             and registry.get(spec.shard_format).family == "torchsave")
    if torchao and pickled:
        raise FormatError(f"{req.src}: holds {sum(kept[n] for n in torchao)} torchao tensor subclass weight(s) "
                          f"({few(torchao)}), read as their inner tensors; --dtype {req.dtype} would write those under "
                          "torchao's flattened names without the metadata a loader rebuilds them from (as .pth or "
                          "safetensors alike): pass --dequantize to write plain weights")


def _config_notes(req: Any, dtype: str) -> list[str]:
    """What a one-file output leaves to the user: the source's config still says the weights are quantized."""
    if req.shard_size is not None or (req.configs.config is None and req.configs.hf_quant is None):
        return []
    return [f"{CONFIG} not written (a one-file output): where you copy it, drop its quantization_config"
            + (f", set its torch_dtype to {dtype}" if req.configs.config is not None else "")
            + (f" and leave out {HF_QUANT_CONFIG}" if req.configs.hf_quant is not None else "")]


def write_configs(req: Any, dtype: str | None) -> list[str]:
    """A dequantized sharded directory: ``config.json`` without ``quantization_config``, its ``torch_dtype`` (and
    ``dtype``, transformers 5's name, where present) the dequantized weights' ``dtype`` (None: no group was
    dequantized, left as it was), no ``hf_quant_config.json`` (one a ``--force`` output held is removed)."""
    if not req.dequantize or req.shard_size is None or locations.is_remote(req.dst):
        return []
    notes = []
    config = req.configs.unquantized()
    if config is not None:
        named = ([k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]) if dtype is not None else []
        config.update(dict.fromkeys(named, dtype))
        with atomic_path(os.path.join(req.dst, CONFIG)) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        notes.append(f"wrote {CONFIG} without quantization_config" + (f", {' and '.join(named)} {dtype}" if named else ""))
    stale = os.path.join(req.dst, HF_QUANT_CONFIG)
    if os.path.exists(stale):
        os.remove(stale)
        notes.append(f"removed {HF_QUANT_CONFIG}: the weights are no longer quantized")
    return notes
