"""``convert``'s quantized groups: ``--dtype`` keeps them bit-exact, ``--dequantize`` writes each as one plain weight.

A cast would change a group's values without its scales (issue 28's silent corruption): ``--dtype`` casts only the
plain float tensors. Float8 or packed-integer tensors beside scales of no known scheme are refused unless
``--cast-unknown-quantized`` says to treat them as plain. ``--dequantize`` needs the values (torch reads the file) and
drops the scales; a sharded directory output gets ``config.json`` without ``quantization_config``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...core import locations
from ...core.atomic import atomic_path
from .. import quantized
from ..quantized import CONFIG, HF_QUANT_CONFIG


def apply(req: Any, state_dict: Any) -> quantized.Applied:
    """``--dtype`` / ``--dequantize`` on the (renamed) state dict of the request ``req``; nothing for other requests."""
    what = f"--dtype {req.dtype}"
    applied = quantized.apply(state_dict, req.src, req.configs, req.dtype, req.dequantize, req.cast_unknown_quantized,
                              what)
    if applied.dequantized:
        applied.notes += _config_notes(req)
    return applied


def _config_notes(req: Any) -> list[str]:
    """What a one-file output leaves to the user: the source's config still says the weights are quantized."""
    if req.shard_size is not None or (req.configs.config is None and req.configs.hf_quant is None):
        return []
    return [f"{CONFIG} not written (a one-file output): where you copy it, drop its quantization_config"
            + (f" and leave out {HF_QUANT_CONFIG}" if req.configs.hf_quant is not None else "")]


def write_configs(req: Any) -> list[str]:
    """A dequantized sharded directory: ``config.json`` without ``quantization_config``, no ``hf_quant_config.json``
    (one a ``--force`` output held is removed)."""
    if not req.dequantize or req.shard_size is None or locations.is_remote(req.dst):
        return []
    notes = []
    config = req.configs.unquantized()
    if config is not None:
        with atomic_path(os.path.join(req.dst, CONFIG)) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        notes.append(f"wrote {CONFIG} without quantization_config")
    stale = os.path.join(req.dst, HF_QUANT_CONFIG)
    if os.path.exists(stale):
        os.remove(stale)
        notes.append(f"removed {HF_QUANT_CONFIG}: the weights are no longer quantized")
    return notes
