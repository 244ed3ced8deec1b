"""Quantized state dicts written exactly as each publisher lays them out, with the publisher's own dequantization
re-typed from its code, for the schemes table's tests (and any verb's: convert, verify, diff).

``build(case)`` → :class:`Built`: the state dict, the config file's object (config.json or hf_quant_config.json),
the float weight each quantized module was made from, and the publisher's dequantization of each group. The
quantizers are round-to-nearest (GPTQ/AWQ's layout filled by plain RTN: the layout is what is under test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: bitsandbytes' NF4 and FP4 code books (functional.get_4bit_type), as saved in ``weight.quant_map``
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FP4_BNB = [0.0, 0.0052083333, 0.6666667, 1.0, 0.3333333, 0.5, 0.1666667, 0.25,
           -0.0, -0.0052083333, -0.6666667, -1.0, -0.3333333, -0.5, -0.1666667, -0.25]
MODULE = "model.layers.0.mlp.down_proj"


@dataclass
class Built:
    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any] | None
    originals: dict[str, torch.Tensor]  # module → the float weight it was quantized from (the model's shape)
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # module → the publisher's dequantization


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.05


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_fp4_to_uint8 rounding: the nearest E2M1 magnitude, the sign in bit 3."""
    idx = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return idx + (torch.signbit(x).long() << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pairs of codes into bytes, the first in the low nibble (compressed-tensors, modelopt, gpt-oss)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_fp4_reference(a: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' unpack_fp4_from_uint8 (nvfp4_quantized.py), the last dimension doubled."""
    flat = a.flatten()
    high, low = (flat & 0xF0) >> 4, flat & 0x0F
    combined = torch.stack((low, high), dim=1).flatten()
    signs = (combined & 0x08).to(torch.bool)
    values = E2M1[(combined & 0x07).long()] * torch.where(signs, -1.0, 1.0)
    return values.reshape(*a.shape[:-1], a.shape[-1] * 2)


def block_fp8(seed: int = 0, shape: tuple[int, int] = (300, 200)) -> Built:
    """DeepSeek-V3/Qwen3 FP8: 128×128 blocks, ``weight_scale_inv`` = amax/448 (multiplied on load)."""
    w = _weight(shape, seed)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale = torch.empty(grid)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    ref = torch.empty(shape)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            scale[i, j] = w[blk].abs().max() / 448
            q[blk] = (w[blk] / scale[i, j]).to(torch.float8_e4m3fn)
            ref[blk] = q[blk].float() * scale[i, j]  # DeepSeek's weight_dequant: y = x * s per block
    sd = {f"{MODULE}.weight": q, f"{MODULE}.weight_scale_inv": scale, "model.norm.weight": torch.ones(8)}
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


def _ct_config(fmt: str, weights: dict[str, Any]) -> dict[str, Any]:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}


def ct_fp8(strategy: str, seed: int = 1) -> Built:
    """compressed-tensors FP8 (float-quantized): ``weight`` F8, ``weight_scale`` per tensor, channel or block."""
    w = _weight((160, 136), seed)
    if strategy == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        full = scale.expand_as(w)
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        full = scale.expand_as(w)
    else:
        blocks = torch.nn.functional.pad(w, (0, 256 - 136, 0, 256 - 160)).reshape(2, 128, 2, 128)
        scale = blocks.abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:160, :136]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    sd = {f"{MODULE}.weight": q, f"{MODULE}.weight_scale": scale.to(torch.bfloat16),
          f"{MODULE}.input_scale": torch.tensor([0.02], dtype=torch.bfloat16)}
    ref = q.to(torch.float32) * _expand_like(sd[f"{MODULE}.weight_scale"].float(), w.shape)  # forward.py _dequantize
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               **({"block_structure": [128, 128]} if strategy == "block" else {})}
    return Built(sd, _ct_config("float-quantized", weights), {MODULE: w}, {MODULE: ref})


def _expand_like(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if scale.numel() == 1:
        return scale.reshape(()).expand(shape)
    if scale.shape[1] == 1:
        return scale.expand(shape)
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]


def modelopt_fp8(seed: int = 2) -> Built:
    """modelopt FP8 export: ``weight`` F8, F32 scalar ``weight_scale`` and ``input_scale``; hf_quant_config.json."""
    w = _weight((48, 64), seed)
    scale = w.abs().max() / 448
    q = (w / scale).to(torch.float8_e4m3fn)
    sd = {f"{MODULE}.weight": q, f"{MODULE}.weight_scale": scale.reshape(()).clone(),
          f"{MODULE}.input_scale": torch.tensor(0.01)}
    config = {"producer": {"name": "modelopt", "version": "0.37.0"},
              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}
    return Built(sd, config, {MODULE: w}, {MODULE: q.float() * scale})


