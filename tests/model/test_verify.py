"""verify: every fixture mode passes against its model; each kind of failure exits 3 with the right lists."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from torch import nn

import ckptfix
import ckptfix.ops.reading
from ckptfix.cli import cli
from ckptfix.model.spec import build_model
from ckptfix.safety import integrity
from tests.compare import golden_from_manifest

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"
RESNET = ["--model", "torchvision:resnet18", "--arg", "num_classes=10"]


@pytest.fixture(scope="session")
def resnet_dir(train: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every resnet18 fixture mode, trained once per session by fixtures/train.py (real DDP, compile, DP)."""
    out = tmp_path_factory.mktemp("resnet18")
    train.generate(out, model="resnet18", modes=train.MODES)
    return out


def _json(cli_runner: Any, args: list[str], code: int) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["verify", *args, "--json"])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


def _expected_fix(wrappers: list[str]) -> str | None:
    return f"strip {'.'.join(wrappers)}." if wrappers else None


def _assert_clean(report: dict[str, Any]) -> None:
    for field in ("missing", "unexpected", "shape_mismatch", "nonfinite", "non_tensor", "shared_mismatch", "failures"):
        assert report[field] == [], (field, report[field])


def _state_dict(path: Path) -> OrderedDict:
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.mark.parametrize("mode", [
    "single", "dp", "ddp", "compile", "compile_ddp", "ddp_compile", "amp",
    "cuda0", "cuda1", "model_parallel", "legacy", "train_ckpt", "safetensors",
])
def test_every_mlp_fixture_verifies_by_file_spec(cli_runner, fixtures_dir: Path, manifest: dict, train: Any,
                                                 mode: str, tmp_path: Path) -> None:
    name = train.fixture_name("mlp", mode)
    entry = manifest[name]
    golden = golden_from_manifest(entry, tmp_path / "golden.safetensors")
    report = _json(cli_runner, [str(fixtures_dir / name), "--model", MLP_SPEC, "--golden", str(golden)], 0)
    assert report["ok"] is True and report["fix"] == _expected_fix(entry["wrappers"])
    _assert_clean(report)
    assert report["sha256"] == entry["sha256"]
    assert report["state_dict_key"] == entry["state_dict_key"]
    # The manifest's float32 outputs were recorded on another machine: compared within the documented
    # recorded-value tolerance (no --atol/--rtol given), on the input the golden file records.
    (check,) = report["forward"]["against"]
    assert check["what"] == "golden" and check["ok"]
    assert (check["tolerance"], check["atol"], check["rtol"], check["output_dtypes"]) == \
        ("recorded", 1e-6, 1e-5, ["float32"])
    assert check["input_shape"] == entry["input"]["shape"] and report["golden"]["action"] == "compared"
    assert bool(report["dtype_mismatch"]) == (mode == "amp")


@pytest.mark.parametrize("mode", [
    "single", "dp", "ddp", "compile", "compile_ddp", "ddp_compile", "amp",
    "cuda0", "cuda1", "model_parallel", "legacy", "train_ckpt", "safetensors",
])
def test_every_resnet18_fixture_verifies_by_torchvision_name(cli_runner, resnet_dir: Path, train: Any,
                                                             mode: str, tmp_path: Path) -> None:
    entry = json.loads((resnet_dir / "manifest.json").read_text())["fixtures"][train.fixture_name("resnet18", mode)]
    golden = golden_from_manifest(entry, tmp_path / "golden.safetensors")
    report = _json(cli_runner, [str(resnet_dir / entry["file"]), *RESNET, "--golden", str(golden)], 0)
    assert report["fix"] == _expected_fix(entry["wrappers"])
    assert report["matched"] == report["total"] == 122
    _assert_clean(report)
    # recorded in this session, but by the generator on one thread: conv kernels may split work (and
    # round) differently on more, so verify's recorded-value tolerance applies, as to any golden file
    (check,) = report["forward"]["against"]
    assert check["what"] == "golden" and check["ok"] and check["tolerance"] == "recorded"


