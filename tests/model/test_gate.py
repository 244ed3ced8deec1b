"""The pre-deploy gate: --exact on safetensors releases, a serving dtype, token-ID and multi-input models,
golden outputs, directory checkpoints with the forward check."""

from __future__ import annotations

import json
import zipfile
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.model.golden import META_KEY
from ckptfix.model.spec import build_model

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"

NLP = '''
import torch
from torch import nn

class TokenNet(nn.Module):
    """BERT-like in miniature: token IDs -> embeddings -> a linear head."""

    def __init__(self, vocab=50, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids)).mean(dim=1)

class PairNet(TokenNet):
    """Two inputs, as a transformer's forward(input_ids, attention_mask); a dict output."""

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) * attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        return {"logits": self.head(x).sum(dim=1), "hidden": x}

def token_net(vocab=50):
    torch.manual_seed(0)
    return TokenNet(vocab)

def pair_net(vocab=50):
    torch.manual_seed(0)
    return PairNet(vocab)
'''


@pytest.fixture
def nlp(tmp_path: Path) -> Path:
    (tmp_path / "nlp.py").write_text(NLP)
    return tmp_path / "nlp.py"


def _json(cli_runner: Any, args: list[str], code: int) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["verify", *args, "--json"])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)


def _serving_loader_takes(path: Path, model: torch.nn.Module) -> bool:
    """What the serving code does: safetensors.torch.load_file / torch.load + a strict load, no ckptfix."""
    sd = load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True, map_location="cpu")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError:
        return False
    return all(v.dtype == model.state_dict()[k].dtype for k, v in sd.items())


# --- --exact: the serving loader of each single-file format ---

@pytest.mark.parametrize("src, to, ok", [
    ("mlp_safetensors.safetensors", "keep", True),  # written by safetensors itself
    ("mlp_single.pth", "single", True),  # converted by ckptfix
    ("mlp_single.pth", "ddp", False),  # module. keys: load_file + strict load refuses them
])
def test_exact_takes_a_safetensors_release_as_load_file_does(src: str, to: str, ok: bool, cli_runner: Any,
                                                             fixtures_dir: Path, train: Any, tmp_path: Path) -> None:
    release = tmp_path / "release.safetensors"
    ckptfix.convert(fixtures_dir / src, release, to=to)
    report = _json(cli_runner, [str(release), "--model", MLP_SPEC, "--exact", "--reference",
                                str(fixtures_dir / "mlp_single.pth")], 0 if ok else 3)
    assert report["ok"] is ok is _serving_loader_takes(release, train.mlp())
    assert report["format"] == "safetensors" and report["forward"]["max_abs_diff"] == 0.0
    if not ok:
        assert report["failures"][0] == ("exact: load_state_dict(strict=True) would fail as saved: 6 missing: 0.weight, "
                                         "0.bias, 2.weight and 3 more; 6 unexpected: module.0.weight, module.0.bias, "
                                         "module.2.weight and 3 more (the repair: strip module.)")
        (observed,) = report["failures"][1:]  # and the loader itself, observed, says so
        assert observed.startswith("exact: the serving loader failed as saved: safetensors.torch.load_file(PATH) + "
                                   "load_state_dict(strict=True): the strict load: RuntimeError: Error(s) in loading")
        fixed = tmp_path / "release.fixed.safetensors"  # a safetensors release stays safetensors
        assert report["convert_command"] == f"ckptfix convert {release} {fixed} --to single"
        assert cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:]).exit_code == 0
        assert _json(cli_runner, [str(fixed), "--model", MLP_SPEC, "--exact"], 0)["ok"]
        assert _serving_loader_takes(fixed, train.mlp())
    res = cli_runner.invoke(cli, ["verify", str(release), "--model", MLP_SPEC, "--exact"])
    assert "(--exact: as safetensors.torch.load_file + strict load_state_dict would load it)" in res.output


# --- a serving dtype: the model built in it, the forward run in it ---

