"""What convert, load and load_into say and write around quantized groups (issue 28, item 4's remainder).

``ConvertReport.quantized`` and the text line, the config.json of a dequantized directory, and torchao's pickled
tensor subclasses (fixtures/quant/torchao/*/model.pt, written by torchao 0.18 itself): dequantized without ``trust``
and without torchao, equal to each subclass's own ``dequantize(torch.float32)`` (reference.safetensors), and ``--dtype``
refused for every output format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.units import human_size
from ckptfix.text import convert_text
from tests import quant_files, quant_layouts

ROOT = Path(__file__).resolve().parents[2]
SCHEME = "fp8-block"
PICKLED = {qf.name: qf for qf in quant_files.files("torchao", ".pt")}
FLATTENED = [qf for qf in quant_files.files("torchao", ".safetensors")]


def write_release(folder: Path, config: dict[str, Any]) -> Path:
    """A block-FP8 save_pretrained directory (one group, one plain float32 tensor) with ``config`` beside it."""
    built = quant_layouts.build(SCHEME)
    folder.mkdir(parents=True)
    save_file(built.state_dict, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, **(built.config or {})}))
    return folder


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("polish") / "release", {"architectures": ["Tiny"]})


@pytest.mark.parametrize("options, quantized, head", [
    ({}, None, ""),
    ({"dtype": "bf16"}, {"kept": {SCHEME: 1}, "dequantized": {}, "dtype": None, "dropped": 0, "unknown": []},
     " (cast from {nbytes_in})"),
    ({"dequantize": True}, {"kept": {}, "dequantized": {SCHEME: 1}, "dtype": "float32", "dropped": 1, "unknown": []},
     f" (dequantized 1 group ({SCHEME}) to float32, from {{nbytes_in}})"),
    ({"dequantize": True, "dtype": "bf16"},
     {"kept": {}, "dequantized": {SCHEME: 1}, "dtype": "bfloat16", "dropped": 1, "unknown": []},
     f" (dequantized 1 group ({SCHEME}) to bfloat16, from {{nbytes_in}})"),
])
def test_report_says_what_convert_did_to_groups(release: Path, options: dict[str, Any], quantized: dict | None,
                                                head: str, tmp_path: Path) -> None:
    """ConvertReport.quantized (absent from --json where no group was met) and the first text line: a dequantization
    says so instead of '(cast from …)', whose byte count it changed."""
    report = ckptfix.convert(release / "model.safetensors", tmp_path / "out.safetensors", **options)
    assert report.quantized == quantized
    assert ("quantized" in report.to_dict()) == (quantized is not None)
    first = convert_text(report).splitlines()[0]
    assert first == (f"Wrote {report.dst} (safetensors): {report.num_tensors} tensors, {human_size(report.nbytes)}"
                     + head.format(nbytes_in=human_size(report.nbytes_in)))


def test_json_docs_name_every_quantized_field(release: Path, tmp_path: Path, cli_runner: Any) -> None:
    """docs/json.md's convert paragraph names `quantized` and each of its fields, as --json prints them."""
    res = cli_runner.invoke(cli, ["convert", str(release), str(tmp_path / "o.safetensors"), "--dequantize", "--json"])
    assert res.exit_code == 0, res.output
    quantized = json.loads(res.output)["quantized"]
    paragraph = next(p for p in (ROOT / "docs" / "json.md").read_text().split("\n\n") if p.startswith("`convert`: "))
    missing = [k for k in ["quantized", *quantized] if not re.search(rf"`\{{?{k}`", paragraph)]
    assert not missing, missing