@pytest.mark.parametrize("shift, atol, ok, tolerance", [
    (1e-3, None, False, "recorded"),  # a wrong recorded output: far beyond the recorded-value tolerance
    (4e-7, None, True, "recorded"),  # another CPU's last bits: within it
    (4e-7, 0.0, True, "recorded"),  # 0 (the CLI's default) is "not given" for a golden row
    (1e-3, 2e-3, True, "given"),  # a given tolerance replaces the default, looser …
    (4e-7, 1e-9, False, "given"),  # … or tighter
])
def test_golden_comparison_uses_the_recorded_value_tolerance(shift: float, atol: float | None, ok: bool,
                                                             tolerance: str, fixtures_dir: Path, manifest: dict,
                                                             tmp_path: Path) -> None:
    entry = manifest["mlp_single.pth"]
    exact = golden_from_manifest(entry, tmp_path / "exact.safetensors")
    base = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, golden=exact).forward["max_abs_diff"]  # this CPU's
    shifted = json.loads(json.dumps(entry))
    shifted["output"][2][0] += shift
    golden = golden_from_manifest(shifted, tmp_path / "golden.safetensors")
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, atol=atol, golden=golden)
    assert report.ok is ok and report.forward["ok"] is ok
    # the golden file holds float32: the shift it really records is the difference of the two rounded values
    stored = [float(torch.tensor(o["output"][2][0], dtype=torch.float32)) for o in (entry, shifted)]
    assert report.forward["max_abs_diff"] == pytest.approx(stored[1] - stored[0], abs=base + 1e-9)
    (row,) = report.forward["against"]
    want = (1e-6, 1e-5) if tolerance == "recorded" else (atol, 0.0)
    assert (row["tolerance"], row["atol"], row["rtol"]) == (tolerance, *want)
    text = report.format_text()
    assert f"atol={want[0]:g}, rtol={want[1]:g}: " in text
    assert ("forward output differs from the golden" in text) is not ok


@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-6, 1e-5), (torch.float16, 1e-5, 1e-3),
                                               (torch.bfloat16, 1e-5, 1.6e-2), (torch.float64, 1e-7, 1e-7),
                                               (torch.int64, 0.0, 0.0)])
def test_recorded_tolerance_follows_the_output_dtype(dtype: torch.dtype, atol: float, rtol: float) -> None:
    from ckptfix.model.forward import compare_outputs
    from ckptfix.model.inputs import InputRecipe

    recipe = InputRecipe(shape=(4,), seed=0)
    got = {"output": torch.arange(1, 5, dtype=dtype)}
    want = {"output": got["output"].double() * (1 + rtol / 2) if rtol else got["output"].double() + 1}  # never bit-equal
    for default in ("recorded", "dtype"):  # a golden file; a half-precision run against its cast reference
        row = compare_outputs("golden", "g.safetensors", got, want, None, None, recipe, default=default)
        assert (row["tolerance"], row["atol"], row["rtol"]) == (default, atol, rtol)
        assert row["output_dtypes"] == [str(dtype).removeprefix("torch.")] and row["ok"] is (rtol > 0)
    computed_here = compare_outputs("reference", "r.pth", got, want, None, None, recipe)
    assert (computed_here["tolerance"], computed_here["atol"], computed_here["rtol"]) == ("exact", 0.0, 0.0)
    assert computed_here["ok"] is False
    assert compare_outputs("reference", "r.pth", got, got, None, None, recipe)["ok"]


def test_resnet18_checkpoint_against_resnet34(cli_runner, resnet_dir: Path) -> None:
    report = _json(cli_runner, [str(resnet_dir / "resnet18_single.pth"), "--model", "torchvision:resnet34",
                                "--arg", "num_classes=10"], 3)
    r18 = torchvision.models.resnet18(num_classes=10).state_dict()
    r34 = torchvision.models.resnet34(num_classes=10).state_dict()
    assert report["missing"] == [k for k in r34 if k not in r18]
    assert report["unexpected"] == [] and report["shape_mismatch"] == [] and report["ok"] is False
    assert report["forward"] is None