def nvfp4(convention: str, seed: int = 3, native: bool = False) -> Built:
    """NVFP4, 16 values a block: compressed-tensors (``weight_packed``, ``weight_global_scale`` = 448·6/amax,
    divided) or modelopt (``weight``, ``weight_scale_2`` = amax/(6·448), multiplied); ``native``: stored as F4."""
    w = _weight((32, 64), seed)
    amax = w.abs().max()
    blocks = w.reshape(32, 4, 16)
    block_amax = blocks.abs().amax(-1)
    if convention == "ct":
        glob = (448 * 6 / amax).reshape(1)
        scale = (block_amax / 6 * glob).to(torch.float8_e4m3fn)
        per_block = scale.float() / glob  # forward.py _dequantize: scale / global_scale
    else:
        glob = (amax / (6 * 448)).reshape(())
        scale = (block_amax / (6 * glob)).to(torch.float8_e4m3fn)
        per_block = scale.float() * glob  # NVFP4QTensor.dequantize: scale * double_scale
    codes = fp4_codes((blocks / per_block.unsqueeze(-1)).reshape(32, 64))
    packed = pack_fp4(codes)
    if native:
        packed = packed.view(torch.float4_e2m1fn_x2)
    ref = (unpack_fp4_reference(packed.view(torch.uint8)).reshape(32, 4, 16) * per_block.unsqueeze(-1)).reshape(32, 64)
    if convention == "ct":
        sd = {f"{MODULE}.weight_packed": packed, f"{MODULE}.weight_scale": scale, f"{MODULE}.weight_global_scale": glob,
              f"{MODULE}.input_global_scale": torch.tensor([100.0])}
        config = _ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                      "group_size": 16})
    else:
        sd = {f"{MODULE}.weight": packed, f"{MODULE}.weight_scale": scale, f"{MODULE}.weight_scale_2": glob,
              f"{MODULE}.input_scale": torch.tensor(0.01)}
        config = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


