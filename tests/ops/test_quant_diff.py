"""diff of a quantized release against its original compares after dequantization, in either order: per-tensor
max, mean and relative error; within the scheme's step bound (a scale off by 4× fails), or --atol/--rtol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptfix.cli import cli
from tests import quant_files
from tests.fp8_releases import original, quantized, release

torch = pytest.importorskip("torch")
save_file = pytest.importorskip("safetensors.torch").save_file


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8diff")
    orig = original()
    save_file(orig, str(root / "original.safetensors"))
    off = quantized(orig)
    off["layers.1.proj.weight_scale_inv"] = off["layers.1.proj.weight_scale_inv"] * 4
    return {"original": root / "original.safetensors", "intact": release(root / "intact", quantized(orig)),
            "scale 4x": release(root / "scale_4x", off)}


def _diff(cli_runner: Any, a: Path, b: Path, *extra: str, code: int) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["diff", str(a), str(b), "--json", *extra])
    assert res.exit_code == code, res.output
    report: dict[str, Any] = json.loads(res.stdout)
    return report


@pytest.mark.parametrize("order", ["release first", "original first"])
def test_a_release_and_its_original_compare_after_dequantization(order: str, files: dict[str, Path],
                                                                 cli_runner: Any) -> None:
    a, b = (files["intact"], files["original"]) if order == "release first" else (files["original"], files["intact"])
    report = _diff(cli_runner, a, b, code=0)
    rows = {r["key"]: r for r in report["dequantized"]}
    assert set(rows) == {"layers.0.proj.weight", "layers.1.proj.weight"}
    for r in rows.values():
        assert set(r) >= {"max_abs_diff", "mean_abs_diff", "rel_error", "scheme", "module", "tolerance", "ok"}
        assert r["ok"] is True and r["tolerance"] == "step bound" and 0 < r["mean_abs_diff"] <= r["max_abs_diff"]
        assert report["max_abs_diff"][r["key"]] == r["max_abs_diff"]
    assert report["only_a"] == report["only_b"] == [] and report["value_mismatch"] == []
    assert report["counts"]["common"] == 1 and report["counts"]["equal"] == 1  # norm.weight, as stored
    text = cli_runner.invoke(cli, ["diff", str(a), str(b)])
    assert text.stdout.startswith("within bounds: ") and "dequantized (2)" in text.stdout


def test_a_scale_off_by_4x_differs(files: dict[str, Path], cli_runner: Any) -> None:
    report = _diff(cli_runner, files["scale 4x"], files["original"], code=3)
    assert [r["key"] for r in report["value_mismatch"]] == ["layers.1.proj.weight"]
    rows = {r["key"]: r for r in report["dequantized"]}
    assert rows["layers.1.proj.weight"]["ok"] is False and rows["layers.1.proj.weight"]["rel_error"] > 2
    loose = _diff(cli_runner, files["scale 4x"], files["original"], "--rtol", "5", code=0)
    assert {r["tolerance"] for r in loose["dequantized"]} == {"atol/rtol"}
    tight = _diff(cli_runner, files["intact"], files["original"], "--atol", "1e-9", code=3)
    assert len(tight["value_mismatch"]) == 2


def test_two_quantized_files_compare_as_stored(files: dict[str, Path], cli_runner: Any) -> None:
    report = _diff(cli_runner, files["intact"], files["scale 4x"], code=3)
    assert report["dequantized"] == []
    assert [r["key"] for r in report["value_mismatch"]] == ["layers.1.proj.weight_scale_inv"]


@pytest.mark.parametrize("name", ["llmcompressor/nvfp4a16/model.safetensors", "bitsandbytes/nf4/model.safetensors"])
def test_a_real_release_against_its_original(name: str, cli_runner: Any) -> None:
    (qfile,) = [f for f in quant_files.files() if f.name == name]
    report = _diff(cli_runner, qfile.original, qfile.path, code=0)
    assert len(report["dequantized"]) == 7 and all(r["ok"] is True for r in report["dequantized"])
    assert report["only_a"] == report["only_b"] == [] and report["counts"]["equal"] == report["counts"]["common"] > 0


def test_a_broken_group_compares_as_stored(files: dict[str, Path], tmp_path: Path, cli_runner: Any) -> None:
    """A scale grid of the wrong shape is not dequantized: its weight differs as stored, its scale is on one side."""
    sd = quantized(original())
    sd["layers.0.proj.weight_scale_inv"] = sd["layers.0.proj.weight_scale_inv"][:1].contiguous()
    broken = release(tmp_path / "broken", sd)
    report = _diff(cli_runner, broken, files["original"], code=3)
    assert [r["key"] for r in report["dequantized"]] == ["layers.1.proj.weight"]
    assert report["only_a"] == ["layers.0.proj.weight_scale_inv"]
    assert [r["key"] for r in report["dtype_mismatch"]] == ["layers.0.proj.weight"]