def test_num_classes_10_against_1000(cli_runner, resnet_dir: Path) -> None:
    report = _json(cli_runner, [str(resnet_dir / "resnet18_ddp.pth"), "--model", "torchvision:resnet18"], 3)
    assert report["fix"] == "strip module."
    assert report["shape_mismatch"] == [
        {"key": "fc.weight", "checkpoint": [10, 512], "model": [1000, 512]},
        {"key": "fc.bias", "checkpoint": [10], "model": [1000]},
    ]
    assert report["missing"] == [] and report["unexpected"] == []


def test_renamed_layer_is_reported_not_guessed(cli_runner, resnet_dir: Path, tmp_path: Path) -> None:
    sd = _state_dict(resnet_dir / "resnet18_single.pth")
    renamed = OrderedDict((("stage4." + k[len("layer4."):]) if k.startswith("layer4.") else k, v) for k, v in sd.items())
    torch.save(renamed, tmp_path / "renamed.pth")
    report = _json(cli_runner, [str(tmp_path / "renamed.pth"), *RESNET], 3)
    assert report["fix"] is None
    assert report["missing"] == [k for k in sd if k.startswith("layer4.")]
    assert report["unexpected"] == [k for k in renamed if k.startswith("stage4.")]
    rename, by_order = report["suggestions"]
    assert rename["rename"] == {"from": "stage4.", "to": "layer4."} and rename["keys"] == len(report["missing"])
    assert by_order["by_order"] is True
    text = cli_runner.invoke(cli, ["verify", str(tmp_path / "renamed.pth"), *RESNET]).output
    assert f"missing ({len(report['missing'])}):" in text and rename["text"] in text
    # The suggested rename, applied by convert, gives a file that verifies.
    argv = shlex.split(rename["text"].split(": ", 1)[1])
    assert argv[:5] == ["ckptfix", "convert", str(tmp_path / "renamed.pth"), "OUT", "--rename"]
    argv[3] = str(tmp_path / "fixed.pth")
    assert cli_runner.invoke(cli, argv[1:]).exit_code == 0
    _json(cli_runner, [str(tmp_path / "fixed.pth"), *RESNET, "--exact", "--no-forward"], 0)


def test_perturbed_weight_is_caught_by_reference(cli_runner, resnet_dir: Path, tmp_path: Path) -> None:
    original = resnet_dir / "resnet18_ddp.pth"
    converted = tmp_path / "converted.safetensors"
    ckptfix.convert(original, converted)
    ok = _json(cli_runner, [str(converted), *RESNET, "--reference", str(original)], 0)
    assert ok["forward"]["against"] == [{"what": "reference", "path": str(original), "input_shape": [1, 3, 224, 224],
                                         "input": {"shape": [1, 3, 224, 224], "dtype": "float", "range": None,
                                                   "seed": 1234},
                                         "seed": 1234, "max_abs_diff": 0.0, "ok": True, "atol": 0.0, "rtol": 0.0,
                                         "tolerance": "exact", "output_dtypes": ["float32"]}]
    sd = ckptfix.load(converted)
    sd["layer1.0.conv1.weight"][0, 0, 0, 0] += 0.5
    torch.save(sd, tmp_path / "perturbed.pth")
    bad = _json(cli_runner, [str(tmp_path / "perturbed.pth"), *RESNET, "--reference", str(original)], 3)
    _assert_clean({**bad, "failures": []})  # structurally fine: only the outputs differ
    assert bad["forward"]["ok"] is False and bad["forward"]["max_abs_diff"] > 0
    loose = _json(cli_runner, [str(tmp_path / "perturbed.pth"), *RESNET, "--reference", str(original),
                               "--atol", str(bad["forward"]["max_abs_diff"])], 0)
    assert loose["forward"]["ok"] is True
    (row,) = loose["forward"]["against"]
    assert (row["tolerance"], row["atol"], row["rtol"]) == ("given", bad["forward"]["max_abs_diff"], 0.0)