def _pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 / GPTQ's packing: consecutive fields along ``dim``, the lowest first."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    pad = (-v.shape[1]) % per
    v = torch.nn.functional.pad(v, (0, pad))
    out = torch.zeros(v.shape[0], v.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= v[:, i::per] << (bits * i)
    out = ((out + 2**31) % 2**32 - 2**31).to(torch.int32)
    return out.t().contiguous() if dim == 0 else out


def _unpack_int32_reference(value: torch.Tensor, bits: int, rows: int | None, cols: int | None, dim: int) -> torch.Tensor:
    """compressed-tensors' unpack_from_int32 (pack_quantized.py), the offset 2**(bits-1) removed."""
    per, mask = 32 // bits, (1 << bits) - 1
    if dim == 1:
        out = torch.zeros(value.shape[0], value.shape[1] * per, dtype=torch.int32)
        for i in range(per):
            out[:, i::per] = (value >> (bits * i)) & mask
        out = out[:, :cols]
    else:
        out = torch.zeros(value.shape[0] * per, value.shape[1], dtype=torch.int32)
        for i in range(per):
            out[i::per, :] = (value >> (bits * i)) & mask
        out = out[:rows, :]
    return out - (1 << (bits - 1))


def ct_int4(symmetric: bool = True, seed: int = 4) -> Built:
    """compressed-tensors pack-quantized W4A16, groups of 32 along in (symmetric: scale = amax/7.5; asymmetric:
    packed zero points)."""
    out_f, in_f, gs = 24, 100, 32
    w = _weight((out_f, in_f), seed)
    groups = -(-in_f // gs)
    padded = torch.nn.functional.pad(w, (0, groups * gs - in_f)).reshape(out_f, groups, gs)
    if symmetric:
        scale = padded.abs().amax(-1) / 7.5
        zp = torch.zeros(out_f, groups)
    else:
        lo, hi = padded.amin(-1).clamp(max=0), padded.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zp = (-8 - torch.round(lo / scale)).clamp(-8, 7)
    full_s = scale.repeat_interleave(gs, 1)[:, :in_f]
    full_z = zp.repeat_interleave(gs, 1)[:, :in_f]
    q = torch.clamp(torch.round(w / full_s + full_z), -8, 7)
    sd = {f"{MODULE}.weight_packed": _pack_int32(q + 8, 4, 1), f"{MODULE}.weight_scale": scale.to(torch.bfloat16),
          f"{MODULE}.weight_shape": torch.tensor([out_f, in_f])}
    if not symmetric:
        sd[f"{MODULE}.weight_zero_point"] = _pack_int32(zp + 8, 4, 0)
    unpacked = _unpack_int32_reference(sd[f"{MODULE}.weight_packed"], 4, None, in_f, 1).float()
    ref_z = zp if symmetric else _unpack_int32_reference(sd[f"{MODULE}.weight_zero_point"], 4, out_f, None, 0).float()
    s = sd[f"{MODULE}.weight_scale"].float()
    ref = (unpacked - ref_z.repeat_interleave(gs, 1)[:, :in_f]) * s.repeat_interleave(gs, 1)[:, :in_f]
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": gs}
    return Built(sd, _ct_config("pack-quantized", weights), {MODULE: w}, {MODULE: ref})


def mxfp4(seed: int = 5, native: bool = False) -> Built:
    """gpt-oss MXFP4 experts: ``*_blocks`` [E, out, G, 16] bytes, ``*_scales`` [E, out, G] E8M0 (exponent + 127),
    the shared exponent floor(log2(amax)) - 2 (OCP MX); loaded [E, in, out] (transformers' transpose)."""
    e, out_f, in_f = 2, 8, 64
    w = _weight((e, out_f, in_f), seed)
    blocks = w.reshape(e, out_f, in_f // 32, 32)
    exp = torch.floor(torch.log2(blocks.abs().amax(-1))) - 2
    codes = fp4_codes((blocks / torch.exp2(exp).unsqueeze(-1)).clamp(-6, 6))
    packed = pack_fp4(codes)
    scales = (exp + 127).to(torch.uint8)
    ref = convert_moe_packed_tensors_reference(packed, scales)
    if native:
        packed, scales = packed.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)
    prefix = "model.layers.0.mlp.experts.gate_up_proj"
    sd = {f"{prefix}_blocks": packed, f"{prefix}_scales": scales, f"{prefix}_bias": torch.zeros(e, out_f)}
    config = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    return Built(sd, config, {prefix: w.transpose(1, 2).contiguous()}, {prefix: ref})


def convert_moe_packed_tensors_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' integrations/mxfp4.py convert_moe_packed_tensors, in float32."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    scales = scales.to(torch.int32) - 127
    *prefix_shape, g, b = blocks.shape
    rows = blocks.reshape(-1, b)
    out = torch.empty(rows.shape[0], b * 2)
    out[:, 0::2] = lut[(rows & 0x0F).long()]
    out[:, 1::2] = lut[(rows >> 4).long()]
    out = torch.ldexp(out, scales.reshape(-1, 1))
    out = out.reshape(*prefix_shape, g, b * 2).view(*prefix_shape, g * b * 2)
    return out.transpose(1, 2).contiguous()


def gptq(version: int = 1, seed: int = 6, with_g_idx: bool = True) -> Built:
    """GPTQ 4-bit, groups of 32: qweight [in/8, out], qzeros [groups, out/8] (v1 stores zero - 1), scales fp16."""
    out_f, in_f, gs = 32, 64, 32
    w = _weight((out_f, in_f), seed)
    wt = w.t().reshape(in_f // gs, gs, out_f)  # [groups, rows, out]
    lo, hi = wt.amin(1).clamp(max=0), wt.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.clamp(torch.round(wt / scales.float().unsqueeze(1)) + zeros.unsqueeze(1), 0, 15).reshape(in_f, out_f)
    stored = (zeros - 1) if version == 1 else zeros
    sd = {f"{MODULE}.qweight": _pack_int32(q, 4, 0), f"{MODULE}.qzeros": _pack_int32(stored.long() & 0xF, 4, 1),
          f"{MODULE}.scales": scales, f"{MODULE}.bias": torch.zeros(out_f, dtype=torch.float16)}
    g_idx = torch.arange(in_f, dtype=torch.int32) // gs
    if with_g_idx:
        sd[f"{MODULE}.g_idx"] = g_idx
    # AutoGPTQ's dequantization (qlinear_cuda_old): zeros unpacked, masked, + 1 in v1
    zeros_ref = torch.stack([(sd[f"{MODULE}.qzeros"] >> (4 * i)) & 0xF for i in range(8)], -1).reshape(in_f // gs, out_f)
    zeros_ref = zeros_ref + (1 if version == 1 else 0)
    weight_ref = torch.stack([(sd[f"{MODULE}.qweight"] >> (4 * i)) & 0xF for i in range(8)], 1).reshape(in_f, out_f)
    ref = (scales.float()[g_idx.long()] * (weight_ref - zeros_ref[g_idx.long()]).float()).t()
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": gs, "desc_act": False,
                                      "sym": False, "checkpoint_format": "gptq" if version == 1 else "gptq_v2"}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq(seed: int = 7) -> Built:
    """AutoAWQ GEMM: qweight [in, out/8] packed in the order [0, 2, 4, 6, 1, 3, 5, 7], qzeros likewise, scales fp16."""
    out_f, in_f, gs = 32, 64, 32
    w = _weight((out_f, in_f), seed)
    wt = w.t().reshape(in_f // gs, gs, out_f)
    lo, hi = wt.amin(1).clamp(max=0), wt.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.clamp(torch.round(wt / scales.float().unsqueeze(1)) + zeros.unsqueeze(1), 0, 15).reshape(in_f, out_f)

    def pack(values: torch.Tensor) -> torch.Tensor:  # AutoAWQ WQLinear_GEMM.from_linear's packing
        v = values.to(torch.int64)
        out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
        for col in range(v.shape[1] // 8):
            for i in range(8):
                out[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)

    sd = {f"{MODULE}.qweight": pack(q), f"{MODULE}.qzeros": pack(zeros), f"{MODULE}.scales": scales}
    config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": gs, "version": "gemm",
                                      "zero_point": True}}
    return Built(sd, config, {MODULE: w}, {MODULE: dequantize_gemm_reference(pack(q), pack(zeros), scales, gs)})


def dequantize_gemm_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, gs: int) -> torch.Tensor:
    """AutoAWQ awq/utils/packing_utils.py: unpack_awq, reverse_awq_order, dequantize_gemm; transposed to [out, in]."""
    shifts = torch.arange(0, 32, 4)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8).view(qweight.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8).view(qzeros.shape[0], -1)
    order = torch.arange(iweights.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    iweights, izeros = iweights[:, order] & 0xF, izeros[:, order] & 0xF
    w = (iweights - izeros.repeat_interleave(gs, 0)).float() * scales.float().repeat_interleave(gs, 0)
    return w.t()


def bnb4(quant_type: str = "nf4", nested: bool = False, seed: int = 8) -> Built:
    """bitsandbytes 4-bit as transformers saves it: ``weight`` uint8 [n/2, 1] (the first value in the high nibble),
    ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__<type>`` (its JSON as bytes);
    nested: absmax 8-bit codes with ``nested_absmax``/``nested_quant_map`` and the ``nested_offset``."""
    shape, bs = (16, 40), 64
    w = _weight(shape, seed)
    code = torch.tensor(NF4 if quant_type == "nf4" else FP4_BNB)
    flat = w.reshape(-1)
    n = flat.numel()
    absmax = torch.nn.functional.pad(flat, (0, (-n) % bs)).reshape(-1, bs).abs().amax(-1)
    scaled = (flat / absmax.repeat_interleave(bs)[:n]).clamp(-1, 1)
    q = (scaled.unsqueeze(-1) - code).abs().argmin(-1)  # bitsandbytes' default quantize_4bit
    packed = (q[::2] << 4 | q[1::2]).to(torch.uint8).unsqueeze(1)
    state: dict[str, Any] = {"quant_type": quant_type, "blocksize": bs, "dtype": "float32", "shape": list(shape)}
    key = f"{MODULE}.weight"
    sd = {key: packed, f"{key}.quant_map": code}
    used_absmax = absmax
    if nested:
        offset = absmax.mean()
        qmap = torch.linspace(-1, 1, 256)
        centred = absmax - offset
        nested_absmax = centred.abs().max().reshape(1)
        codes = ((centred / nested_absmax).unsqueeze(-1) - qmap).abs().argmin(-1).to(torch.uint8)
        sd.update({f"{key}.absmax": codes, f"{key}.nested_absmax": nested_absmax, f"{key}.nested_quant_map": qmap})
        state.update({"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(offset)})
        used_absmax = qmap[codes.long()] * nested_absmax + offset  # dequantize_blockwise + offset
    else:
        sd[f"{key}.absmax"] = absmax
    import json

    sd[f"{key}.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    # bitsandbytes' _dequantize_4bit_impl: out[::2] = A >> 4, out[1::2] = A & 0xF
    a = packed.reshape(-1)
    idx = torch.empty(a.numel() * 2, dtype=torch.long)
    idx[1::2], idx[::2] = (a & 0xF).long(), (a >> 4).long()
    ref = (code[idx][:n] * used_absmax.repeat_interleave(bs)[:n]).reshape(shape)
    config = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                      "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": nested}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


def bnb_int8(seed: int = 9) -> Built:
    """LLM.int8 as transformers saves it: ``weight`` int8, ``SCB`` (each row's absmax), ``weight_format``."""
    w = _weight((24, 40), seed)
    scb = w.abs().amax(1)
    q = torch.round(w * (127.0 / scb.unsqueeze(-1))).to(torch.int8)  # int8_vectorwise_quant
    sd = {f"{MODULE}.weight": q, f"{MODULE}.SCB": scb, f"{MODULE}.weight_format": torch.tensor(0, dtype=torch.uint8)}
    ref = q * scb.view(-1, 1) * 7.874015718698502e-3  # int8_vectorwise_dequant
    config = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


def torchao(kind: str = "int8", seed: int = 10) -> Built:
    """torchao weight-only, flattened into safetensors by transformers: ``_weight_qdata`` with a per-row
    ``_weight_scale`` (int8: symmetric, amax/127.5, and a ``_weight_zero_point`` of zeros; float8: amax/448)."""
    w = _weight((48, 64), seed)
    amax = w.abs().amax(1, keepdim=True)
    prefix = f"{MODULE}._weight"
    if kind == "int8":
        scale = amax / 127.5
        zp = torch.zeros_like(scale, dtype=torch.int8)
        q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)  # quantize_affine
        sd = {f"{prefix}_qdata": q, f"{prefix}_scale": scale, f"{prefix}_zero_point": zp}
        ref = (q.float() - zp.float()) * scale  # dequantize_affine
    else:
        scale = amax / 448
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        sd = {f"{prefix}_qdata": q, f"{prefix}_scale": scale}
        ref = q.float() * scale
    config = {"quantization_config": {"quant_method": "torchao", "quant_type": {"default": {
        "_type": "Int8WeightOnlyConfig" if kind == "int8" else "Float8WeightOnlyConfig"}}}}
    return Built(sd, config, {MODULE: w}, {MODULE: ref})


#: case → (builder, the scheme its group is named)
CASES: dict[str, tuple[Callable[[], Built], str]] = {
    "fp8-block": (block_fp8, "fp8-block"),
    "ct-fp8-tensor": (lambda: ct_fp8("tensor"), "ct-fp8"),
    "ct-fp8-channel": (lambda: ct_fp8("channel"), "ct-fp8"),
    "ct-fp8-block": (lambda: ct_fp8("block"), "ct-fp8"),
    "modelopt-fp8": (modelopt_fp8, "modelopt-fp8"),
    "ct-nvfp4": (lambda: nvfp4("ct"), "ct-nvfp4"),
    "ct-nvfp4-f4": (lambda: nvfp4("ct", native=True), "ct-nvfp4"),
    "modelopt-nvfp4": (lambda: nvfp4("modelopt"), "modelopt-nvfp4"),
    "ct-int4": (ct_int4, "ct-int-packed"),
    "ct-int4-asym": (lambda: ct_int4(symmetric=False), "ct-int-packed"),
    "mxfp4": (mxfp4, "mxfp4"),
    "mxfp4-native": (lambda: mxfp4(native=True), "mxfp4"),
    "gptq": (gptq, "gptq"),
    "gptq-v2": (lambda: gptq(2), "gptq-v2"),
    "awq": (awq, "awq"),
    "bnb-nf4": (bnb4, "bnb-nf4"),
    "bnb-fp4-nested": (lambda: bnb4("fp4", nested=True), "bnb-fp4"),
    "bnb-int8": (bnb_int8, "bnb-int8"),
    "torchao-int8": (torchao, "torchao-int8"),
    "torchao-float8": (lambda: torchao("float8"), "torchao-float8"),
}


def build(case: str) -> Built:
    return CASES[case][0]()


def infos(sd: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each key's dtype name and shape, as find_groups takes them."""
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in sd.items()}


def quant_method(config: dict[str, Any] | None) -> str | None:
    """The quant_method a config file names (modelopt's hf_quant_config.json: ``modelopt``)."""
    if config is None:
        return None
    return "modelopt" if "quantization" in config else config["quantization_config"]["quant_method"]