@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
@pytest.mark.parametrize("dtype, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_a_cast_release_passes_exact_in_its_serving_dtype(dtype: str, torch_dtype: torch.dtype, fmt: str,
                                                          cli_runner: Any, fixtures_dir: Path, train: Any,
                                                          tmp_path: Path) -> None:
    original = fixtures_dir / "mlp_single.pth"
    release = tmp_path / f"release.{fmt}"
    ckptfix.convert(original, release, dtype=dtype)
    report = _json(cli_runner, [str(release), "--model", MLP_SPEC, "--exact", "--dtype", dtype,
                                "--reference", str(original)], 0)
    assert report["model_dtype"] == str(torch_dtype).removeprefix("torch.") and report["dtype_mismatch"] == []
    assert _serving_loader_takes(release, train.mlp().to(torch_dtype))
    (row,) = report["forward"]["against"]
    atol, rtol = ckptfix.model.forward.RECORDED_TOLERANCE[report["model_dtype"]]
    # the half-precision model ran (not weights cast back to fp32), against the reference cast to the same dtype
    assert (row["output_dtypes"], row["tolerance"], row["atol"], row["rtol"]) == \
        ([report["model_dtype"]], "dtype", atol, rtol)
    assert row["ok"] and row["max_abs_diff"] == 0.0  # the same rounding both ways: the same computation
    text = cli_runner.invoke(cli, ["verify", str(release), "--model", MLP_SPEC, "--exact", "--dtype", dtype,
                                   "--reference", str(original)]).output
    assert f"default for {report['model_dtype']}, the serving dtype (the reference run in it too)" in text
    # Without the serving dtype, --exact reports the cast and the command that undoes it.
    plain = _json(cli_runner, [str(release), "--model", MLP_SPEC, "--exact", "--no-forward"], 3)
    assert plain["failures"] == [f"exact: 6 dtypes differ from the model's ({report['model_dtype']} vs model float32): "
                                 "0.weight, 0.bias, 2.weight and 3 more"]
    assert plain["convert_command"].endswith("--dtype fp32")


def test_fp32_release_against_a_half_serving_dtype_names_the_cast(fixtures_dir: Path, tmp_path: Path) -> None:
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, exact=True, dtype="fp16", forward=False)
    assert not report.ok and report.convert_command.endswith("--dtype fp16")
    assert {(r["checkpoint"], r["model"]) for r in report.dtype_mismatch} == {("float32", "float16")}


def test_a_given_tolerance_replaces_the_serving_dtype_default(fixtures_dir: Path) -> None:
    half = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, dtype="bf16",
                          reference=fixtures_dir / "mlp_single.pth", atol=1e-2)
    (row,) = half.forward["against"]
    assert (row["tolerance"], row["atol"], row["rtol"], row["output_dtypes"]) == ("given", 1e-2, 0.0, ["bfloat16"])


# --- inputs: token IDs, several inputs, files ---

@pytest.mark.parametrize("options", [
    ["--input-shape", "2,7"],  # an Embedding first: long IDs in [0, 50) implied
    ["--input-shape", "2,7", "--input-dtype", "long", "--input-range", "0,50"],
    ["--input-shape", "2,7", "--input-dtype", "int", "--input-range", "3,9"],
])
def test_token_id_models_take_integer_inputs(options: list[str], cli_runner: Any, nlp: Path, tmp_path: Path) -> None:
    spec = f"{nlp}:token_net"
    torch.save(build_model(spec).state_dict(), tmp_path / "lm.pth")
    ckptfix.convert(tmp_path / "lm.pth", tmp_path / "lm.safetensors")
    report = _json(cli_runner, [str(tmp_path / "lm.safetensors"), "--model", spec, "--reference",
                                str(tmp_path / "lm.pth"), *options], 0)
    (row,) = report["forward"]["against"]
    dtype = options[options.index("--input-dtype") + 1] if "--input-dtype" in options else "long"
    rng = [3.0, 9.0] if dtype == "int" else [0.0, 50.0]
    assert row["input"] == {"shape": [2, 7], "dtype": dtype, "range": rng, "seed": 1234}
    assert row["ok"] and row["max_abs_diff"] == 0.0


