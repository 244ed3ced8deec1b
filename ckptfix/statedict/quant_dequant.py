"""Each quantization scheme's dequantization, and the per-element error its rounding allows (``step_bound``).

``KERNELS`` holds one function per ``Scheme.dequant`` name of :mod:`.quant_schemes`, each written after the
publisher's own code (the row's ``source``); torch is imported inside them. A kernel returns float32 in the
weight's original shape: [out, in] for a Linear (GPTQ/AWQ's [in, out] transposed back), gpt-oss experts as
transformers' conversion gives them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from math import ceil
from typing import TYPE_CHECKING, Any

from .quant_groups import QuantGroup, bnb_state
from .quant_schemes import BY_NAME

if TYPE_CHECKING:
    import torch

    Tensors = Mapping[str, torch.Tensor]
    Kernel = Callable[[QuantGroup, Tensors], torch.Tensor]

#: E2M1 values by 4-bit code (sign in bit 3), as transformers' mxfp4 FP4_VALUES and compressed-tensors' FLOAT_TO_E2M1
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: half the gap to the farther neighbour of each E2M1 magnitude (6: a saturated value, up to 2 steps of 4→6 away
#: when the shared exponent is rounded down, as OCP MX does)
_E2M1_HALF_GAP = (0.25, 0.25, 0.25, 0.25, 0.5, 0.5, 1.0, 2.0)
#: relative slack on a round-to-nearest bound: the quantizer's own arithmetic (bf16 division, a rounded scale)
_SLACK = 2.0**-8
#: a value exactly half a step from two codes rounds either way; float32 arithmetic may land it a hair past
_TIE = 1 + 2.0**-10


def dequantize(group: QuantGroup, tensors: Tensors, dtype: Any = None) -> torch.Tensor:
    """The group's weight, dequantized by its scheme's formula, in ``dtype`` (float32 by default)."""
    import torch

    values = KERNELS[BY_NAME[group.scheme].dequant](group, tensors)
    return values.to(dtype or torch.float32)


def step_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor | None:
    """The absolute error each element may carry if the weight was rounded to nearest (the original within it of
    the dequantized value), in the dequantized shape; None for GPTQ/AWQ, whose error compensation exceeds it."""
    if not group.rtn:
        return None
    return BOUNDS[BY_NAME[group.scheme].dequant](group, tensors)


def _t(group: QuantGroup, tensors: Tensors, role: str) -> torch.Tensor:
    return tensors[group.weight if role == "weight" else group.companions[role]]


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None) -> torch.Tensor:
    """A per-tensor ([] or [1]), per-channel ([out, 1]) or per-block grid scale broadcast over a 2-D weight
    (the grid ceil-sized: its edge blocks cropped, as transformers' finegrained FP8 dequantization does)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(()).expand(shape)
    if tuple(scale.shape) == (shape[0], 1):
        return scale.expand(shape)
    b0, b1 = block or (ceil(shape[0] / scale.shape[0]), ceil(shape[1] / scale.shape[1]))
    return scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:shape[0], :shape[1]]