@pytest.mark.parametrize("config, dtype, want", [
    ({"torch_dtype": "bfloat16"}, None, {"torch_dtype": "bfloat16"}),
    ({"torch_dtype": "bfloat16"}, "fp32", {"torch_dtype": "float32"}),
    ({"dtype": "float16"}, "bf16", {"dtype": "bfloat16"}),  # transformers 5's name, kept as the only one
    ({"torch_dtype": "float16", "dtype": "float16"}, "fp32", {"torch_dtype": "float32", "dtype": "float32"}),
    ({}, None, {"torch_dtype": "float32"}),  # none named: the one transformers reads, the dtype written
])
def test_dequantized_directory_config_names_written_dtype(config: dict[str, Any], dtype: str | None,
                                                          want: dict[str, str], tmp_path: Path) -> None:
    """A dequantized directory's config.json: no quantization_config, torch_dtype/dtype the weights' dtype; a one-file
    output's note says to set it."""
    src = write_release(tmp_path / "release", {"architectures": ["Tiny"], **config})
    out = tmp_path / "out"
    report = ckptfix.convert(src, out, dequantize=True, dtype=dtype, max_shard_size="1GB")
    written = json.loads((out / "config.json").read_text())
    assert written == {"architectures": ["Tiny"], **want}
    weight = load_file(str(out / "model.safetensors"))[f"{quant_layouts.MODULE}.weight"]
    assert {str(weight.dtype).removeprefix("torch.")} == set(want.values())
    assert f"wrote config.json without quantization_config, {' and '.join(want)} {weight.dtype}".replace(
        "torch.", "") in report.notes
    one = ckptfix.convert(src, tmp_path / "one.safetensors", dequantize=True, dtype=dtype)
    assert any(f"set its torch_dtype to {str(weight.dtype).removeprefix('torch.')}" in n for n in one.notes), one.notes


def plain_model(shapes: dict[str, torch.Size]) -> nn.Module:
    """A module tree whose parameters are plain float32 tensors of ``shapes``, under their dotted keys."""
    root = nn.Module()
    for key, shape in shapes.items():
        *path, name = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    return root


def dequantized_by(how: str, src: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """``src`` dequantized by convert (into safetensors or .pth), load or load_into of a plain-float model."""
    if how == "load":
        return dict(ckptfix.load(src, dequantize=True))
    if how == "load_into":
        model = plain_model({k: v.shape for k, v in ckptfix.load(src, dequantize=True).items()})
        with pytest.raises(ckptfix.errors.LoadError, match="pass dequantize=True"):
            ckptfix.load_into(model, src)
        report = ckptfix.load_into(model, src, dequantize=True)
        assert any("dequantized 7 quantized groups" in n for n in report.notes), report.notes
        return model.state_dict()
    out = tmp_path / f"out.{how}"
    report = ckptfix.convert(src, out, dequantize=True)
    assert report.quantized is not None and sum(report.quantized["dequantized"].values()) == 7
    return load_file(str(out)) if how == "safetensors" else torch.load(out, weights_only=True)


@pytest.mark.parametrize("how", ["safetensors", "pth", "load", "load_into"])
@pytest.mark.parametrize("name", sorted(PICKLED))
def test_torchao_pickled_dequantized_as_torchao_does(name: str, how: str, tmp_path: Path) -> None:
    """torchao's pickled Int8Tensor / Float8Tensor, without trust and without torchao: each weight equals the
    subclass's own dequantize(torch.float32), bit for bit, its inner tensors gone."""
    qf = PICKLED[name]
    assert qf.reference is not None
    reference = quant_files.tensors(qf.reference)
    got = dequantized_by(how, qf.path, tmp_path)
    assert not any("_weight_" in k for k in got), sorted(got)
    for key, want in reference.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], want), key


@pytest.mark.parametrize("ext", [".safetensors", ".pth"])
@pytest.mark.parametrize("name", sorted(PICKLED))
def test_torchao_pickled_dtype_refused(name: str, ext: str, tmp_path: Path, cli_runner: Any) -> None:
    """--dtype alone on pickled subclasses: one Error line pointing at --dequantize, for every output format, nothing
    written; the same subclasses flattened into safetensors by transformers keep their groups as stored."""
    out = tmp_path / f"out{ext}"
    res = cli_runner.invoke(cli, ["convert", str(PICKLED[name].path), str(out), "--dtype", "bf16"])
    assert res.exit_code == 1 and not out.exists()
    (line,) = res.output.strip().splitlines()
    assert "torchao tensor subclass weight(s)" in line and line.endswith("pass --dequantize to write plain weights")


@pytest.mark.parametrize("qf", FLATTENED, ids=lambda qf: qf.name)
def test_torchao_flattened_dtype_keeps_groups(qf: quant_files.QuantFile, tmp_path: Path) -> None:
    """A torchao release flattened into safetensors is no pickle: --dtype keeps its groups as stored."""
    report = ckptfix.convert(qf.path, tmp_path / "out.safetensors", dtype="bf16")
    assert report.quantized is not None and report.quantized["kept"] == {"torchao-int8": 7}