def test_the_input_error_says_what_to_pass_for_the_model(cli_runner: Any, nlp: Path, tmp_path: Path) -> None:
    for fn, message in [
        ("token_net", "TokenNet starts with an Embedding of 50 token IDs; pass --input-shape 1,SEQ_LEN (e.g. 1,16) "
                      "--input-dtype long --input-range 0,50"),
        ("pair_net", "PairNet.forward takes input_ids, attention_mask: pass --input FILE (.pt or .safetensors) "
                     "holding a dict of those tensors, called as model(**dict)"),
    ]:
        spec = f"{nlp}:{fn}"
        torch.save(build_model(spec).state_dict(), tmp_path / "m.pth")
        res = cli_runner.invoke(cli, ["verify", str(tmp_path / "m.pth"), "--model", spec,
                                      "--reference", str(tmp_path / "m.pth"), "--quiet"])
        assert res.exit_code == 1 and res.stderr.startswith(f"Error: {message}"), res.output
        assert "pass --input-shape (library" not in res.stderr  # not the generic advice, which can't help here
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "m.pth"), "--model", f"{nlp}:token_net",
                                  "--reference", str(tmp_path / "m.pth"), "--input-dtype", "long", "--input-shape", "1,4",
                                  "--input-range", "0,500"])
    assert res.exit_code == 1 and "the model's forward on input 1x4 long in [0, 500), seed 1234 failed" in res.stderr


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_multi_input_models_take_a_dict_of_tensors(suffix: str, cli_runner: Any, nlp: Path, tmp_path: Path) -> None:
    spec = f"{nlp}:pair_net"
    torch.save(build_model(spec).state_dict(), tmp_path / "pair.pth")
    ckptfix.convert(tmp_path / "pair.pth", tmp_path / "pair.safetensors")
    batch = {"input_ids": torch.randint(0, 50, (2, 5)), "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])}
    path = tmp_path / f"batch{suffix}"
    save_file(batch, path) if suffix == ".safetensors" else torch.save(batch, path)
    args = [str(tmp_path / "pair.safetensors"), "--model", spec, "--reference", str(tmp_path / "pair.pth"),
            "--input", str(path)]
    report = _json(cli_runner, args, 0)
    (row,) = report["forward"]["against"]
    assert row["input"]["file"] == str(path) and row["input_shape"] is None and row["seed"] is None
    assert row["input"]["tensors"] == {"input_ids": {"shape": [2, 5], "dtype": "int64"},
                                       "attention_mask": {"shape": [2, 5], "dtype": "int64"}}
    assert row["ok"] and row["max_abs_diff"] == 0.0 and row["output_dtypes"] == ["float32"]
    # outputs are compared by name: a dict's entries, nested
    golden = tmp_path / "golden.safetensors"
    recorded = _json(cli_runner, [*args, "--golden", str(golden)], 0)["golden"]
    assert recorded["outputs"] == {"output.logits": {"shape": [2, 3], "dtype": "float32"},
                                   "output.hidden": {"shape": [2, 5, 8], "dtype": "float32"}}
    assert _json(cli_runner, [*args, "--golden", str(golden)], 0)["golden"]["action"] == "compared"
    res = cli_runner.invoke(cli, ["verify", str(tmp_path / "pair.pth"), "--model", spec, "--golden", str(golden)])
    assert res.exit_code == 1 and "pass that file with --input" in res.stderr


class _Boom:
    def __reduce__(self) -> Any:
        return (exec, ("open('PWNED', 'w').write('x')",))


def test_an_input_file_is_read_the_safe_way(cli_runner: Any, fixtures_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"x": torch.zeros(1, 13), "y": _Boom()}, tmp_path / "evil.pt")
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC,
                                  "--reference", str(fixtures_dir / "mlp_single.pth"), "--input", str(tmp_path / "evil.pt")])
    assert res.exit_code == 1 and "exec" in res.stderr and not (tmp_path / "PWNED").exists()
    torch.save([torch.zeros(1, 13)], tmp_path / "list.pt")
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC,
                                  "--reference", str(fixtures_dir / "mlp_single.pth"), "--input", str(tmp_path / "list.pt")])
    assert res.exit_code == 1 and "holds a list; an input file holds a tensor (model(x)), or a dict" in res.stderr


def test_input_tensors_from_the_library(fixtures_dir: Path) -> None:
    x = torch.randn(3, 13)
    report = ckptfix.verify(fixtures_dir / "mlp_dp.pth", MLP_SPEC, reference=fixtures_dir / "mlp_single.pth", inputs=x)
    (row,) = report.forward["against"]
    assert report.ok and row["input"]["file"] == "given tensors" and row["input"]["tensors"] == \
        {"": {"shape": [3, 13], "dtype": "float32"}}
    with pytest.raises(ckptfix.CkptfixError, match="--input gives the tensors themselves; drop --input-shape"):
        ckptfix.verify(fixtures_dir / "mlp_dp.pth", MLP_SPEC, reference=fixtures_dir / "mlp_single.pth", inputs=x,
                       input_shape=(1, 13))


# --- golden outputs ---