def test_fp16_checkpoint_warns_and_exact_fails_on_dtype(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    path = str(shutil.copy(fixtures_dir / "mlp_amp.pth", tmp_path))
    res = cli_runner.invoke(cli, ["verify", path, "--model", MLP_SPEC])
    assert res.exit_code == 0 and "warning: 6 tensors are cast on load (float16 -> float32)" in res.output
    report = _json(cli_runner, [path, "--model", MLP_SPEC, "--exact"], 3)
    assert [r["key"] for r in report["dtype_mismatch"]] == list(_state_dict(fixtures_dir / "mlp_amp.pth"))
    assert {(r["checkpoint"], r["model"]) for r in report["dtype_mismatch"]} == {("float16", "float32")}
    assert report["failures"] == ["exact: 6 dtypes differ from the model's (float16 vs model float32): 0.weight, "
                                  "0.bias, 2.weight and 3 more"]
    assert report["convert_command"].endswith("--to single --dtype fp32")
    assert cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:]).exit_code == 0
    fixed = _json(cli_runner, [str(tmp_path / "mlp_amp.fixed.pth"), "--model", MLP_SPEC, "--exact"], 0)
    assert fixed["dtype_mismatch"] == [] and fixed["convert_command"] is None


def test_dp_checkpoint_with_exact_fails_and_names_the_repair(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "mlp_dp.pth"
    shutil.copy(fixtures_dir / "mlp_dp.pth", src)
    report = _json(cli_runner, [str(src), "--model", MLP_SPEC, "--exact"], 3)
    assert report["fix"] == "strip module." and report["exact"] is True
    assert report["convert_command"] == f"ckptfix convert {src} {tmp_path / 'mlp_dp.fixed.pth'} --to single"
    assert report["failures"][0] == ("exact: load_state_dict(strict=True) would fail as saved: 6 missing: 0.weight, "
                                     "0.bias, 2.weight and 3 more; 6 unexpected: module.0.weight, module.0.bias, "
                                     "module.2.weight and 3 more (the repair: strip module.)")
    (observed,) = report["failures"][1:]  # and the loader itself, observed, says so
    assert observed.startswith("exact: the serving loader failed as saved: torch.load(PATH, weights_only=True, "
                               "mmap=True) + load_state_dict(strict=True): the strict load: RuntimeError: ")
    assert 'Unexpected key(s) in state_dict: "module.0.weight"' in observed
    # The named command really produces a file that passes --exact.
    res = cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:])
    assert res.exit_code == 0, res.output
    fixed = _json(cli_runner, [str(tmp_path / "mlp_dp.fixed.pth"), "--model", MLP_SPEC, "--exact"], 0)
    assert fixed["fix"] is None and fixed["failures"] == []


@pytest.mark.parametrize("layout, failure, option, ext", [
    ("train_ckpt", "exact: torch.load returns a dict with the state dict under 'model_state_dict', "
                   "not the state dict", " --select model_state_dict", ".pth"),
    ("dcp", "exact: neither torch.load nor safetensors.torch.load_file reads a dcp directory", "", ".pth"),
])
def test_exact_needs_one_file_the_serving_loader_reads(cli_runner, fixtures_dir: Path, tmp_path: Path, layout: str,
                                                       failure: str, option: str, ext: str) -> None:
    original = fixtures_dir / "mlp_train_ckpt.pth"
    if layout == "train_ckpt":
        path = Path(shutil.copy(original, tmp_path))
    else:
        path = tmp_path / "release"
        ckptfix.convert(original, path, **({"max_shard_size": "1KB"} if layout == "sharded" else {"format": "dcp"}))
    report = ckptfix.verify(path, MLP_SPEC, exact=True)
    assert report.failures[0] == failure and report.fix is None
    # the observed loader agrees: it fails the strict load (a dict around the state dict), or there is none (DCP)
    extra = report.failures[1:]
    assert len(extra) == (0 if layout == "dcp" else 1)
    assert all(f.startswith("exact: the serving loader failed as saved: ") and "strict load" in f for f in extra)
    fixed = tmp_path / f"{path.stem}.fixed{ext}"
    assert report.convert_command == f"ckptfix convert {path} {fixed} --to single{option}"
    assert cli_runner.invoke(cli, shlex.split(report.convert_command)[1:]).exit_code == 0
    again = ckptfix.verify(fixed, MLP_SPEC, exact=True, reference=original)
    assert again.ok and again.forward["max_abs_diff"] == 0.0


