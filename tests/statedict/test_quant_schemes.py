"""The quantization schemes table: each scheme's intact group, written as its publisher lays it out, is found,
named and dequantized as the publisher's own code does; every broken variant names its module."""

from __future__ import annotations

import pytest
import torch

from ckptfix.statedict.quant_dequant import BOUNDS, KERNELS, dequantize, step_bound
from ckptfix.statedict.quant_groups import QuantProblem, check_values, find_groups
from ckptfix.statedict.quant_schemes import SCHEMES, quant_config
from tests import quant_layouts as ql

CASES = sorted(ql.CASES)


@pytest.fixture(scope="module")
def built() -> dict[str, ql.Built]:
    return {case: ql.build(case) for case in CASES}


def test_every_row_has_its_kernel_and_bound() -> None:
    for scheme in SCHEMES:
        assert scheme.dequant in KERNELS, scheme.name
        assert (scheme.dequant in BOUNDS) == scheme.rtn, scheme.name
        assert scheme.source and scheme.formula, scheme.name


@pytest.mark.parametrize("case", CASES)
def test_intact_group_named_and_dequantized_as_its_publisher_does(built: dict[str, ql.Built], case: str) -> None:
    b = built[case]
    layout = find_groups(ql.infos(b.state_dict), b.config)
    assert layout.problems == [] and layout.unknown == []
    [group] = layout.groups
    assert group.scheme == ql.CASES[case][1]
    assert layout.counts() == {group.scheme: 1}
    assert layout.plain == frozenset(b.state_dict) - set(group.keys)
    assert check_values(group, b.state_dict) == []
    values = dequantize(group, b.state_dict)
    torch.testing.assert_close(values, b.reference[group.module].float(), rtol=0, atol=0)
    assert dequantize(group, b.state_dict, torch.bfloat16).dtype == torch.bfloat16
    bound = step_bound(group, b.state_dict)
    error = (values - b.originals[group.module]).abs()
    if group.rtn:
        assert bound is not None and bool((error <= bound).all())
        off = (dequantize(group, _scale_off_by_4(group.companions, b.state_dict)) - b.originals[group.module]).abs()
        assert not bool((off <= bound).all())  # a scale off by 4x leaves the step bound
    else:
        assert bound is None


@pytest.mark.parametrize(("case", "scheme", "problem"), [
    ("modelopt-fp8", "ct-fp8", None),  # the same values either way: named, the look-alike in ``also``
    ("gptq", "gptq", "ambiguous"),
    ("gptq-v2", "gptq", "ambiguous"),  # v1 vs v2 differ by one zero step: only a config decides
    ("awq", "awq", None),  # told from GPTQ by where qweight packs
    ("fp8-block", "fp8-block", None),
])
def test_without_a_config(built: dict[str, ql.Built], case: str, scheme: str, problem: str | None) -> None:
    layout = find_groups(ql.infos(built[case].state_dict), None)
    [group] = layout.groups
    assert group.scheme == scheme
    assert [p.kind for p in layout.problems] == ([problem] if problem else [])
    if case == "modelopt-fp8":
        assert group.also == ("modelopt-fp8",)