def test_golden_outputs_are_recorded_once_then_compared(cli_runner: Any, fixtures_dir: Path, tmp_path: Path) -> None:
    golden = tmp_path / "golden.safetensors"
    args = [str(fixtures_dir / "mlp_ddp.pth"), "--model", MLP_SPEC, "--golden", str(golden)]
    res = cli_runner.invoke(cli, ["verify", *args, "--input-shape", "4,13"])
    assert res.exit_code == 0 and f"golden: recorded output float32 4x1 to {golden} (input 4x13 float, seed 1234)" \
        in res.stdout, res.output
    with safe_open(golden, "pt") as f:
        info = json.loads(f.metadata()[META_KEY])
        assert list(f.keys()) == ["output"]
    assert info["input"] == {"shape": [4, 13], "dtype": "float", "range": None, "seed": 1234}
    assert (info["dtype"], info["checkpoint"]) == ("float32", "mlp_ddp.pth") and len(info["checkpoint_sha256"]) == 64
    recorded = load_file(golden)["output"]
    # compared on the recorded input (no --input-shape needed), within the recorded-value tolerance
    report = _json(cli_runner, args, 0)
    (row,) = report["forward"]["against"]
    assert (row["what"], row["tolerance"], row["input_shape"], row["max_abs_diff"]) == ("golden", "recorded", [4, 13], 0.0)
    assert report["golden"] == {"path": str(golden), "action": "compared", "input": info["input"],
                                "outputs": {"output": {"shape": [4, 1], "dtype": "float32"}}}
    # another file with other weights: exit 3
    sd = ckptfix.load(fixtures_dir / "mlp_ddp.pth")
    sd["4.bias"] += 0.01
    torch.save(sd, tmp_path / "changed.pth")
    bad = _json(cli_runner, [str(tmp_path / "changed.pth"), *args[1:]], 3)
    assert bad["failures"] == [f"forward output differs from the golden (max abs diff {bad['forward']['max_abs_diff']:.3g}, "
                               "atol=1e-06, rtol=1e-05: recorded-value default for float32)"]
    # a failing checkpoint records nothing, even with --record-golden
    sd["2.bias"][0] = float("nan")
    torch.save(sd, tmp_path / "nan.pth")
    skipped = _json(cli_runner, [str(tmp_path / "nan.pth"), *args[1:], "--record-golden"], 3)
    assert skipped["golden"]["action"] == "skipped" and torch.equal(load_file(golden)["output"], recorded)
    assert f"golden outputs not recorded to {golden}: the checkpoint failed verification" in skipped["notes"]
    # --record-golden writes it again, from this run
    again = _json(cli_runner, [str(tmp_path / "changed.pth"), *args[1:], "--record-golden"], 0)
    assert again["golden"]["action"] == "recorded" and again["golden"]["input"]["shape"] == [1, 13]


@pytest.mark.parametrize("options, message", [
    (["--input-shape", "2,13"], "the golden outputs were recorded for input 4x13 float, seed 1234; --input-shape 2,13 "
                                "asks for another input: drop it, or record the golden file again (--record-golden)"),
    (["--dtype", "fp16"], "recorded with the model in float32, but it runs in float16 here; pass --dtype fp32"),
    (["--no-forward"], None),
])
def test_golden_refuses_another_input_or_dtype(options: list[str], message: str | None, cli_runner: Any,
                                               fixtures_dir: Path, tmp_path: Path) -> None:
    golden = tmp_path / "golden.safetensors"
    base = [str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--golden", str(golden)]
    assert cli_runner.invoke(cli, ["verify", *base, "--input-shape", "4,13"]).exit_code == 0
    res = cli_runner.invoke(cli, ["verify", *base, *options, "--json"])
    if message is None:
        report = json.loads(res.stdout)
        assert res.exit_code == 0 and report["golden"]["action"] == "skipped"
        assert report["notes"][-1].endswith("--golden ignored")
    else:
        assert res.exit_code == 1 and message in res.stderr and message in json.loads(res.stdout)["error"]


def test_record_golden_needs_golden(cli_runner: Any, fixtures_dir: Path) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--record-golden"])
    assert res.exit_code == 2 and "--record-golden needs --golden FILE" in res.output
    with pytest.raises(ckptfix.CkptfixError, match="record_golden needs golden=PATH"):
        ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, record_golden=True)


def test_a_file_that_is_not_golden_outputs_is_refused(fixtures_dir: Path) -> None:
    with pytest.raises(ckptfix.errors.FormatError, match="has no 'ckptfix.golden' metadata: not golden outputs"):
        ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, golden=fixtures_dir / "mlp_safetensors.safetensors")


# --- directories: sharded and DCP checkpoints with the forward check ---

