"""``ckptfix inspect`` names each quantized group's scheme, counts them, and flags what is broken, from files
written as each publisher writes them (safetensors, the config beside them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.cli import cli
from tests import quant_layouts as ql

CASES = sorted(ql.CASES)


def _write(folder: Path, sd: dict[str, torch.Tensor], config: dict[str, Any] | None) -> Path:
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors")
    if config is not None:
        name = "hf_quant_config.json" if "quantization" in config else "config.json"
        (folder / name).write_text(json.dumps(config))
    return folder / "model.safetensors"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ql.Built]]:
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for case in CASES:
        b = ql.build(case)
        out[case] = (_write(root / case, b.state_dict, b.config), b)
    return out


def _inspect(cli_runner: Any, path: Path) -> tuple[dict[str, Any], str]:
    res = cli_runner.invoke(cli, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    text = cli_runner.invoke(cli, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    return json.loads(res.output), text.output


@pytest.mark.parametrize("case", CASES)
def test_inspect_names_the_scheme(cli_runner: Any, written: dict[str, tuple[Path, ql.Built]], case: str) -> None:
    path, b = written[case]
    info, text = _inspect(cli_runner, path)
    scheme = ql.CASES[case][1]
    q = info["quantization"]
    assert q["schemes"] == {scheme: 1} and q["problems"] == [] and q["unknown"] == []
    [group] = q["groups"]
    assert group["module"] == next(iter(b.originals)) and group["scheme"] == scheme
    assert set(group["companions"].values()) | {group["weight"]} <= set(b.state_dict)
    method = ql.quant_method(b.config)
    assert q["quant_method"] == method
    assert f"quantization:   {scheme} ×1 ({method} by its config)\n" in text
    assert "problem:" not in text
    weight_row = next(line for line in text.splitlines() if line.startswith(f"  {group['weight']} "))
    assert weight_row.endswith(f"  ({scheme} weight)")  # the key listing tags each group's tensors


@pytest.mark.parametrize("case", ["fp8-block", "mxfp4", "ct-nvfp4", "gptq", "bnb-nf4"])
@pytest.mark.parametrize("broken", ["scale dropped", "orphan scale"])
def test_inspect_flags_what_is_broken(cli_runner: Any, tmp_path: Path, written: dict[str, tuple[Path, ql.Built]],
                                      case: str, broken: str) -> None:
    _path, b = written[case]
    module = next(iter(b.originals))
    weight = next(k for k in b.state_dict if k.startswith(module) and k.endswith(("weight", "_blocks", "_packed")))
    scale = next(k for k in b.state_dict if k.startswith(module) and k.endswith(("scale_inv", "_scales", "weight_scale",
                                                                                 ".scales", ".absmax")))
    sd = {k: v for k, v in b.state_dict.items() if k != (scale if broken == "scale dropped" else weight)}
    info, text = _inspect(cli_runner, _write(tmp_path / "broken", sd, b.config))
    problems = info["quantization"]["problems"]
    assert problems and {p["module"] for p in problems} == {module}
    assert {p["kind"] for p in problems} == ({"missing"} if broken == "scale dropped" else {"orphan"})
    assert f"  problem: {module}: " in text and "problem" in text.split("quantization:")[1].split("\n")[0]


def test_inspect_of_plain_weights_has_no_quantization(cli_runner: Any, tmp_path: Path) -> None:
    info, text = _inspect(cli_runner, _write(tmp_path / "plain", {"fc.weight": torch.ones(2, 2)}, None))
    assert "quantization" not in info and "quantization:" not in text


def test_the_config_decides_between_look_alikes(cli_runner: Any, tmp_path: Path,
                                                written: dict[str, tuple[Path, ql.Built]]) -> None:
    """GPTQ v2 is told from v1 only by its config's checkpoint_format: without one, the group is named v1 and the
    ambiguity flagged."""
    _path, b = written["gptq-v2"]
    info, _text = _inspect(cli_runner, _write(tmp_path / "bare", b.state_dict, None))
    assert info["quantization"]["schemes"] == {"gptq": 1}
    assert [p["kind"] for p in info["quantization"]["problems"]] == ["ambiguous"]
    assert info["quantization"]["quant_method"] is None
