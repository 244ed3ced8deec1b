"""fixtures/quant/ holds what its MANIFEST.json says: every file and reference there, each under 1 MiB and all under
9.5 MiB, and each reference the library's dequantization of the committed original (within the scheme's coarse
step: a reference of other weights, or a lost scale, is far off)."""

from __future__ import annotations

import pytest
import torch

from tests import quant_files

FILES = quant_files.files()
#: the largest relative error (max |ref - original| / max |original|) each scheme's step allows here, with margin
_BOUND = {"fp8": 0.07, "float8": 0.07, "int8": 0.02, "int4": 0.15, "w4a16": 0.15, "nf4": 0.2, "fp4": 0.25,
          "gemm": 0.15, "gptq": 0.15}


def test_the_manifest_lists_every_checkpoint_and_the_folder_stays_small() -> None:
    assert {qf.library for qf in FILES} == {"llmcompressor", "nvidia-modelopt", "bitsandbytes", "torchao",
                                           "transformers", "autoawq", "gptqmodel"}
    listed = {p for qf in FILES for p in (qf.path, qf.reference, *qf.companions) if p is not None}
    assert all(p.is_file() for p in listed)
    committed = [p for p in quant_files.QUANT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert max(p.stat().st_size for p in committed) < 1 << 20
    assert sum(p.stat().st_size for p in committed) < 19 << 19


def _bound(qf: quant_files.QuantFile) -> float:
    folder = qf.path.parent.relative_to(quant_files.QUANT).as_posix()
    return next(v for k, v in _BOUND.items() if k in folder)  # nvfp4, nvfp4a16: fp4's


@pytest.mark.parametrize("qf", [qf for qf in FILES if qf.library != "transformers"], ids=lambda qf: qf.name)
def test_each_reference_dequantizes_the_original(qf: quant_files.QuantFile) -> None:
    assert qf.reference is not None and qf.original is not None
    original, reference = quant_files.tensors(qf.original), quant_files.tensors(qf.reference)
    assert reference and all(k.endswith(".weight") and v.dtype == torch.float32 for k, v in reference.items())
    for key, ref in reference.items():
        want = original[key].float()
        assert ref.shape == want.shape, key
        assert (ref - want).abs().max() / want.abs().max() < _bound(qf), key