def test_a_sharded_release_passes_exact_shard_by_shard(fixtures_dir: Path, tmp_path: Path) -> None:
    """Loaded as transformers' load_sharded_checkpoint does: each shard by its plain loader, the union strictly."""
    ckptfix.convert(fixtures_dir / "mlp_single.pth", tmp_path / "release", max_shard_size="1KB")
    report = ckptfix.verify(tmp_path / "release", MLP_SPEC, exact=True)
    assert report.ok and report.failures == [] and report.observed["ok"]
    assert report.observed["call"] == ("each shard: safetensors.torch.load_file(PATH); the union + "
                                       "load_state_dict(strict=True)")


class Lit(nn.Module):
    """What a LightningModule's state_dict looks like: the network under an attribute."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.model = net


def test_lightning_prefix_is_stripped_and_the_convert_command_works(cli_runner, fixtures_dir: Path, train: Any,
                                                                    tmp_path: Path) -> None:
    lit = Lit(train.mlp())
    lit.model.load_state_dict(_state_dict(fixtures_dir / "mlp_single.pth"))
    src = tmp_path / "lit.ckpt"
    torch.save({"state_dict": lit.state_dict(), "epoch": 3, "global_step": 10}, src)
    report = _json(cli_runner, [str(src), "--model", MLP_SPEC, "--exact",
                                "--reference", str(fixtures_dir / "mlp_single.pth")], 3)
    assert report["fix"] == "strip prefix model." and report["forward"]["max_abs_diff"] == 0.0
    assert report["convert_command"] == (f"ckptfix convert {src} {tmp_path / 'lit.fixed.pth'} --to single "
                                         "--strip-prefix model. --select state_dict")
    assert cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:]).exit_code == 0
    _json(cli_runner, [str(tmp_path / "lit.fixed.pth"), "--model", MLP_SPEC, "--exact"], 0)


def test_wrapper_segments_are_added_to_match_a_wrapped_model(fixtures_dir: Path, train: Any) -> None:
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", nn.DataParallel(train.mlp()),
                            reference=fixtures_dir / "mlp_dp.pth")
    assert report.ok and report.fix == "add module." and report.matched == 6
    (reference_row,) = report.forward["against"]
    assert (reference_row["what"], reference_row["tolerance"], reference_row["max_abs_diff"]) == \
        ("reference", "exact", 0.0)


def test_the_models_own_prefix_is_added(fixtures_dir: Path, train: Any) -> None:
    report = ckptfix.verify(fixtures_dir / "mlp_ddp.pth", Lit(train.mlp()), forward=False)
    assert report.ok and report.fix == "strip module., add prefix model." and report.matched == 6


@pytest.mark.parametrize("option, reads", [("structure_only", "meta"), ("forward", "cpu")])
def test_structure_only_reads_on_meta_no_forward_reads_values(option: str, reads: str, monkeypatch,
                                                              fixtures_dir: Path) -> None:
    """``--structure-only``: nothing but the structure; ``--no-forward``: the values too (NaN/Inf), no model run."""
    seen = []
    real_read = ckptfix.ops.reading.read_checkpoint

    def spy(path: Any, map_location: Any, *args: Any, **kwargs: Any) -> Any:
        ckpt = real_read(path, map_location, *args, **kwargs)
        seen.append((map_location, {t.device.type for t in ckpt.state_dict.values()}))
        return ckpt

    monkeypatch.setattr(ckptfix.ops.reading, "read_checkpoint", spy)
    report = ckptfix.verify(fixtures_dir / "mlp_ddp.pth", MLP_SPEC, reference=fixtures_dir / "mlp_single.pth",
                            **{option: option == "structure_only"})
    assert seen == [(reads, {reads})]
    assert report.ok and report.fix == "strip module." and report.forward is None
    assert report.nonfinite == (None if reads == "meta" else [])
    assert report.notes[-1].startswith("structure only (--structure-only): read on meta" if reads == "meta" else
                                       "no forward check (--no-forward): the model was not loaded")
    assert report.notes[-1].endswith("; --reference ignored")


def test_text_no_forward_does_not_hash_the_file(monkeypatch, cli_runner, fixtures_dir: Path) -> None:
    def refuse(path: str, *progress: Any) -> str:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(integrity, "sha256_file", refuse)
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_ddp.pth"), "--model", MLP_SPEC, "--no-forward"])
    assert res.exit_code == 0 and "sha256" not in res.output, res.output
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_ddp.pth"), "--model", MLP_SPEC, "--no-forward",
                                  "--json"])
    assert res.exit_code == 1 and "hashed" in res.output  # --json always carries the sha256


def test_nonfinite_values_fail(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    sd = _state_dict(fixtures_dir / "mlp_single.pth")
    sd["2.bias"][3] = float("nan")
    sd["4.weight"][0, 1] = float("inf")
    torch.save(sd, tmp_path / "nan.pth")
    report = _json(cli_runner, [str(tmp_path / "nan.pth"), "--model", MLP_SPEC], 3)
    assert report["nonfinite"] == ["2.bias", "4.weight"]
    assert report["failures"] == ["2 non-finite: 2.bias, 4.weight"]  # the keys, not only a count
    text = cli_runner.invoke(cli, ["verify", str(tmp_path / "nan.pth"), "--model", MLP_SPEC]).output
    assert "  FAIL: 2 non-finite: 2.bias, 4.weight\n" in text and "  NaN/Inf (2):\n    2.bias\n    4.weight\n" in text
    assert _json(cli_runner, [str(tmp_path / "nan.pth"), "--model", MLP_SPEC, "--no-forward"], 3)["nonfinite"] == \
        ["2.bias", "4.weight"]  # the fast gate checks the values too, at read speed
    assert _json(cli_runner, [str(tmp_path / "nan.pth"), "--model", MLP_SPEC, "--structure-only"], 0)["nonfinite"] is None


TIED = '''
import torch.nn as nn

class TiedLM(nn.Module):
    def __init__(self, vocab=11, dim=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x.long().abs() % 11))

def build(vocab=11):
    return TiedLM(vocab)
'''


def test_tied_weights(tmp_path: Path) -> None:
    (tmp_path / "tied.py").write_text(TIED)
    spec = f"{tmp_path / 'tied.py'}:build"
    model = build_model(spec)
    torch.save(model.state_dict(), tmp_path / "tied.pth")
    assert ckptfix.verify(tmp_path / "tied.pth", spec).ok
    # Saved with the twin dropped (as safetensors' save_model does): tolerated, and the outputs agree.
    torch.save({"embed.weight": model.embed.weight.detach()}, tmp_path / "dropped.pth")
    report = ckptfix.verify(tmp_path / "dropped.pth", spec, reference=tmp_path / "tied.pth", input_shape=(2, 3))
    assert report.ok and report.missing == [] and report.forward["max_abs_diff"] == 0.0
    assert report.tolerated == [{"key": "head.weight", "kind": "tied", "reason": "tied to embed.weight, which is present"}]
    # Two different tensors for parameters the model ties: only one could survive loading.
    untied = {"embed.weight": model.embed.weight.detach().clone(), "head.weight": torch.zeros(11, 4)}
    torch.save(untied, tmp_path / "untied.pth")
    bad = ckptfix.verify(tmp_path / "untied.pth", spec)
    assert not bad.ok and bad.shared_mismatch[0]["keys"] == ["embed.weight", "head.weight"]


@pytest.mark.parametrize("keep_metadata", [False, True])
def test_missing_num_batches_tracked_and_exact_agrees_with_torch(resnet_dir: Path, tmp_path: Path,
                                                                keep_metadata: bool) -> None:
    sd = _state_dict(resnet_dir / "resnet18_single.pth")
    old = OrderedDict((k, v) for k, v in sd.items() if not k.endswith("num_batches_tracked"))
    if keep_metadata:
        old._metadata = sd._metadata
    torch.save(old, tmp_path / "old_bn.pth")
    report = ckptfix.verify(tmp_path / "old_bn.pth", "torchvision:resnet18", model_args={"num_classes": 10},
                            reference=resnet_dir / "resnet18_single.pth")
    assert report.ok and report.forward["max_abs_diff"] == 0.0
    assert [t["key"] for t in report.tolerated] == [k for k in sd if k.endswith("num_batches_tracked")]
    exact = ckptfix.verify(tmp_path / "old_bn.pth", "torchvision:resnet18", model_args={"num_classes": 10},
                           exact=True, forward=False)
    model = torchvision.models.resnet18(num_classes=10)
    try:
        model.load_state_dict(torch.load(tmp_path / "old_bn.pth", weights_only=True, map_location="cpu"), strict=True)
        torch_loads = True
    except RuntimeError:
        torch_loads = False
    assert torch_loads is (not keep_metadata)  # BatchNorm fills the key itself for version-1 checkpoints only
    assert exact.ok is torch_loads


def test_input_shape_is_required_when_it_cannot_be_inferred(cli_runner, tmp_path: Path) -> None:
    (tmp_path / "conv.py").write_text("import torch.nn as nn\ndef build():\n    return nn.Sequential(nn.Conv2d(1, 2, 3))\n")
    spec = f"{tmp_path / 'conv.py'}:build"
    torch.save(build_model(spec).state_dict(), tmp_path / "conv.pth")
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "conv.pth"), "--model", spec,
                                  "--reference", str(tmp_path / "conv.pth")])
    assert res.exit_code == 1 and "pass --input-shape" in res.output
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "conv.pth"), "--model", spec,
                                  "--reference", str(tmp_path / "conv.pth"), "--input-shape", "1,1,5,5", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["forward"]["against"][0]["input_shape"] == [1, 1, 5, 5]


def test_text_report_names_the_repair(cli_runner, fixtures_dir: Path, manifest: dict, tmp_path: Path) -> None:
    golden = golden_from_manifest(manifest["mlp_ddp_compile.pth"], tmp_path / "golden.safetensors")
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_ddp_compile.pth"), "--model", MLP_SPEC,
                                  "--golden", str(golden)])
    assert res.exit_code == 0
    assert res.stdout.startswith("VERIFIED: ") and "keys: strip module._orig_mod.: 6/6 keys match" in res.stdout
    assert "(ok; atol=1e-06, rtol=1e-05: recorded-value default for float32; input 4x13 float, seed 1234)" in res.stdout


def test_errors_exit_1(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "nope.pth"), "--model", MLP_SPEC])
    assert res.exit_code == 1 and "no such file" in res.output
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", "torchvision:resnet19"])
    assert res.exit_code == 1 and "torchvision has no model 'resnet19'" in res.output


def test_subprocess_exit_codes(fixtures_dir: Path) -> None:
    exe = str(Path(sys.executable).with_name("ckptfix"))
    ok = subprocess.run([exe, "verify", str(fixtures_dir / "mlp_dp.pth"), "--model", MLP_SPEC, "--json", "--quiet"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True and ok.stderr == ""
    bad = subprocess.run([exe, "verify", str(fixtures_dir / "mlp_dp.pth"), "--model", MLP_SPEC, "--exact"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3 and bad.stdout.startswith("FAILED: ")
    err = subprocess.run([exe, "verify", str(fixtures_dir / "mlp_dp.pth"), "--model", "no_such_pkg.models:build",
                          "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert err.returncode == 1 and err.stderr.startswith("Error: model spec 'no_such_pkg.models:build': can't import")


@pytest.mark.gpu
def test_verify_with_tensors_on_the_gpu(fixtures_dir: Path, manifest: dict, tmp_path: Path) -> None:
    golden = golden_from_manifest(manifest["mlp_model_parallel.pth"], tmp_path / "golden.safetensors")
    report = ckptfix.verify(fixtures_dir / "mlp_model_parallel.pth", MLP_SPEC, map_location="cuda",
                            reference=fixtures_dir / "mlp_single.pth", golden=golden)
    assert report.ok and report.nonfinite == []
    golden_row, reference_row = report.forward["against"]  # the golden outputs were recorded on a CPU
    assert (golden_row["what"], golden_row["tolerance"], golden_row["ok"]) == ("golden", "recorded", True)
    assert (reference_row["what"], reference_row["tolerance"], reference_row["max_abs_diff"]) == \
        ("reference", "exact", 0.0)


# --- integrity: a torch zip's stored CRC-32s are checked against its bytes ---

def _corrupt_middle_of_largest_record(path: Path) -> str:
    """Overwrite 64 bytes in the middle of the largest tensor record with finite float32s (0x3f3f3f3f:
    no NaN/Inf to give it away); returns the member's name."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert info.file_size >= 256
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2 - 32)
        f.write(b"\x3f" * 64)
    return info.filename


