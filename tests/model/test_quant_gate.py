"""verify without --model: the model-free gate (CRCs, NaN/Inf, every quantized group intact), and --original:
each dequantized weight against the unquantized one, within the scheme's step bound."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import ModelSpecError
from tests.fp8_releases import original, quantized, release

torch = pytest.importorskip("torch")
save_file = pytest.importorskip("safetensors.torch").save_file


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def drop(sd: dict[str, Any]) -> None:
        del sd[key]

    return drop


def _set(key: str, make: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda sd: sd.__setitem__(key, make(sd[key]))


#: each broken variant of the intact release, and the module its failure names
BROKEN: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "scale dropped": (_drop("layers.0.proj.weight_scale_inv"), "layers.0.proj"),
    "orphan scale": (_drop("layers.1.proj.weight"), "layers.1.proj"),
    "wrong grid": (_set("layers.0.proj.weight_scale_inv", lambda s: s[:1].contiguous()), "layers.0.proj"),
    "scale not finite": (_set("layers.1.proj.weight_scale_inv", lambda s: s.index_fill(1, torch.tensor([0]),
                                                                                        float("nan"))), "layers.1.proj"),
    "scale not positive": (_set("layers.1.proj.weight_scale_inv", lambda s: -s), "layers.1.proj"),
    "plain NaN": (_set("norm.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))), "norm.weight"),
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The original (``original.safetensors``), the intact release, each broken variant, and one whose
    ``layers.1.proj`` scales are 4× off (a scale mis-applied): each a save_pretrained directory."""
    root = tmp_path_factory.mktemp("fp8")
    orig = original()
    save_file(orig, str(root / "original.safetensors"))
    out = {"original": root / "original.safetensors", "intact": release(root / "intact", quantized(orig))}
    for name, (breaks, _) in BROKEN.items():
        sd = quantized(orig)
        breaks(sd)
        out[name] = release(root / name.replace(" ", "_"), sd)
    off = quantized(orig)
    off["layers.1.proj.weight_scale_inv"] = off["layers.1.proj.weight_scale_inv"] * 4
    out["scale 4x"] = release(root / "scale_4x", off)
    return out


def _verify(cli_runner: Any, *args: Any, code: int) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["verify", *map(str, args), "--json", "--quiet"])
    assert res.exit_code == code, res.output
    report: dict[str, Any] = json.loads(res.stdout)
    return report


def test_an_intact_release_passes_without_a_model(releases: dict[str, Path], cli_runner: Any) -> None:
    report = _verify(cli_runner, releases["intact"], code=0)
    assert report["model"] is None and report["ok"] is True and report["failures"] == []
    assert report["quantization"]["groups"] == 2 and report["quantization"]["schemes"] == {"fp8-block": 2}
    assert report["nonfinite"] == [] and report["sha256"]
    text = cli_runner.invoke(cli, ["verify", str(releases["intact"]), "--quiet"])
    assert text.exit_code == 0 and text.stdout.startswith("VERIFIED: ") and "(no model" in text.stdout
    assert "quantized: 2 groups (fp8-block 2)" in text.stdout


@pytest.mark.parametrize("variant", list(BROKEN))
def test_each_broken_variant_fails_naming_its_module(variant: str, releases: dict[str, Path], cli_runner: Any) -> None:
    report = _verify(cli_runner, releases[variant], code=3)
    module = BROKEN[variant][1]
    assert report["ok"] is False and any(module in line for line in report["failures"]), report["failures"]
    intact = {"layers.0.proj", "layers.1.proj"} - {module}
    assert not any(f"quantized {m}:" in line for m in intact for line in report["failures"]), report["failures"]


def test_the_original_compares_each_dequantized_weight(releases: dict[str, Path], cli_runner: Any) -> None:
    report = _verify(cli_runner, releases["intact"], "--original", releases["original"], code=0)
    rows = {r["key"]: r for r in report["quantization"]["original"]["tensors"]}
    assert set(rows) == {"layers.0.proj.weight", "layers.1.proj.weight"}
    for r in rows.values():
        assert r["ok"] is True and r["tolerance"] == "step bound" and r["scheme"] == "fp8-block"
        assert 0 < r["mean_abs_diff"] <= r["max_abs_diff"] and 0 < r["rel_error"] < 0.1
    text = cli_runner.invoke(cli, ["verify", str(releases["intact"]), "--original", str(releases["original"]), "--quiet"])
    assert "against the original" in text.stdout and "layers.0.proj.weight (fp8-block): " in text.stdout


def test_a_scale_off_by_4x_fails_against_the_original(releases: dict[str, Path], cli_runner: Any) -> None:
    plain = _verify(cli_runner, releases["scale 4x"], code=0)  # intact in itself: only the original tells
    assert plain["ok"] is True
    report = _verify(cli_runner, releases["scale 4x"], "--original", releases["original"], code=3)
    assert [line.split(":")[0] for line in report["failures"]] == ["quantized layers.1.proj (fp8-block)"]
    rows = {r["key"]: r for r in report["quantization"]["original"]["tensors"]}
    assert rows["layers.1.proj.weight"]["ok"] is False and rows["layers.0.proj.weight"]["ok"] is True
    assert rows["layers.1.proj.weight"]["rel_error"] == pytest.approx(3.0, rel=0.05)


def test_a_tolerance_judges_instead_of_the_step_bound(releases: dict[str, Path], cli_runner: Any) -> None:
    report = _verify(cli_runner, releases["scale 4x"], "--original", releases["original"], "--atol", "100", code=0)
    assert {r["tolerance"] for r in report["quantization"]["original"]["tensors"]} == {"atol/rtol"}


@pytest.mark.parametrize("flag", [["--exact"], ["--reference", "{original}"], ["--dtype", "bf16"]])
def test_options_that_need_a_model_are_a_usage_error_without_one(flag: list[str], releases: dict[str, Path],
                                                                 cli_runner: Any) -> None:
    args = [a.format(original=releases["original"]) for a in flag]
    res = cli_runner.invoke(cli, ["verify", str(releases["intact"]), *args])
    assert res.exit_code == 2 and f"Error: {flag[0]} needs --model" in res.output
    with pytest.raises(ModelSpecError, match=f"needs a model: pass model="):
        ckptfix.verify(releases["intact"], None, **{"exact": True} if flag[0] == "--exact" else
                       {"reference": releases["original"]} if flag[0] == "--reference" else {"dtype": "bf16"})


def test_a_plain_file_passes_and_a_broken_crc_fails_without_a_model(fixtures_dir: Path, tmp_path: Path,
                                                                    cli_runner: Any) -> None:
    report = _verify(cli_runner, fixtures_dir / "mlp_ddp.pth", code=0)
    assert report["quantization"] is None and report["nonfinite"] == []
    data = bytearray((fixtures_dir / "mlp_ddp.pth").read_bytes())
    member = data.index(b"data/0") + 200  # a byte of the first storage's values
    data[member] ^= 0xFF
    (tmp_path / "flipped.pth").write_bytes(bytes(data))
    report = _verify(cli_runner, tmp_path / "flipped.pth", code=3)
    assert any("CRC-32" in line for line in report["failures"]), report["failures"]
