"""The quantization schemes as one table: each row says how a scheme's groups are recognised (the weight's key
suffix and dtypes, its companions' suffixes and dtypes, the companions' shape rules, the ``quantization_config``
that selects it among look-alikes), its dequantization formula, and whether it rounds to nearest.

Plain data and shape arithmetic, no torch and no file I/O: :mod:`.quant_groups` reads the table to group a state
dict's keys, :mod:`.quant_dequant` holds each row's ``dequant`` kernel. Dtype names are torch's, as
:mod:`ckptfix.core.units` spells them (a safetensors ``F4`` is ``float4_e2m1fn_x2``, its last dimension in bytes).

To add a scheme: one :class:`Scheme` row in ``SCHEMES`` and its kernel in :mod:`.quant_dequant`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import ceil, prod
from typing import Any

Shape = tuple[int, ...]
#: a row's shape rule: the shapes of the weight (role ``weight``) and the companions present, and the quantization
#: config (``{}`` when none) → the group's parameters and the problems (empty when the shapes fit)
ShapeRule = Callable[[Mapping[str, Shape], Mapping[str, Any]], "tuple[dict[str, Any], list[str]]"]

FP8 = frozenset({"float8_e4m3fn"})
FLOATS = frozenset({"float32", "float16", "bfloat16"})
F32 = frozenset({"float32"})
PACKED_FP4 = frozenset({"uint8", "float4_e2m1fn_x2"})  # two E2M1 values a byte, the low nibble first
E8M0 = frozenset({"uint8", "float8_e8m0fnu"})  # a power of two, 2**(byte - 127); 0xFF is NaN
INT32 = frozenset({"int32"})
U8 = frozenset({"uint8"})
#: dtypes a quantized weight is stored in: beside a ``*scale*`` key and in no group, a tensor in one is "unknown"
QUANT_STORAGE = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2",
                           "float8_e8m0fnu", "uint8", "int8", "int32"})
#: dtypes a weight never sits in without its scales
SCALED_ONLY = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2"})


@dataclass(frozen=True)
class Companion:
    """A tensor a quantized weight needs beside it: its key is the module prefix + ``suffix``."""

    role: str
    suffix: str
    dtypes: frozenset[str]
    required: bool = True


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme. ``weight_suffix`` follows the module prefix (``.weight``, ``_blocks``)."""

    name: str
    weight_suffix: str
    weight_dtypes: frozenset[str]
    companions: tuple[Companion, ...]
    selected_by: Callable[[Mapping[str, Any]], bool]  # the quantization config names this scheme
    shapes: ShapeRule
    dequant: str  # the kernel's name in quant_dequant.KERNELS
    formula: str
    rtn: bool  # round to nearest: the step bound applies (GPTQ/AWQ compensate errors: reported, not failed)
    source: str  # the publisher's code the formula was checked against
    default: bool = False  # taken among look-alikes with other formulas when no config decides
    dequantized_suffix: str = ".weight"  # the dequantized weight's key: the module prefix + this


def quant_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The quantization config inside ``config``: config.json's ``quantization_config``, hf_quant_config.json's
    ``quantization`` (modelopt: ``quant_method: modelopt`` added), or the quantization config itself; ``{}``."""
    if not isinstance(config, Mapping):
        return {}
    if isinstance(config.get("quantization_config"), Mapping):
        return dict(config["quantization_config"])
    if isinstance(config.get("quantization"), Mapping):  # hf_quant_config.json (modelopt's export)
        return {"quant_method": "modelopt", **config["quantization"]}
    return dict(config) if "quant_method" in config or "quant_algo" in config else {}


def _method(*names: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda qc: str(qc.get("quant_method", "")).lower() in names


def _modelopt(*algos: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda qc: _method("modelopt")(qc) and str(qc.get("quant_algo", "")).upper() in algos


def _gptq(formats: tuple[str, ...]) -> Callable[[Mapping[str, Any]], bool]:
    return lambda qc: _method("gptq")(qc) and str(qc.get("checkpoint_format", "gptq")).lower() in formats


def _ct_weights(qc: Mapping[str, Any]) -> dict[str, Any]:
    """The first config group's ``weights`` of a compressed-tensors config (its ``block_structure``, ``num_bits``…)."""
    for group in (qc.get("config_groups") or {}).values():
        if isinstance(group, Mapping) and isinstance(group.get("weights"), Mapping):
            return dict(group["weights"])
    return {}


