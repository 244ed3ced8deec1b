"""torchao 0.18's pickled tensor subclasses (the committed files torch.save wrote, fixtures/quant/torchao/) are read
statically, without --trust and without importing torchao: each weight becomes its inner tensors under torchao's
flattened names, bit-equal to what torchao held; anything else in the subclass's rebuild is refused; and the gate
says that the serving process needs torchao."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import UnsafeCheckpointError
from ckptfix.safety.allowlist import classify
from ckptfix.safety.subclasses import flat_name
from tests import adversarial, quant_files

PICKLED = quant_files.files("torchao", ".pt")
ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so float8 compares bit for bit (and -0.0 differs from 0.0)."""
    return t.contiguous().view(torch.uint8)


def test_the_committed_files_are_there() -> None:
    assert {qf.extra["config"] for qf in PICKLED} == {"Int8WeightOnlyConfig", "Float8WeightOnlyConfig",
                                                      "Int4WeightOnlyConfig"}


@pytest.fixture(scope="module", params=PICKLED, ids=lambda qf: qf.name)
def pickled(request: pytest.FixtureRequest) -> tuple[quant_files.QuantFile, dict]:
    qf = request.param
    return qf, ckptfix.read(qf.path).state_dict


def test_read_gives_inner_tensors_bit_equal_without_torchao(pickled: tuple) -> None:
    qf, state = pickled
    inner = quant_files.tensors(qf.path.parent / Path(qf.extra["inner"]).name)
    weights = {k.rpartition(".")[0].rpartition(".")[0] for k in inner}  # 'a.weight.qdata' → 'a'
    assert len(weights) == 7 and "torchao" not in sys.modules
    for key, value in inner.items():
        weight, _, attr = key.rpartition(".")
        got = state[flat_name(weight, attr)]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(_bits(got), _bits(value)), key
    plain = {k for k in state if not any(k.startswith(f"{w}._weight_") for w in weights)}
    assert plain == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"}
    assert all(state[k].dtype == torch.bfloat16 for k in plain)
    assert len(state) == len(plain) + len(inner)


#: each class's down_proj ([128, 192]) as stored: qdata, scale; and the scheme inspect names
STORED = {"Int8Tensor": ("int8", [128, 192], "float32", [128, 1], "torchao-int8"),
          "Float8Tensor": ("float8_e4m3fn", [128, 192], "float32", [128, 1], "torchao-float8"),
          "Int4Tensor": ("int8", [128, 96], "bfloat16", [3, 128], "torchao-int4")}  # two values a byte; [in/64, out]


