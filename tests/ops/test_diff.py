"""diff: a converted file equals its original; a perturbed one differs, by exactly the perturbation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.ops.diff import tensor_diff


@pytest.mark.parametrize("mode", ["ddp", "compile_ddp", "train_ckpt", "legacy", "model_parallel"])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_converted_equals_original(cli_runner, fixtures_dir: Path, tmp_path: Path, train, mode: str, fmt: str) -> None:
    src = fixtures_dir / train.fixture_name("mlp", mode)
    dst = tmp_path / f"out.{fmt}"
    ckptfix.convert(src, dst)
    res = cli_runner.invoke(cli, ["diff", str(src), str(dst), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["identical"] is True and report["counts"]["equal"] == report["counts"]["common"] == 6
    assert set(report["max_abs_diff"].values()) == {0.0}


def _perturbed(fixtures_dir: Path, tmp_path: Path) -> Path:
    sd = ckptfix.load(fixtures_dir / "mlp_single.pth")
    sd["2.weight"][3, 5] += 0.5
    torch.save(sd, tmp_path / "perturbed.pth")
    return tmp_path / "perturbed.pth"


def test_perturbed_differs(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    original = fixtures_dir / "mlp_ddp_compile.pth"
    ref = ckptfix.load(original)["2.weight"][3, 5]
    perturbed = _perturbed(fixtures_dir, tmp_path)
    res = cli_runner.invoke(cli, ["diff", str(fixtures_dir / "mlp_single.pth"), str(perturbed), "--json"])
    assert res.exit_code == 3
    report = json.loads(res.stdout)
    assert report["value_mismatch"] == [{"key": "2.weight", "max_abs_diff": 0.5}]
    assert report["counts"] == {"common": 6, "equal": 5, "values": 1, "shape": 0, "dtype": 0, "only_a": 0, "only_b": 0}
    assert ref.item() != 0  # the perturbed element is a real trained weight
    within = cli_runner.invoke(cli, ["diff", str(fixtures_dir / "mlp_single.pth"), str(perturbed), "--atol", "0.5"])
    assert within.exit_code == 0 and within.output.startswith("identical: ")
    text = cli_runner.invoke(cli, ["diff", str(fixtures_dir / "mlp_single.pth"), str(perturbed)]).output
    assert "values differ (1), largest first:\n    2.weight: max abs diff 0.5" in text


def test_raw_keeps_wrapper_segments(cli_runner, fixtures_dir: Path) -> None:
    args = [str(fixtures_dir / "mlp_dp.pth"), str(fixtures_dir / "mlp_single.pth")]
    assert cli_runner.invoke(cli, ["diff", *args]).exit_code == 0  # DP on CPU trains exactly like single
    res = cli_runner.invoke(cli, ["diff", *args, "--raw", "--json"])
    assert res.exit_code == 3
    report = json.loads(res.stdout)
    assert report["only_a"] == [f"module.{k}" for k in report["only_b"]] and len(report["only_b"]) == 6


def test_dtype_and_shape_differences(fixtures_dir: Path, tmp_path: Path) -> None:
    report = ckptfix.diff(fixtures_dir / "mlp_single.pth", fixtures_dir / "mlp_amp.pth")
    assert not report.identical and len(report.dtype_mismatch) == 6
    assert report.dtype_mismatch[0] == {"key": "0.weight", "a": "float32", "b": "float16"}
    sd = ckptfix.load(fixtures_dir / "mlp_single.pth")
    sd["4.bias"] = torch.zeros(2)
    sd["extra"] = torch.zeros(1)
    torch.save(sd, tmp_path / "reshaped.pth")
    report = ckptfix.diff(fixtures_dir / "mlp_single.pth", tmp_path / "reshaped.pth")
    assert report.shape_mismatch == [{"key": "4.bias", "a": [1], "b": [2]}] and report.only_b == ["extra"]


def test_tensor_diff_nan_inf_and_tolerance() -> None:
    a = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert tensor_diff(a, a.clone()) == (0.0, True)  # NaN equals NaN, inf equals inf
    b = torch.tensor([1.0, 0.0, float("inf"), 2.0])
    assert tensor_diff(a, b) == (float("inf"), False)
    c = torch.tensor([1.0, float("nan"), float("inf"), 2.25])
    assert tensor_diff(a, c) == (0.25, False) and tensor_diff(a, c, atol=0.25) == (0.25, True)
    assert tensor_diff(a, c, rtol=0.125) == (0.25, True)
    big = torch.tensor([2**62 + 1], dtype=torch.int64)
    assert tensor_diff(big, big - 1)[1] is False  # not lost to float64 rounding when exact


def test_meta_is_refused(fixtures_dir: Path) -> None:
    with pytest.raises(ckptfix.CkptfixError, match="map_location='meta' reads none"):
        ckptfix.diff(fixtures_dir / "mlp_single.pth", fixtures_dir / "mlp_dp.pth", map_location="meta")


def test_subprocess_exit_codes(fixtures_dir: Path, tmp_path: Path) -> None:
    exe = str(Path(sys.executable).with_name("ckptfix"))
    perturbed = _perturbed(fixtures_dir, tmp_path)
    res = subprocess.run([exe, "diff", str(fixtures_dir / "mlp_single.pth"), str(perturbed)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 3 and res.stdout.startswith("DIFFER: ") and res.stderr == ""
    res = subprocess.run([exe, "diff", str(fixtures_dir / "mlp_single.pth"), str(tmp_path / "none.pth")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().endswith("none.pth: no such file")


def _non_strided(kind: str, scale: float = 1.0) -> torch.Tensor:
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4) * scale
    if kind == "quantized":
        return torch.quantize_per_tensor(x, 0.5, 0, torch.qint8)
    if kind == "nested":
        return torch.nested.nested_tensor([x[:2], x[:3]])
    return {"coo": x.to_sparse(), "csr": x.to_sparse_csr(), "csc": x.to_sparse_csc(),
            "bsr": x.to_sparse_bsr((2, 2)), "bsc": x.to_sparse_bsc((2, 2))}[kind]


@pytest.mark.parametrize("kind", ["coo", "csr", "csc", "bsr", "bsc", "quantized", "nested"])
def test_sparse_nested_and_quantized_tensors_are_compared_by_value(cli_runner, tmp_path: Path, kind: str) -> None:
    """torch.equal takes strided tensors only (it raised here, 'a bug in ckptfix'): such tensors are compared by the
    values they stand for; a changed value differs, exit 3."""
    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        torch.save({"w": _non_strided(kind, scale), "bias": torch.ones(2)}, tmp_path / f"{name}.pth")
    same = cli_runner.invoke(cli, ["diff", str(tmp_path / "a.pth"), str(tmp_path / "b.pth")])
    assert same.exit_code == 0 and same.output.startswith("identical: "), same.output
    other = cli_runner.invoke(cli, ["diff", str(tmp_path / "a.pth"), str(tmp_path / "c.pth"), "--json"])
    assert other.exit_code == 3, other.output
    assert [row["key"] for row in json.loads(other.stdout)["value_mismatch"]] == ["w"]