def _numel(shape: Shape) -> int:
    return prod(shape)


def _two_d(shapes: Mapping[str, Shape], problems: list[str]) -> Shape | None:
    weight = shapes["weight"]
    if len(weight) != 2:
        problems.append(f"weight shape {list(weight)} is not 2-D")
        return None
    return weight


def _grid(weight: Shape, block: tuple[int, ...]) -> Shape:
    """The scale grid of a [out, in] weight in blocks: ceil-sized at the edges."""
    return (ceil(weight[0] / block[0]), ceil(weight[1] / block[1]))


def _expect(problems: list[str], role: str, got: Shape, want: Shape, why: str) -> None:
    if tuple(got) != tuple(want):
        problems.append(f"{role} shape {list(got)} is not {list(want)} ({why})")


def block_fp8_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """DeepSeek/Qwen3: ``weight_scale_inv`` is [ceil(out/b0), ceil(in/b1)], b from ``weight_block_size`` (128×128)."""
    block = tuple(qc.get("weight_block_size") or (128, 128))
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    if weight is not None:
        _expect(problems, "scale", shapes["scale"], _grid(weight, block), f"{block[0]}x{block[1]} blocks")
    return {"block": block}, problems


def ct_fp8_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """compressed-tensors FP8: a scale per tensor ([] or [1]), per channel ([out, 1]) or per block (the grid)."""
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    scale = tuple(shapes["scale"])
    if weight is None:
        return {}, problems
    if _numel(scale) == 1 and len(scale) <= 2:
        return {"kind": "tensor"}, problems
    if scale == (weight[0], 1):
        return {"kind": "channel"}, problems
    block = tuple(_ct_weights(qc).get("block_structure") or (128, 128))
    _expect(problems, "scale", scale, _grid(weight, block),
            f"per tensor, per channel or {block[0]}x{block[1]} blocks")
    return {"kind": "block", "block": block}, problems


def scalar_scale_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """modelopt FP8: one scale for the tensor."""
    problems: list[str] = []
    _two_d(shapes, problems)
    if _numel(shapes["scale"]) != 1:
        problems.append(f"scale shape {list(shapes['scale'])} is not one value (per-tensor)")
    return {"kind": "tensor"}, problems


