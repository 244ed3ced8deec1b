"""The schemes table on files the real libraries wrote (fixtures/quant, made by hand by its make_*.py scripts:
llmcompressor, bitsandbytes through transformers, torchao flattened by transformers, gptqmodel): every quantized weight is
found and named, dequantized equal to the library's own dequantization within the rounding of the dtype it
computed in, and, the quantizers rounding to nearest, within the step bound of the bf16 original."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfix.statedict.quant_dequant import dequantize, step_bound
from ckptfix.statedict.quant_groups import check_values, find_groups, infos_of

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "quant"
MANIFEST = json.loads((ROOT / "MANIFEST.json").read_text())["files"]
SAFETENSORS = sorted(f for f in MANIFEST if f.endswith(".safetensors"))
#: the scheme each library's files are named by
SCHEME = {"llmcompressor/fp8_block": "ct-fp8", "llmcompressor/fp8_channel": "ct-fp8", "llmcompressor/nvfp4a16": "ct-nvfp4",
          "llmcompressor/w4a16": "ct-int-packed", "bitsandbytes/nf4": "bnb-nf4", "bitsandbytes/nf4_double_quant": "bnb-nf4",
          "bitsandbytes/fp4": "bnb-fp4", "bitsandbytes/int8": "bnb-int8",
          "torchao/int8_weight_only_safetensors": "torchao-int8", "modelopt/fp8": "modelopt-fp8",
          "modelopt/nvfp4": "modelopt-nvfp4", "mxfp4/gpt_oss": "mxfp4", "awq/gemm": "awq",
          "gptq/v1": "gptq", "gptq/v2": "gptq-v2"}
#: files written per the publisher's layout from values of their own (no quantizer ran on CPU): no bf16 original
NO_ORIGINAL = {"mxfp4/gpt_oss"}


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(ROOT / "original" / "model.safetensors")


def test_every_real_file_has_its_scheme() -> None:
    assert {f.rsplit("/", 1)[0] for f in SAFETENSORS} == set(SCHEME)


@pytest.mark.parametrize("name", SAFETENSORS)
def test_real_file_dequantized_as_its_library_does(name: str, original: dict[str, torch.Tensor]) -> None:
    folder = (ROOT / name).parent
    sd = load_file(ROOT / name)
    reference = load_file(ROOT / MANIFEST[name]["reference"])
    layout = find_groups(infos_of(sd), json.loads((folder / "config.json").read_text()))
    assert layout.problems == [] and layout.unknown == []
    assert layout.counts() == {SCHEME[str(folder.relative_to(ROOT))]: len(reference)}
    assert {g.dequantized_key for g in layout.groups} == set(reference)
    for group in layout.groups:
        assert check_values(group, sd) == []
        values = dequantize(group, sd)
        # within the rounding of bfloat16, where the library computed in it (compressed-tensors' NVFP4)
        torch.testing.assert_close(values, reference[group.dequantized_key].float(), rtol=2.0**-8, atol=0)
        bound = step_bound(group, sd)
        assert (bound is not None) == group.rtn  # AWQ/GPTQ compensate errors: no round-to-nearest bound to hold
        if bound is None or str(folder.relative_to(ROOT)) in NO_ORIGINAL:
            continue
        assert bool(((values - original[group.dequantized_key].float()).abs() <= bound).all()), group.module