@pytest.mark.parametrize("layout, flags", [
    ("pth", ["--exact"]), ("pth", ["--exact", "--no-forward"]), ("sharded-pth", []), ("sharded-pth", ["--no-forward"]),
])
def test_verify_fails_a_file_whose_crcs_do_not_match(layout: str, flags: list[str], tmp_path: Path, fixtures_dir: Path,
                                                     cli_runner) -> None:
    if layout == "pth":
        path = tmp_path / "mlp.pth"
        shutil.copy(fixtures_dir / "mlp_single.pth", path)
        victim = path
    else:
        path = tmp_path / "shards"
        ckptfix.convert(fixtures_dir / "mlp_single.pth", path, max_shard_size="1KB", format="pth")
        victim = path / json.loads((path / "pytorch_model.bin.index.json").read_text())["weight_map"]["2.weight"]
    before = _json(cli_runner, [str(path), "--model", MLP_SPEC, *flags], 0)  # as written: passes
    assert before["ok"] is True and before["failures"] == []
    member = _corrupt_middle_of_largest_record(victim)
    report = _json(cli_runner, [str(path), "--model", MLP_SPEC, *flags], 3)
    assert report["ok"] is False and report["missing"] == report["unexpected"] == report["shape_mismatch"] == []
    where = member if layout == "pth" else f"{victim.name}: {member}"
    assert report["failures"][0] == (f"integrity: {where}: its CRC-32 does not match its bytes: the file was damaged "
                                     "or altered after it was written (a truncated copy, a bad download or disk); copy "
                                     "or download it again from the original")
    digest = report["failures"][1:]  # a ckptfix output's (the shards convert wrote): its digest names the tensor too
    assert len(digest) == (layout == "sharded-pth") and all(
        re.search(r": tensor '[\w.]+' does not match its recorded digest \(crc32 ", line) for line in digest)
    res = cli_runner.invoke(cli, ["verify", str(path), "--model", MLP_SPEC, *flags])
    assert res.exit_code == 3 and f"FAIL: integrity: {where}: its CRC-32 does not match" in res.stdout
