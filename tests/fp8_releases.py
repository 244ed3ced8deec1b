"""Block-FP8 releases written exactly as DeepSeek-V3 / Qwen3 publish them (float8_e4m3fn ``weight``, F32
``weight_scale_inv`` per 128×128 block on a ceil grid, multiplied back in; ``quantization_config`` in config.json),
with their unquantized original: the gate's and diff's tests over quantized files build theirs here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BLOCK = 128
#: block FP8 as DeepSeek-V3 / Qwen3 publish it: float8 weight, F32 ``weight_scale_inv`` per 128×128 (ceil grid)
FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}}


def quantize_block_fp8(w: Any) -> tuple[Any, Any]:
    """``(weight float8_e4m3fn, weight_scale_inv)``: each 128×128 block's amax at 448, the scale multiplied back in."""
    import torch

    rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = block.abs().max() / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def original() -> dict[str, Any]:
    """The unquantized weights: two projections (one on a 2×3 ceil grid) and a plain norm."""
    import torch

    gen = torch.Generator().manual_seed(28)
    return {"layers.0.proj.weight": torch.randn(200, 300, generator=gen),  # a 2×3 ceil grid
            "layers.1.proj.weight": torch.randn(256, 128, generator=gen), "norm.weight": torch.ones(300)}


def quantized(orig: dict[str, Any]) -> dict[str, Any]:
    """``orig`` as a block-FP8 release's state dict: each projection quantized, the norm kept."""
    sd = {"norm.weight": orig["norm.weight"]}
    for layer in ("layers.0.proj", "layers.1.proj"):
        sd[f"{layer}.weight"], sd[f"{layer}.weight_scale_inv"] = quantize_block_fp8(orig[f"{layer}.weight"])
    return sd


def release(where: Path, sd: dict[str, Any]) -> Path:
    """``sd`` written as a save_pretrained directory ``where``: model.safetensors and config.json."""
    from safetensors.torch import save_file

    where.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(where / "model.safetensors"))
    (where / "config.json").write_text(json.dumps(FP8_CONFIG))
    return where