def fp8_scaled(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """FP8 × scale: DeepSeek/Qwen3 ``weight_scale_inv`` (a 128×128 grid, multiplied: DeepSeek's weight_dequant
    ``y = x * s``), compressed-tensors (``x_q * scale``), modelopt (``weight * weight_scale``)."""
    w = _t(group, tensors, "weight")
    block = group.params.get("block")
    return w.float() * _expand(_t(group, tensors, "scale"), tuple(w.shape), tuple(block) if block else None)


def _fp8_half_ulp(q: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 step at each value (in FP8 units): 2**(e - 4) in binade e, e ≥ -6 (subnormals: 2**-10)."""
    import torch

    e = torch.floor(torch.log2(q.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 4)


def fp8_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    w = _t(group, tensors, "weight")
    q = w.float()
    block = group.params.get("block")
    scale = _expand(_t(group, tensors, "scale"), tuple(w.shape), tuple(block) if block else None)
    return (_fp8_half_ulp(q) * _TIE + q.abs() * _SLACK) * scale.abs()


def _torchao_parts(group: QuantGroup, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    q = _t(group, tensors, "weight")
    shape = tuple(q.shape)
    scale = _expand(_t(group, tensors, "scale"), shape, None)
    zp = _expand(_t(group, tensors, "zero_point"), shape, None) if "zero_point" in group.companions else \
        torch.zeros(shape)
    return q.float(), zp, scale


def torchao_affine(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """torchao's dequantize_affine of an int8 weight: ``(qdata - zero_point) * scale``, each scale over its block."""
    q, zp, scale = _torchao_parts(group, tensors)
    return (q - zp) * scale


def torchao_affine_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    q, _zp, scale = _torchao_parts(group, tensors)
    return scale.abs() * (0.5 * _TIE + _SLACK * q.abs())


def _torchao_int4_parts(group: QuantGroup, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Tensor's values (signed nibbles, the low first, + 8), and each one's scale and ``zero - 8 * scale`` (in
    the stored dtype, as torchao computes it), [out, in]."""
    import torch

    packed = _t(group, tensors, "weight").view(torch.int8)
    q = torch.stack(((packed << 4) >> 4, packed >> 4), dim=-1).reshape(packed.shape[0], -1).float() + 8
    scale, zero = _t(group, tensors, "scale"), _t(group, tensors, "zero_point")
    size = q.shape[1] // scale.shape[0]
    low = (zero - scale * 8).t().float().repeat_interleave(size, 1)
    return q, scale.t().float().repeat_interleave(size, 1), low


def torchao_int4(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """torchao's Int4Tensor (its _int4_row_dequantize_zp): ``(q + 8) * scale + (zero_point - 8 * scale)``."""
    q, scale, low = _torchao_int4_parts(group, tensors)
    return q * scale + low


def torchao_int4_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """Half a step, with slack for the scale and zero point rounded to their stored dtype after quantizing."""
    q, scale, low = _torchao_int4_parts(group, tensors)
    return scale.abs() * (0.5 * _TIE + _SLACK * (q + 8)) + _SLACK * low.abs()


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (uint8 or float4_e2m1fn_x2) → their 4-bit codes, the low nibble first: [..., n] → [..., 2n]."""
    import torch

    b = packed.view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2).long()


def _fp4_values(codes: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.tensor(E2M1, dtype=torch.float32)[codes]


def _fp4_half_gap(codes: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.tensor(_E2M1_HALF_GAP, dtype=torch.float32)[codes & 7]


def _nvfp4_scale(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """Each value's scale: the FP8 block scale (one per 16) with the global one — compressed-tensors divides by
    ``weight_global_scale``, modelopt multiplies by ``weight_scale_2`` (reciprocal conventions)."""
    block = _t(group, tensors, "scale").float()
    glob = _t(group, tensors, "global_scale").float().reshape(())
    per_block = block / glob if group.scheme == "ct-nvfp4" else block * glob
    return per_block.repeat_interleave(16, -1)


def nvfp4(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """NVFP4: E2M1 × block scale (compressed-tensors: ÷ global scale; modelopt: × weight_scale_2)."""
    codes = _unpack_fp4(_t(group, tensors, "weight"))
    return _fp4_values(codes) * _nvfp4_scale(group, tensors)[..., :codes.shape[-1]]


def nvfp4_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    codes = _unpack_fp4(_t(group, tensors, "weight"))
    scale = _nvfp4_scale(group, tensors)[..., :codes.shape[-1]].abs()
    return (_fp4_half_gap(codes) * _TIE + _fp4_values(codes).abs() * _SLACK) * scale


def _mx_exponents(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    import torch

    return _t(group, tensors, "scale").view(torch.uint8).to(torch.int32) - 127


def _mx_layout(values: torch.Tensor, blocks_shape: tuple[int, ...]) -> torch.Tensor:
    """[..., G, 32] values → transformers' layout: [..., G*32], the last two dimensions swapped (gpt-oss experts
    are stored [E, out, G, 16] and loaded [E, in, out])."""
    out = values.reshape(*blocks_shape[:-2], blocks_shape[-2] * 32)
    return out.transpose(1, 2).contiguous() if out.dim() >= 3 else out


def mxfp4(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """gpt-oss MXFP4 (transformers' convert_moe_packed_tensors): ``ldexp(lut[nibble], scale - 127)``, the low
    nibble first."""
    import torch

    blocks = _t(group, tensors, "weight")
    values = torch.ldexp(_fp4_values(_unpack_fp4(blocks)), _mx_exponents(group, tensors).unsqueeze(-1).float())
    return _mx_layout(values, tuple(blocks.shape))


def mxfp4_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    import torch

    blocks = _t(group, tensors, "weight")
    codes = _unpack_fp4(blocks)
    scale = torch.exp2(_mx_exponents(group, tensors).unsqueeze(-1).float())
    bound = (_fp4_half_gap(codes) * _TIE + _fp4_values(codes).abs() * _SLACK) * scale
    return _mx_layout(bound, tuple(blocks.shape))


def _unpack_int(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words → their ``bits``-bit fields, the lowest first, laid out consecutively along ``dim``
    (GPTQ's qweight along in, its qzeros and compressed-tensors' values along the last dimension)."""
    import torch

    if dim != 0 and 8 % bits == 0 and sys.byteorder == "little":  # along the words: byte by byte (a quarter the
        b = packed.to(torch.int32).contiguous().view(torch.uint8)  # traffic of int32 fields), low byte first
        fields = b.unsqueeze(-1) >> torch.arange(0, 8, bits, dtype=torch.uint8)
        fields &= (1 << bits) - 1
        return fields.reshape(*packed.shape[:-1], packed.shape[-1] * (32 // bits))
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = packed.to(torch.int32).unsqueeze(-1) >> shifts  # [..., words, per_word]
    fields &= (1 << bits) - 1
    if dim == 0:
        return fields.permute(0, 2, 1).reshape(packed.shape[0] * len(shifts), packed.shape[1])
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * len(shifts))


def _group_expand(t: torch.Tensor, size: int, n: int, dim: int) -> torch.Tensor:
    return t.repeat_interleave(size, dim).narrow(dim, 0, n)


def _group_size(columns: int, groups: int) -> int:
    """The group size that splits ``columns`` into ``groups`` (the last one short): a power of two where one does
    (32, 64, 128: what quantizers use), else ``columns / groups`` rounded up."""
    fits = [2**k for k in range(1, 16) if -(-columns // 2**k) == groups]
    return fits[0] if fits else ceil(columns / groups)


def _ct_int_parts(group: QuantGroup, tensors: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized: the values and zero points (their offset 2**(bits-1) removed) and the
    scales, each [out, in]; a group per ``group_size`` input columns, or per ``weight_g_idx`` (activation order)."""
    import torch

    bits = int(group.params.get("bits", 4))
    out, inp = (int(v) for v in _t(group, tensors, "shape").reshape(-1).tolist())
    q = _unpack_int(_t(group, tensors, "weight"), bits, 1)[:, :inp].float() - (1 << (bits - 1))
    scale = _t(group, tensors, "scale").float()
    zp = torch.zeros_like(scale)
    if "zero_point" in group.companions:
        zp = _unpack_int(_t(group, tensors, "zero_point"), bits, 0)[:out].float() - (1 << (bits - 1))
    if "g_idx" in group.companions:
        g_idx = _t(group, tensors, "g_idx").long()
        return q, zp[:, g_idx], scale[:, g_idx]
    size = int(group.params.get("group_size") or _group_size(inp, scale.shape[1]))
    return q, _group_expand(zp, size, inp, 1), _group_expand(scale, size, inp, 1)


def int_packed_ct(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """compressed-tensors pack-quantized (W4A16 …): ``(q - zero_point) * scale``, q unpacked from int32 with
    its offset (2**(bits-1)) removed, cropped to ``weight_shape``. Groups in order: the values viewed [out, groups,
    size] and each group's zero point and scale broadcast over it, in place (no weight-sized scale or zero copies)."""
    import torch

    if "g_idx" in group.companions:  # activation order: each column's group looked up
        q, zp, scale = _ct_int_parts(group, tensors)
        return (q - zp) * scale
    bits = int(group.params.get("bits", 4))
    out, inp = (int(v) for v in _t(group, tensors, "shape").reshape(-1).tolist())
    scale = _t(group, tensors, "scale").float()
    groups = scale.shape[1]
    size = int(group.params.get("group_size") or _group_size(inp, groups))
    fields = _unpack_int(_t(group, tensors, "weight"), bits, 1)  # [out, words * per_word] int32
    span = groups * size
    if fields.shape[1] < span:
        fields = torch.nn.functional.pad(fields, (0, span - fields.shape[1]))
    offset = torch.full_like(scale, float(1 << (bits - 1)))  # zero_point + the unsigned offset, per group
    if "zero_point" in group.companions:
        offset += _unpack_int(_t(group, tensors, "zero_point"), bits, 0)[:out].float() - (1 << (bits - 1))
    w = fields[:, :span].float().view(out, groups, size)
    w.sub_(offset.unsqueeze(-1)).mul_(scale.unsqueeze(-1))
    w = w.view(out, span)
    return w if span == inp else w[:, :inp].contiguous()


def int_packed_ct_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    q, _zp, scale = _ct_int_parts(group, tensors)
    return scale.abs() * (0.5 * _TIE + _SLACK * q.abs())


def gptq(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """GPTQ (AutoGPTQ's/gptqmodel's dequantization): ``scales[g_idx] * (q - zeros[g_idx])``, v1's stored zeros
    plus one (masked first, as AutoGPTQ does); returned [out, in]."""
    import torch

    bits = int(group.params.get("bits", 4))
    q = _unpack_int(_t(group, tensors, "weight"), bits, 0).float()
    zeros = _unpack_int(_t(group, tensors, "zero_point"), bits, 1).float() + (1 if group.params.get("v1") else 0)
    scales = _t(group, tensors, "scale").float()
    if "g_idx" in group.companions:
        g_idx = _t(group, tensors, "g_idx").long()
    else:
        g_idx = torch.arange(q.shape[0]) // int(group.params["group_size"])
    return (scales[g_idx] * (q - zeros[g_idx])).t().contiguous()


#: AutoAWQ's AWQ_REVERSE_ORDER: slot k of each 8 unpacked columns holds column ORDER[k] of the original
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _awq_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    import torch

    fields = _unpack_int(packed, bits, 1)
    per_word = 32 // bits
    order = torch.arange(fields.shape[-1]).view(-1, per_word)[:, list(AWQ_REVERSE_ORDER[:per_word])].reshape(-1)
    return fields[:, order]


def awq(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """AWQ GEMM (AutoAWQ's dequantize_gemm): unpack, undo the [0, 2, 4, 6, 1, 3, 5, 7] order,
    ``(q - zeros) * scales`` per group of input rows; returned [out, in]."""
    bits = int(group.params.get("bits", 4))
    q = _awq_unpack(_t(group, tensors, "weight"), bits).float()
    zeros = _awq_unpack(_t(group, tensors, "zero_point"), bits).float()
    scales = _t(group, tensors, "scale").float()
    size = int(group.params["group_size"])
    w = (q - zeros.repeat_interleave(size, 0)) * scales.repeat_interleave(size, 0)
    return w.t().contiguous()


def _bnb_codes(group: QuantGroup, tensors: Tensors, n: int) -> torch.Tensor:
    """The 4-bit codes, the high nibble first (bitsandbytes' kDequantize4bit), ``n`` of them."""
    import torch

    b = _t(group, tensors, "weight").reshape(-1).view(torch.uint8)
    return torch.stack((b >> 4, b & 0x0F), dim=-1).reshape(-1)[:n].long()


def _bnb_absmax(group: QuantGroup, tensors: Tensors, state: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's absmax (nested: ``nested_quant_map[code] * nested_absmax[block] + nested_offset``, as
    dequantize_4bit does) and how far the nested rounding may have moved it (0 when not nested)."""
    import torch

    absmax = _t(group, tensors, "absmax")
    if absmax.dtype != torch.uint8:
        return absmax.float(), torch.zeros_like(absmax, dtype=torch.float32)
    codes = absmax.long()
    nested = _t(group, tensors, "nested_absmax").float().repeat_interleave(int(state["nested_blocksize"]))[:codes.numel()]
    qmap = _t(group, tensors, "nested_quant_map").float()
    value = qmap[codes] * nested + float(state.get("nested_offset", 0.0))
    return value, _half_gaps(qmap)[codes] * nested.abs()


def _half_gaps(qmap: torch.Tensor) -> torch.Tensor:
    """Half the larger gap from each code's value to its sorted neighbours (the ends: their one neighbour)."""
    import torch

    values, order = torch.sort(qmap)
    gaps = values.diff()
    below = torch.cat((gaps[:1], gaps))
    above = torch.cat((gaps, gaps[-1:]))
    out = torch.empty_like(qmap)
    out[order] = torch.maximum(below, above) / 2
    return out


def _bnb4_parts(group: QuantGroup, tensors: Tensors) -> tuple[dict, tuple[int, ...], int, torch.Tensor]:
    """A bitsandbytes 4-bit group's quant state, its weight's shape and element count, and its 4-bit codes."""
    state = bnb_state(group, tensors)
    shape = tuple(state["shape"])
    n = 1
    for d in shape:
        n *= d
    return state, shape, n, _bnb_codes(group, tensors, n)


def bnb4(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """bitsandbytes nf4/fp4 (functional.dequantize_4bit): ``quant_map[code] * absmax[i // blocksize]``."""
    state, shape, n, codes = _bnb4_parts(group, tensors)
    absmax, _err = _bnb_absmax(group, tensors, state)
    scale = absmax.repeat_interleave(int(state["blocksize"]))[:n]
    return (_t(group, tensors, "quant_map").float()[codes] * scale).reshape(shape)


def bnb4_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    state, shape, n, codes = _bnb4_parts(group, tensors)
    absmax, err = _bnb_absmax(group, tensors, state)
    size = int(state["blocksize"])
    a, da = absmax.abs().repeat_interleave(size)[:n], err.repeat_interleave(size)[:n]
    qmap = _t(group, tensors, "quant_map").float()
    value = qmap[codes].abs()
    return (_half_gaps(qmap)[codes] * _TIE * (a + da) + value * da + value * a * _SLACK).reshape(shape)


def bnb_int8(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    """LLM.int8 (functional.int8_vectorwise_dequant): ``weight * SCB[row] * 7.874015718698502e-3`` (1/127)."""
    return _t(group, tensors, "weight").float() * _t(group, tensors, "scale").float().view(-1, 1) * 7.874015718698502e-3


def bnb_int8_bound(group: QuantGroup, tensors: Tensors) -> torch.Tensor:
    w = _t(group, tensors, "weight")
    step = _t(group, tensors, "scale").float().abs().view(-1, 1) / 127
    return (0.5 * _TIE + _SLACK * w.float().abs()) * step.expand(tuple(w.shape))


#: one dequantization per ``Scheme.dequant`` name
KERNELS: dict[str, Kernel] = {"fp8_scaled": fp8_scaled, "nvfp4_ct": nvfp4, "nvfp4_modelopt": nvfp4, "mxfp4": mxfp4,
                              "int_packed_ct": int_packed_ct, "gptq": gptq, "gptq_v2": gptq, "awq": awq, "bnb4": bnb4,
                              "bnb_int8": bnb_int8, "torchao_affine": torchao_affine,
                              "torchao_int4": torchao_int4}
#: the round-to-nearest bound of each kernel whose schemes round to nearest
BOUNDS: dict[str, Kernel] = {"fp8_scaled": fp8_bound, "nvfp4_ct": nvfp4_bound, "nvfp4_modelopt": nvfp4_bound,
                             "mxfp4": mxfp4_bound, "int_packed_ct": int_packed_ct_bound, "bnb4": bnb4_bound,
                             "bnb_int8": bnb_int8_bound, "torchao_affine": torchao_affine_bound,
                             "torchao_int4": torchao_int4_bound}