def test_config_files_read_alike() -> None:
    qc = {"quant_method": "gptq", "checkpoint_format": "gptq_v2"}
    assert quant_config({"quantization_config": qc}) == qc == quant_config(qc)
    assert quant_config({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}) == \
        {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    assert quant_config({"architectures": ["LlamaForCausalLM"]}) == {} == quant_config(None)


def _scale_off_by_4(companions: dict[str, str], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with one scale 4x off: a float one multiplied, an E8M0 exponent raised by 2."""
    out = dict(sd)
    for role in ("global_scale", "nested_absmax", "scale", "absmax"):
        key = companions.get(role)
        if key and out[key].dtype in (torch.float32, torch.bfloat16, torch.float16):
            out[key] = out[key] * 4
            return out
    key = companions["scale"]
    out[key] = (out[key].view(torch.uint8) + 2).view(out[key].dtype)
    return out


def _main_scale(group_companions: dict[str, str]) -> str:
    return group_companions.get("scale") or group_companions["absmax"]


def _broken(b: ql.Built, variant: str) -> dict[str, torch.Tensor]:
    """The intact state dict with one thing broken, as the year's bug reports break them."""
    [group] = find_groups(ql.infos(b.state_dict), b.config).groups
    sd = dict(b.state_dict)
    scale = _main_scale(group.companions)
    if variant == "scale dropped":
        del sd[scale]
    elif variant == "orphan scale":
        del sd[group.weight]
    elif variant == "wrong grid":
        sd[scale] = torch.ones(2, dtype=sd[scale].dtype) if sd[scale].numel() == 1 else sd[scale][:-1]
    elif variant == "short packed weight":
        w = sd[group.weight]
        sd[group.weight] = w[..., :-1] if w.shape[-1] > 1 else w[:-1]
    elif variant == "bad scale value":
        key = next((k for role, k in group.companions.items() if role in ("scale", "absmax", "nested_absmax")
                    and sd[k].dtype not in (torch.uint8, torch.float8_e8m0fnu)), None)
        if key is None:  # E8M0 exponents: 0xFF is their NaN
            byte = sd[scale].view(torch.uint8).clone()
            byte.view(-1)[0] = 0xFF
            sd[scale] = byte.view(sd[scale].dtype)
        else:
            bad = sd[key].float().clone()
            bad.view(-1)[0] = float("nan")
            sd[key] = bad.to(sd[key].dtype)
    return sd


PACKED = [c for c in CASES if c.split("-")[0] in ("ct", "mxfp4", "gptq", "awq", "modelopt", "bnb")
          and not c.startswith(("ct-fp8", "modelopt-fp8")) and c != "bnb-int8"]
VARIANTS = [(c, v) for c in CASES for v in ("scale dropped", "orphan scale", "wrong grid", "bad scale value")] + \
    [(c, "short packed weight") for c in PACKED]


@pytest.mark.parametrize(("case", "variant"), VARIANTS)
def test_broken_variant_names_its_module(built: dict[str, ql.Built], case: str, variant: str) -> None:
    b = built[case]
    sd = _broken(b, variant)
    layout = find_groups(ql.infos(sd), b.config)
    problems: list[QuantProblem] = list(layout.problems)
    for group in layout.groups:
        problems += check_values(group, sd)
    module = next(iter(b.originals))
    kinds = {"scale dropped": "missing", "orphan scale": "orphan", "wrong grid": "shape",
             "short packed weight": "shape", "bad scale value": "value"}
    assert problems, f"{case}: {variant} went unnoticed"
    assert all(p.module == module for p in problems), problems
    assert kinds[variant] in {p.kind for p in problems}, problems


def test_what_is_not_a_group() -> None:
    f8, f32 = "float8_e4m3fn", "float32"
    layout = find_groups({
        "a.weight": (f8, (4, 4)), "a.weight_scale_odd": (f32, (1,)),  # a scale no row knows: unknown
        "b.weight": (f8, (4, 4)),  # float8 with no scale at all: its values are not the weights'
        "c.weight": ("bfloat16", (4, 4)), "c.input_scale": (f32, ()),  # an input scale beside a plain weight
        "attn.k_scale": (f32, ()), "attn.v_scale": (f32, ()),  # KV-cache scales stand alone
        "norm.weight": (f32, (4,)),
    }, None)
    assert layout.groups == [] and layout.unknown == ["a.weight"]
    assert {(p.module, p.kind) for p in layout.problems} == {("b", "missing"), ("c", "orphan")}
    assert layout.plain == {"a.weight_scale_odd", "c.weight", "attn.k_scale", "attn.v_scale", "norm.weight"}


def test_shapes_read_from_config() -> None:
    """A block size the config names decides the grid; a grid off by one block is wrong."""
    infos = {"x.weight": ("float8_e4m3fn", (256, 128)), "x.weight_scale_inv": ("float32", (4, 2))}
    qc = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    assert find_groups(infos, qc).problems == []
    [problem] = find_groups(infos, None).problems  # 128x128 blocks: a [2, 1] grid
    assert problem.module == "x" and "[2, 1]" in problem.message


@pytest.mark.parametrize(("config", "problems"), [({"quant_method": "gptq", "bits": 8}, []), (None, ["ambiguous"])])
def test_gptq_bits_from_config_or_g_idx(config: dict | None, problems: list[str]) -> None:
    """8-bit GPTQ (in 64, out 32, groups of 32): the config's bits, else g_idx's length over qweight's rows."""
    infos = {"m.qweight": ("int32", (16, 32)), "m.qzeros": ("int32", (2, 8)), "m.scales": ("float16", (2, 32)),
             "m.g_idx": ("int32", (64,))}
    layout = find_groups(infos, config)
    [group] = layout.groups
    assert (group.params["bits"], group.params["group_size"]) == (8, 32)
    assert [p.kind for p in layout.problems] == problems
