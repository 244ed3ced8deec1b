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
from tests import quant_files, quant_layouts
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


def _layout_release(where: Path, case: str, scale_by: float = 1.0,
                    breaks: Callable[[dict[str, Any]], None] | None = None) -> tuple[Path, Path]:
    """quant_layouts' ``case`` written as a release directory (its config as config.json or hf_quant_config.json)
    and its original beside it (``original.safetensors``); ``scale_by`` multiplies the group's ``scale``, ``breaks``
    changes the state dict."""
    built = quant_layouts.build(case)
    sd = dict(built.state_dict)
    if breaks is not None:
        breaks(sd)
    for key in [k for k in sd if scale_by != 1.0 and k.endswith((".scales", ".weight_scale"))]:
        sd[key] = sd[key] * scale_by
    where.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(where / "model.safetensors"))
    name = "hf_quant_config.json" if built.config and "quantization" in built.config else "config.json"
    (where / name).write_text(json.dumps(built.config))
    orig = {m if any(k.startswith(m + "_blocks") for k in sd) else f"{m}.weight": w.contiguous()
            for m, w in built.originals.items()}
    save_file(orig, str(where / "original.safetensors"))
    return where / "model.safetensors", where / "original.safetensors"


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
    text = cli_runner.invoke(cli, ["verify", str(releases["intact"]), "--original", str(releases["original"])])
    assert "against the original" in text.stdout and "layers.0.proj.weight (fp8-block): " in text.stdout
    phases = [line.split(": ")[1].split(" (")[0] for line in text.stderr.splitlines()]
    assert phases == ["read", "values", "quantized", "original"]  # a line per phase, as the gate's (no hash: text)


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


@pytest.mark.parametrize("flag, keyword", [
    (["--exact"], {"exact": True}), (["--reference", "{original}"], {"reference": "{original}"}),
    (["--dtype", "bf16"], {"dtype": "bf16"}), (["--input-shape", "1,4"], {"inputs": {"x": "a tensor"}}),
], ids=["exact", "reference", "dtype", "input"])
def test_options_that_need_a_model_are_a_usage_error_without_one(flag: list[str], keyword: dict[str, Any],
                                                                 releases: dict[str, Path], cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["verify", str(releases["intact"]), *(a.format(original=releases["original"])
                                                                       for a in flag)])
    assert res.exit_code == 2 and f"Error: {flag[0]} needs --model" in res.output
    with pytest.raises(ModelSpecError, match="needs a model: pass model="):
        ckptfix.verify(releases["intact"], None, **{k: v.format(original=releases["original"]) if isinstance(v, str)
                                                    else {"x": torch.ones(2, 3)} for k, v in keyword.items()})


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


@pytest.mark.parametrize("case", list(quant_layouts.CASES))
def test_every_scheme_s_release_passes_against_its_original(case: str, tmp_path: Path, cli_runner: Any) -> None:
    path, orig = _layout_release(tmp_path / "release", case)
    report = _verify(cli_runner, path, "--original", orig, code=0)
    (row,) = report["quantization"]["original"]["tensors"]
    assert row["scheme"] == quant_layouts.CASES[case][1]
    rtn = row["scheme"] not in ("gptq", "gptq-v2", "awq")
    assert (row["ok"], row["tolerance"]) == ((True, "step bound") if rtn else (None, "reported")), row


MX = "model.layers.0.mlp.experts.gate_up_proj"
#: broken variants of other schemes' releases: (case, how it breaks, the module named)
BROKEN_LAYOUTS = {
    "0xFF E8M0": ("mxfp4", _set(f"{MX}_scales", lambda s: s.index_fill(0, torch.tensor([1]), 0xFF)), MX),
    "short packed weight": ("ct-nvfp4", _set(f"{quant_layouts.MODULE}.weight_packed", lambda w: w[:, :-1].contiguous()),
                            quant_layouts.MODULE),
    "GPTQ qzeros dropped": ("gptq", _drop(f"{quant_layouts.MODULE}.qzeros"), quant_layouts.MODULE),
}


@pytest.mark.parametrize("variant", list(BROKEN_LAYOUTS))
def test_broken_variants_of_other_schemes_fail_naming_the_module(variant: str, tmp_path: Path, cli_runner: Any) -> None:
    case, breaks, module = BROKEN_LAYOUTS[variant]
    path, _ = _layout_release(tmp_path / "release", case, breaks=breaks)
    report = _verify(cli_runner, path, code=3)
    assert report["failures"] and all(line.startswith(f"quantized {module}") for line in report["failures"]), report


def test_an_error_compensating_scheme_is_reported_not_failed_unless_a_tolerance_is_given(tmp_path: Path,
                                                                                          cli_runner: Any) -> None:
    """GPTQ's scales 4× off: far beyond any round-to-nearest bound, but GPTQ has none: reported, exit 0."""
    path, orig = _layout_release(tmp_path / "gptq", "gptq", scale_by=4.0)
    report = _verify(cli_runner, path, "--original", orig, code=0)
    (row,) = report["quantization"]["original"]["tensors"]
    assert row["ok"] is None and row["rel_error"] > 1 and any("reported, not judged" in n for n in report["notes"])
    judged = _verify(cli_runner, path, "--original", orig, "--rtol", "0.5", code=3)
    assert judged["failures"][0].startswith("quantized model.layers.0.mlp.down_proj (gptq): ")


#: every real file (torchao's pickled subclasses too), each with the weights it is compared with: its bf16 original,
#: or for gpt-oss MXFP4 (no CPU quantizer made it: written per gpt-oss's layout) transformers' dequantization of it
REAL = [(f, f.reference if f.name.startswith("mxfp4/") else f.original) for f in quant_files.files()]


@pytest.mark.parametrize("real", REAL, ids=lambda r: r[0].name)
def test_real_releases_pass_against_their_original(real: tuple[Any, Path], cli_runner: Any) -> None:
    """Files the publishing libraries wrote (fixtures/quant/MANIFEST.json), against the model they were made from."""
    qfile, orig = real
    report = _verify(cli_runner, qfile.path, "--original", orig, code=0)
    rows = report["quantization"]["original"]["tensors"]
    judged = (None, "reported") if qfile.library in ("autoawq", "gptqmodel") else (True, "step bound")
    assert rows and all((r["ok"], r["tolerance"]) == judged for r in rows), rows
    assert all(r["rel_error"] < 0.2 for r in rows), rows  # 4-bit's error, not a scale lost