@pytest.mark.parametrize("layout", ["sharded-safetensors", "sharded-pth", "dcp"])
def test_directory_checkpoints_verify_with_the_forward_check(layout: str, cli_runner: Any, fixtures_dir: Path,
                                                             tmp_path: Path) -> None:
    original = fixtures_dir / "mlp_ddp.pth"
    path = tmp_path / "run"
    kwargs = {"format": "dcp"} if layout == "dcp" else {"max_shard_size": "1KB", "format": layout.split("-")[1]}
    ckptfix.convert(original, path, **kwargs)
    golden = tmp_path / "golden.safetensors"
    args = [str(path), "--model", MLP_SPEC, "--reference", str(original), "--golden", str(golden)]
    first = _json(cli_runner, args, 0)
    assert first["format"] == layout and first["sha256"] is None  # a directory has no one hash
    assert first["forward"]["max_abs_diff"] == 0.0 and first["golden"]["action"] == "recorded"
    second = _json(cli_runner, args, 0)
    assert [r["what"] for r in second["forward"]["against"]] == ["golden", "reference"]
    assert all(r["max_abs_diff"] == 0.0 for r in second["forward"]["against"])
    # and as the reference itself
    assert _json(cli_runner, [str(original), "--model", MLP_SPEC, "--reference", str(path)], 0)["forward"]["ok"]


# --- the text report ---

def test_dtype_mismatches_are_grouped_by_module(cli_runner: Any, fixtures_dir: Path) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_amp.pth"), "--model", MLP_SPEC])
    assert res.exit_code == 0
    assert ("  dtype mismatch (6) (warning: cast on load):\n"
            "    checkpoint float16, model float32 (6):\n"
            "      0.{weight, bias}\n"
            "      2.{weight, bias}\n"
            "      4.{weight, bias}\n") in res.stdout


@pytest.mark.parametrize("text", ["", "5", "3,1", "a,b", "1,2,3"])
def test_input_range_is_low_high(text: str) -> None:
    from ckptfix.model.inputs import parse_range

    with pytest.raises(ckptfix.CkptfixError, match="expected LOW,HIGH with LOW < HIGH"):
        parse_range(text)
    assert parse_range("0,30522") == (0.0, 30522.0)


@pytest.mark.parametrize("recipe, first", [
    ({"shape": [2, 3], "dtype": "float", "range": None, "seed": 1234}, "the fixtures' randn"),
    ({"shape": [2, 3], "dtype": "long", "range": [0, 10], "seed": 7}, torch.int64),
    ({"shape": [2, 3], "dtype": "int", "range": [5, 6], "seed": 7}, torch.int32),
    ({"shape": [4], "dtype": "float", "range": [-1, 1], "seed": 7}, torch.float32),
])
def test_a_recorded_recipe_makes_the_same_input_again(recipe: dict, first: Any) -> None:
    from ckptfix.model.forward import seeded_input
    from ckptfix.model.inputs import InputRecipe

    (x,), _ = InputRecipe.from_dict(recipe).make()
    (y,), _ = InputRecipe.from_dict(json.loads(json.dumps(InputRecipe.from_dict(recipe).to_dict()))).make()
    assert torch.equal(x, y) and list(x.shape) == recipe["shape"]
    if recipe["range"] is None:
        assert torch.equal(x, seeded_input((2, 3), 1234))
    else:
        assert x.dtype == first and bool((x >= recipe["range"][0]).all() and (x < recipe["range"][1]).all())


# --- a damaged file: verify's fix command must not launder it ---

@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free", "streamed"])
def test_the_fix_command_for_a_damaged_file_is_refused(tmp_path: Path, ext: str, torch_free: str, cli_runner: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify --exact`` fails a file whose CRC-32s don't match its bytes and suggests a convert command (for
    the wrapper prefix); that command refuses the file instead of writing a fresh one that would pass."""
    monkeypatch.setenv("CKPTFIX_TORCH_FREE", torch_free)
    net = build_model(MLP_SPEC)
    good = tmp_path / "good.pth"
    torch.save({"model": {f"module.{k}": v for k, v in net.state_dict().items()}}, good)
    raw = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as z:
        member = z.getinfo("good/data/0")
    start = member.header_offset + 30 + len(member.filename) + int.from_bytes(raw[member.header_offset + 28:
                                                                                  member.header_offset + 30], "little")
    raw[start + 3] ^= 0xFF
    bad = tmp_path / "bad.pth"
    bad.write_bytes(bytes(raw))
    report = _json(cli_runner, [str(bad), "--model", MLP_SPEC, "--exact"], 3)
    assert any("CRC-32" in f for f in report["failures"]), report["failures"]
    command = shlex.split(report["convert_command"])
    assert command[:2] == ["ckptfix", "convert"]
    out = tmp_path / f"fixed{ext}"
    command[3] = str(out)
    res = cli_runner.invoke(cli, command[1:])
    assert res.exit_code == 1 and res.output.startswith(f"Error: {bad}: record data/0 "), res.output
    assert not out.exists()