@pytest.mark.parametrize("qf", PICKLED, ids=lambda qf: qf.name)
def test_inspect_and_scan_without_trust(cli_runner, qf: quant_files.QuantFile) -> None:
    res = cli_runner.invoke(cli, ["inspect", str(qf.path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    keys = {t["key"]: (t["dtype"], t["shape"]) for t in report["keys"]}
    cls = qf.extra["config"].replace("WeightOnlyConfig", "Tensor")  # Int8Tensor, Float8Tensor, Int4Tensor
    assert any(n.startswith(f"7 torchao {cls} (model.layers.0.self_attn.q_proj.weight") and "torchao not imported"
               in n for n in report["notes"]), report["notes"]
    qdata, qshape, sdtype, sshape, scheme = STORED[cls]
    assert keys["model.layers.0.mlp.down_proj._weight_qdata"] == (qdata, qshape)
    assert keys["model.layers.0.mlp.down_proj._weight_scale"] == (sdtype, sshape)
    assert report["quantization"]["schemes"] == {scheme: 7} and report["quantization"]["problems"] == []
    scan = cli_runner.invoke(cli, ["scan", str(qf.path)])
    assert scan.exit_code == 0, scan.output
    assert "allowed  torchao.quantization." in scan.output


def test_wrapper_rebuild_is_torch_safe_and_the_classes_allowed() -> None:
    assert classify("torch._utils", "_rebuild_wrapper_subclass") == "safe"
    assert classify("torchao.quantization", "Int8Tensor") == "allowed"
    assert classify("torchao.quantization", "Int8TensorX") == "unsafe"


@pytest.mark.parametrize("cls", ["Int8Tensor", "Int4Tensor"])
def test_the_gate_says_the_server_needs_torchao(cls: str) -> None:
    qf = next(qf for qf in PICKLED if qf.extra["config"] == cls.replace("Tensor", "WeightOnlyConfig"))
    report = ckptfix.verify(qf.path, MLP_SPEC, exact=True, forward=False)
    failure = next(f for f in report.failures if "the serving loader failed" in f)
    assert f"torchao.quantization.{cls}" in failure and "`import torchao`" in failure


INT4 = next(qf for qf in PICKLED if qf.extra["config"] == "Int4WeightOnlyConfig")
DOWN = "model.layers.0.mlp.down_proj"
#: the Int4Tensor file read by ckptfix and broken: how, and what the gate says of down_proj
INT4_BROKEN = {"intact": (lambda sd: None, None),
               "zero point dropped": (lambda sd: sd.pop(f"{DOWN}._weight_zero_point"), "without its bfloat16 _weight_zero_point"),
               "scale grid cut": (lambda sd: sd.__setitem__(f"{DOWN}._weight_scale", sd[f"{DOWN}._weight_scale"][:2].clone()),
                                  "zero_point shape [3, 128] is not [2, 128]"),
               "scale not positive": (lambda sd: sd.__setitem__(f"{DOWN}._weight_scale", -sd[f"{DOWN}._weight_scale"]),
                                      "zero or negative")}


@pytest.mark.parametrize("variant", list(INT4_BROKEN))
def test_the_int4_file_passes_the_model_free_gate_and_its_broken_variants_fail(variant: str, tmp_path: Path,
                                                                              cli_runner) -> None:
    """verify without a model: torchao's Int4Tensor file passes as written (pickled) and, read by ckptfix and
    written flattened, fails once a group is broken, naming the module."""
    breaks, why = INT4_BROKEN[variant]
    path = INT4.path
    if why is not None:
        state = dict(ckptfix.read(INT4.path).state_dict)
        breaks(state)
        path = tmp_path / "broken.safetensors"
        save_file({k: v.clone() for k, v in state.items()}, str(path))  # (lm_head is tied to the embedding)
    res = cli_runner.invoke(cli, ["verify", str(path), "--json", "--quiet"])
    assert res.exit_code == (0 if why is None else 3), res.output
    failures = json.loads(res.stdout)["failures"]
    assert (failures == []) if why is None else (len(failures) == 1 and failures[0].startswith(f"quantized {DOWN}")
                                                 and why in failures[0]), failures


# -- what else the rebuild could name: refused, statically and when loading -------------------------------------

_INT8 = ("torchao.quantization", "Int8Tensor")
_G = adversarial.glob


def _wrapper_args(cls: bytes) -> bytes:
    layout = adversarial.call(_G("torch.serialization", "_get_layout"), adversarial.u("torch.strided"))
    device = adversarial.call(_G("torch", "device"), adversarial.u("cpu"))
    return adversarial.tup(cls, _G("torch", "float32"), adversarial.tup(b"K\x02"), adversarial.tup(b"K\x01"),
                           b"K\x00", layout, device, b"\x89")


def _from_type(func: bytes, cls: bytes, args_cls: bytes | None = None, state: bytes = b"}") -> bytes:
    return adversarial.call(_G("torch._tensor", "_rebuild_from_type_v2"), func, cls,
                            _wrapper_args(args_cls or cls), state)


_WRAPPER = _G("torch._utils", "_rebuild_wrapper_subclass")
HOSTILE = {
    "a class outside the list": (_from_type(_WRAPPER, _G("evil", "Tensor")), "evil.Tensor|only plain tensors"),
    "torch's own Tensor": (adversarial.call(_WRAPPER, *[_wrapper_args(_G("torch", "Tensor"))[1:-1]]),
                           "quantized tensor classes"),
    "another rebuild function": (_from_type(_G("torch._utils", "_rebuild_tensor_v2"), _G(*_INT8)),
                                 "wrapper-subclass rebuild|_rebuild_tensor_v2"),
    "a class called": (adversarial.call(_G(*_INT8), b"K\x01"), "wrapper-subclass rebuild"),
    "an enum called oddly": (adversarial.call(_G("torchao.quantization.quant_primitives", "MappingType"),
                                              b"K\x01", b"K\x02"), "enum"),
    "a dunder in the state": (_from_type(_WRAPPER, _G(*_INT8), state=b"}" + adversarial.u("__class__") + b"K\x01s"),
                              "attribute names|__class__"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_rebuilds_are_refused(tmp_path: Path, case: str) -> None:
    data, why = HOSTILE[case]
    path = tmp_path / "x.pth"
    adversarial.write_zip(path, adversarial.with_data_pkl(adversarial.as_weight(data)))
    with pytest.raises(UnsafeCheckpointError, match=why):
        ckptfix.read(path)