def nvfp4_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """NVFP4: [out, in/2] bytes, an FP8 scale per 16 values ([out, in/16]), one global scale."""
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    if weight is not None:
        _expect(problems, "scale", shapes["scale"], (weight[0], weight[1] * 2 // 16), "an FP8 scale per 16 values")
        if weight[1] * 2 % 16:
            problems.append(f"packed weight holds {weight[1] * 2} values a row, not a multiple of 16 (bytes cut?)")
    if _numel(shapes["global_scale"]) != 1:
        problems.append(f"global_scale shape {list(shapes['global_scale'])} is not one value")
    return {"group": 16}, problems


def mxfp4_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """gpt-oss MXFP4: blocks [..., G, 16] bytes (32 values), scales [..., G], one E8M0 exponent per 32 values."""
    problems: list[str] = []
    blocks, scales = tuple(shapes["weight"]), tuple(shapes["scale"])
    if len(blocks) < 2 or blocks[-1] != 16:
        problems.append(f"packed weight shape {list(blocks)} does not end in 16 bytes (32 FP4 values) per block")
    else:
        _expect(problems, "scale", scales, blocks[:-1], "one E8M0 exponent per 32 values")
    return {"group": 32}, problems


def _int_bits(qc: Mapping[str, Any], default: int = 4) -> int:
    return int(qc.get("bits") or _ct_weights(qc).get("num_bits") or default)


def ct_int_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """compressed-tensors pack-quantized: int32 [out, ceil(in/per_word)], scales [out, groups], ``weight_shape``
    [2] (the true [out, in]), zero points packed along out [ceil(out/per_word), groups] when asymmetric."""
    bits = _int_bits(qc)
    per_word = 32 // bits
    params = {"bits": bits, "group_size": _ct_weights(qc).get("group_size")}
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    if _numel(shapes["shape"]) != 2:
        problems.append(f"weight_shape shape {list(shapes['shape'])} is not [2]")
    if weight is None:
        return params, problems
    scale = tuple(shapes["scale"])
    size = params["group_size"]
    most = ceil(weight[1] * per_word / size) if size else weight[1] * per_word
    least = ceil(((weight[1] - 1) * per_word + 1) / size) if size else 1
    if len(scale) != 2 or scale[0] != weight[0] or not least <= scale[1] <= most:
        problems.append(f"scale shape {list(scale)} is not [{weight[0]}, groups] ({least} ≤ groups ≤ {most} for "
                        f"{weight[1]} packed words a row)")
    elif "zero_point" in shapes:
        _expect(problems, "zero_point", shapes["zero_point"], (ceil(weight[0] / per_word), scale[1]),
                f"{bits}-bit zero points packed along the output dimension")
    return params, problems


def _groups_rows(problems: list[str], scales: Shape, inp: int) -> int:
    """The input rows per group of GPTQ/AWQ scales [groups, out] over ``inp`` input rows (0 where they don't fit)."""
    if len(scales) != 2 or scales[0] < 1 or inp % scales[0]:
        problems.append(f"scales shape {list(scales)} does not divide {inp} input rows into groups")
        return 0
    return inp // scales[0]


def gptq_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """GPTQ: qweight int32 [in*bits/32, out], scales [groups, out], qzeros [groups, out*bits/32], g_idx [in]
    (its length gives the bits where no config does)."""
    bits = _int_bits(qc)
    problems: list[str] = []
    qweight = _two_d(shapes, problems)
    if qweight is None:
        return {"bits": bits}, problems
    g_rows = _numel(shapes["g_idx"]) if "g_idx" in shapes else 0
    if "bits" not in qc and g_rows and qweight[0] and 32 * qweight[0] % g_rows == 0 and \
            32 * qweight[0] // g_rows in (2, 4, 8):
        bits = 32 * qweight[0] // g_rows
    inp, out = qweight[0] * 32 // bits, qweight[1]
    scales = tuple(shapes["scale"])
    if len(scales) != 2 or scales[1] != out:
        problems.append(f"scales shape {list(scales)} is not [groups, {out}] (GPTQ packs qweight along in)")
        return {"bits": bits}, problems
    group = _groups_rows(problems, scales, inp)
    _expect(problems, "qzeros", shapes["zero_point"], (scales[0], out * bits // 32), f"{bits}-bit zeros packed along out")
    if "g_idx" in shapes:
        _expect(problems, "g_idx", shapes["g_idx"], (inp,), "a group index per input row")
    return {"bits": bits, "group_size": group, "v1": True}, problems


def gptq_v2_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """GPTQ v2 (gptqmodel's ``checkpoint_format: gptq_v2``): v1's layout, zeros stored as they are."""
    params, problems = gptq_shapes(shapes, qc)
    return {**params, "v1": False}, problems


def awq_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """AWQ (GEMM): qweight int32 [in, out*bits/32] in AWQ's interleaved order, scales [groups, out], qzeros
    [groups, out*bits/32], no g_idx."""
    bits = _int_bits(qc)
    problems: list[str] = []
    qweight = _two_d(shapes, problems)
    if qweight is None:
        return {"bits": bits}, problems
    inp, out = qweight[0], qweight[1] * 32 // bits
    scales = tuple(shapes["scale"])
    if len(scales) != 2 or scales[1] != out:
        problems.append(f"scales shape {list(scales)} is not [groups, {out}] (AWQ packs qweight along out)")
        return {"bits": bits}, problems
    group = _groups_rows(problems, scales, inp)
    _expect(problems, "qzeros", shapes["zero_point"], (scales[0], qweight[1]), f"{bits}-bit zeros packed along out")
    return {"bits": bits, "group_size": group}, problems


def torchao_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """torchao flattened into safetensors: ``_weight_qdata`` [out, in], ``_weight_scale`` per tensor, per row
    [out, 1] or per block of the row [out, in/block]; an int8 zero point shaped as the scale."""
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    scale = tuple(shapes["scale"])
    if weight is not None and _numel(scale) != 1 and (
            len(scale) != 2 or scale[0] != weight[0] or scale[1] < 1 or weight[1] % scale[1]):
        int4 = len(scale) == 2 and scale[1] == weight[0] and 2 * weight[1] % scale[0] == 0
        problems.append(f"scale shape {list(scale)} is not one value, [{weight[0]}, 1] or [{weight[0]}, blocks]"
                        + (" (an Int4Tensor's [groups, out] grid without its bfloat16 _weight_zero_point?)" if int4
                           else ""))
    if "zero_point" in shapes:
        _expect(problems, "zero_point", shapes["zero_point"], scale, "one zero point per scale")
    return {}, problems


def torchao_int4_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """torchao ``Int4Tensor`` (plain packing): ``_weight_qdata`` int8 [out, in/2] (two values a byte), scale and
    zero point [in/group, out] (transposed: column-major for its kernels), the group dividing in."""
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    if weight is None:
        return {}, problems
    scale, inp = tuple(shapes["scale"]), weight[1] * 2
    if len(scale) != 2 or scale[1] != weight[0] or not 1 <= scale[0] <= inp or inp % scale[0]:
        problems.append(f"scale shape {list(scale)} is not [groups, {weight[0]}] over {inp} input columns")
        return {}, problems
    _expect(problems, "zero_point", shapes["zero_point"], scale, "one zero point per scale")
    return {"group_size": inp // scale[0]}, problems


def bnb4_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """bitsandbytes 4-bit: bytes [ceil(n/2), 1], an absmax per block of a power-of-two size (64 by default),
    a 16-entry code map; nested (double-quantized) absmax is uint8 with its own absmax and 256-entry map."""
    problems: list[str] = []
    nbytes, blocks = _numel(shapes["weight"]), _numel(shapes["absmax"])
    if _numel(shapes["quant_map"]) != 16:
        problems.append(f"quant_map shape {list(shapes['quant_map'])} is not [16]")
    if not any(ceil(2 * nbytes / 2**k) == blocks or ceil((2 * nbytes - 1) / 2**k) == blocks for k in range(5, 13)):
        problems.append(f"absmax holds {blocks} blocks, which no block size (32…4096) gives {2 * nbytes} values")
    return {}, problems


def bnb8_shapes(shapes: Mapping[str, Shape], qc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """LLM.int8: int8 [out, in], ``SCB`` [out] (each row's absmax; the row is weight * SCB / 127)."""
    problems: list[str] = []
    weight = _two_d(shapes, problems)
    if weight is not None:
        _expect(problems, "scale", shapes["scale"], (weight[0],), "one absmax per output row")
    return {}, problems


_FP8_SCALE = Companion("scale", ".weight_scale", FLOATS)
_INPUT_SCALE = Companion("input_scale", ".input_scale", FLOATS, required=False)
_BNB4_COMMON = (Companion("absmax", ".weight.absmax", F32 | U8), Companion("quant_map", ".weight.quant_map", F32),
                Companion("nested_absmax", ".weight.nested_absmax", F32, required=False),
                Companion("nested_quant_map", ".weight.nested_quant_map", F32, required=False))
_GPTQ_COMPANIONS = (Companion("scale", ".scales", FLOATS), Companion("zero_point", ".qzeros", INT32),
                    Companion("g_idx", ".g_idx", INT32, required=False))

SCHEMES: tuple[Scheme, ...] = (
    Scheme("fp8-block", ".weight", FP8, (Companion("scale", ".weight_scale_inv", FLOATS), _INPUT_SCALE),
           _method("fp8"), block_fp8_shapes, "fp8_scaled", "weight * scale_inv (each block's; named inverse, multiplied)",
           rtn=True, source="transformers integrations/finegrained_fp8.py; deepseek-ai/DeepSeek-V3 inference/kernel.py "
           "weight_dequant"),
    Scheme("ct-fp8", ".weight", FP8, (_FP8_SCALE, _INPUT_SCALE), _method("compressed-tensors"), ct_fp8_shapes,
           "fp8_scaled", "weight * scale (per tensor, channel or block)", rtn=True,
           source="compressed-tensors quantization/lifecycle/forward.py _dequantize"),
    Scheme("modelopt-fp8", ".weight", FP8, (Companion("scale", ".weight_scale", F32), _INPUT_SCALE),
           _modelopt("FP8"), scalar_scale_shapes, "fp8_scaled", "weight * weight_scale", rtn=True,
           source="TensorRT-Model-Optimizer modelopt/torch/export/quant_utils.py (weight / weight_scale on export)"),
    Scheme("ct-nvfp4", ".weight_packed", PACKED_FP4,
           (Companion("scale", ".weight_scale", FP8), Companion("global_scale", ".weight_global_scale", F32),
            Companion("input_global_scale", ".input_global_scale", F32, required=False)),
           _method("compressed-tensors"), nvfp4_shapes, "nvfp4_ct", "e2m1 * (weight_scale / weight_global_scale)",
           rtn=True, source="compressed-tensors compressors/quantized_compressors/nvfp4_quantized.py, "
           "quantization/lifecycle/forward.py _dequantize (scale / global_scale)"),
    Scheme("modelopt-nvfp4", ".weight", PACKED_FP4,
           (Companion("scale", ".weight_scale", FP8), Companion("global_scale", ".weight_scale_2", F32), _INPUT_SCALE),
           _modelopt("NVFP4"), nvfp4_shapes, "nvfp4_modelopt", "e2m1 * weight_scale * weight_scale_2", rtn=True,
           source="TensorRT-Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py dequantize"),
    Scheme("ct-int-packed", ".weight_packed", INT32,
           (Companion("scale", ".weight_scale", FLOATS), Companion("shape", ".weight_shape", frozenset({"int32", "int64"})),
            Companion("zero_point", ".weight_zero_point", INT32, required=False),
            Companion("g_idx", ".weight_g_idx", INT32, required=False)),
           _method("compressed-tensors"), ct_int_shapes, "int_packed_ct",
           "(q - zero_point) * scale, each unpacked less 2**(bits-1)",
           rtn=True, source="compressed-tensors compressors/quantized_compressors/pack_quantized.py unpack_from_int32"),
    Scheme("mxfp4", "_blocks", PACKED_FP4, (Companion("scale", "_scales", E8M0),), _method("mxfp4"), mxfp4_shapes,
           "mxfp4", "e2m1 * 2**(scale - 127)", rtn=True,
           source="transformers integrations/mxfp4.py convert_moe_packed_tensors", dequantized_suffix=""),
    Scheme("torchao-int4", "._weight_qdata", frozenset({"int8"}),  # before int8: its look-alike without the zeros
           (Companion("scale", "._weight_scale", FLOATS), Companion("zero_point", "._weight_zero_point", FLOATS)),
           _method("torchao"), torchao_int4_shapes, "torchao_int4", "(q + 8) * scale + (zero_point - 8 * scale), "
           "q the signed nibbles (low first), per group of the row", rtn=True,
           source="torchao quantization/quantize_/workflows/int4/int4_tensor.py Int4Tensor (mslk pack_int4, "
           "int4_row_quantize_zp); prototype/gptq/api.py _int4_row_dequantize_zp"),
    Scheme("torchao-int8", "._weight_qdata", frozenset({"int8"}),
           (Companion("scale", "._weight_scale", FLOATS),
            Companion("zero_point", "._weight_zero_point", frozenset({"int8"}), required=False)),
           _method("torchao"), torchao_shapes, "torchao_affine", "(qdata - zero_point) * scale, per row or block",
           rtn=True, source="torchao quantization/quantize_/workflows/int8/int8_tensor.py Int8Tensor.dequantize "
           "(quant_primitives.dequantize_affine); flattened by transformers' torchao integration"),
    Scheme("torchao-float8", "._weight_qdata", FP8, (Companion("scale", "._weight_scale", FLOATS),),
           _method("torchao"), torchao_shapes, "fp8_scaled", "qdata * scale, per tensor or row", rtn=True,
           source="torchao quantization/quantize_/workflows/float8/float8_tensor.py Float8Tensor.dequantize"),
    Scheme("gptq", ".qweight", INT32, _GPTQ_COMPANIONS, _gptq(("gptq",)), gptq_shapes, "gptq",
           "scales[g_idx] * (q - (qzeros + 1))", rtn=False, default=True,
           source="AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py; gptqmodel utils/model.py convert_gptq_v1_to_v2"),
    Scheme("gptq-v2", ".qweight", INT32, _GPTQ_COMPANIONS, _gptq(("gptq_v2",)), gptq_v2_shapes, "gptq_v2",
           "scales[g_idx] * (q - qzeros)", rtn=False,
           source="gptqmodel nn_modules/qlinear/__init__.py dequantize_weight"),
    Scheme("awq", ".qweight", INT32, (Companion("scale", ".scales", FLOATS), Companion("zero_point", ".qzeros", INT32)),
           _method("awq"), awq_shapes, "awq", "(q - qzeros) * scales, q in order [0, 2, 4, 6, 1, 3, 5, 7]", rtn=False,
           source="AutoAWQ awq/utils/packing_utils.py dequantize_gemm"),
    Scheme("bnb-nf4", ".weight", U8, (*_BNB4_COMMON, Companion("quant_state", ".weight.quant_state.bitsandbytes__nf4", U8)),
           _method("bitsandbytes"), bnb4_shapes, "bnb4", "quant_map[nibble] * absmax[block], high nibble first",
           rtn=True, source="bitsandbytes functional.py dequantize_4bit, QuantState.from_dict"),
    Scheme("bnb-fp4", ".weight", U8, (*_BNB4_COMMON, Companion("quant_state", ".weight.quant_state.bitsandbytes__fp4", U8)),
           _method("bitsandbytes"), bnb4_shapes, "bnb4", "quant_map[nibble] * absmax[block], high nibble first",
           rtn=True, source="bitsandbytes functional.py dequantize_4bit, QuantState.from_dict"),
    Scheme("bnb-int8", ".weight", frozenset({"int8"}),
           (Companion("scale", ".SCB", F32), Companion("format", ".weight_format", U8, required=False)),
           _method("bitsandbytes"), bnb8_shapes, "bnb_int8", "weight * SCB[row] / 127", rtn=True,
           source="bitsandbytes functional.py int8_vectorwise_dequant; transformers integrations/bitsandbytes.py"),
)

BY_NAME: dict[str, Scheme] = {scheme.name: scheme for scheme in SCHEMES}
#: every companion suffix: a key ending in one that no group holds is an orphan
COMPANION_SUFFIXES: tuple[str, ...] = tuple(sorted({c.suffix for s in SCHEMES for c in s.companions}, key=len,
                                                   reverse=True))
#: activation and KV-cache scales, which stand alone beside a plain weight (no weight group needs them)
STANDALONE_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale", ".kv_cache_scale", ".output_scale")
#: weight names only a quantized weight has (``.weight`` alone says nothing): one without its scales is broken
QUANT_ONLY_SUFFIXES: tuple[str, ...] = tuple(sorted({s.weight_suffix for s in SCHEMES} - {".weight"}))
#: activation scales: a weight's companions, but no scale of its values
ACTIVATION_SCALES = (".input_scale", ".input_global_scale")
