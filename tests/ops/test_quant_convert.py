"""convert, load and load_into never silently change a quantized group (issue 28, item 4).

The files are written per DeepSeek-V3's block-FP8 layout: an F8_E4M3 ``weight`` and an F32 ``weight_scale_inv`` on the
ceil 128x128 grid (multiplied in, despite its name), ``quantization_config`` in config.json. The reference
dequantization is DeepSeek's own (inference/kernel.py ``weight_dequant``: each 128x128 block of ``x`` times its
``s``), written here independently of ckptfix's table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError, LoadError
from ckptfix.statedict.quant_groups import find_groups
from tests import quant_layouts

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "fixtures" / "quant"
#: the real releases (made by the publishing library) that are safetensors directories: directory -> its reference (the
#: library's own dequantization of each quantized weight, float32)
REAL_RELEASES = {name: entry["reference"] for name, entry in json.loads((REAL / "MANIFEST.json").read_text())["files"].items()
                 if name.endswith(".safetensors")}

BLOCK = 128
#: module -> weight shape: one ragged at both edges (ceil grid 2x2), one whole (1x2)
LINEARS = {"model.layers.0.mlp.up_proj": (200, 130), "model.layers.0.self_attn.q_proj": (128, 256)}
PLAIN = {"model.norm.weight": (130,), "model.embed_tokens.weight": (10, 130)}
CONFIG = {"architectures": ["Tiny"], "torch_dtype": "bfloat16",
          "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def deepseek_dequant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 inference/kernel.py ``weight_dequant``: y[block] = x[block] * s[block's row, block's column]."""
    y = torch.empty(x.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            y[rows, cols] = x[rows, cols].to(torch.float32) * s[i, j]
    return y


def block_fp8(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict in DeepSeek's layout: per block, the scale is amax / 448 and the weight is w / scale in E4M3."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for module, (rows, cols) in LINEARS.items():
        w = torch.randn(rows, cols, generator=g)
        grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        scale = torch.empty(grid)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                scale[i, j] = block.abs().max() / 448.0
                q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(torch.float8_e4m3fn)
        sd[f"{module}.weight"], sd[f"{module}.weight_scale_inv"] = q, scale
    for key, shape in PLAIN.items():
        sd[key] = torch.randn(shape, generator=g)
    return sd


def write_release(folder: Path, sd: dict[str, torch.Tensor], config: dict | None = CONFIG) -> Path:
    """A save_pretrained directory: model.safetensors and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("fp8") / "release", block_fp8())


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, to compare float8 (and NaN) bit for bit."""
    return t.reshape(-1).view(torch.uint8)


def group_keys() -> list[str]:
    return [f"{m}.{s}" for m in LINEARS for s in ("weight", "weight_scale_inv")]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("ext", ["safetensors", "pth"])
def test_dtype_keeps_groups_bit_exact(release: Path, dtype: str, ext: str, tmp_path: Path, cli_runner) -> None:
    """--dtype casts the plain floats only; every group's weight and scale is written as stored, and the report
    (text and --json) says what it kept."""
    out = tmp_path / f"out.{ext}"
    res = cli_runner.invoke(cli, ["convert", str(release / "model.safetensors"), str(out), "--dtype", dtype])
    assert res.exit_code == 0, res.output
    assert "  note: kept 2 quantized groups (fp8-block) as stored" in res.output.splitlines()
    src = load_file(str(release / "model.safetensors"))
    got = load_file(str(out)) if ext == "safetensors" else torch.load(out, weights_only=True)
    assert set(got) == set(src)
    for key in group_keys():
        assert got[key].dtype == src[key].dtype and torch.equal(raw(got[key]), raw(src[key])), key
    for key in PLAIN:
        assert torch.equal(got[key], src[key].to(DTYPES[dtype])), key
    res = cli_runner.invoke(cli, ["convert", str(release / "model.safetensors"), str(tmp_path / f"again.{ext}"),
                                  "--dtype", dtype, "--json"])
    assert "kept 2 quantized groups (fp8-block) as stored" in json.loads(res.output)["notes"]


@pytest.mark.parametrize("dtype", [None, "fp32", "bf16", "fp16"])
def test_dequantize_matches_deepseek(release: Path, dtype: str | None, tmp_path: Path, cli_runner) -> None:
    """--dequantize: one weight per group (the module's .weight) equal to DeepSeek's dequantization rounded once to
    the target dtype (default: the config's torch_dtype, bfloat16), scales gone, plain tensors as they were (cast with
    --dtype); the directory output's config.json has no quantization_config, and its torch_dtype is the written one."""
    out = tmp_path / "out"
    args = ["convert", str(release), str(out), "--dequantize", "--max-shard-size", "10MB"]
    res = cli_runner.invoke(cli, args + (["--dtype", dtype] if dtype else []))
    assert res.exit_code == 0, res.output
    want = DTYPES[dtype or "bf16"]
    assert f"dequantized 2 quantized groups (fp8-block) to {str(want).removeprefix('torch.')}" in res.output
    src = load_file(str(release / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == {f"{m}.weight" for m in LINEARS} | set(PLAIN)
    for module in LINEARS:
        reference = deepseek_dequant(src[f"{module}.weight"], src[f"{module}.weight_scale_inv"])
        assert got[f"{module}.weight"].dtype == want
        torch.testing.assert_close(got[f"{module}.weight"], reference.to(want), rtol=0, atol=0)
    for key in PLAIN:
        assert torch.equal(got[key], src[key] if dtype is None else src[key].to(want)), key
    config = json.loads((out / "config.json").read_text())
    unquantized = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    assert config == {**unquantized, "torch_dtype": str(want).removeprefix("torch.")}
    assert not (out / "hf_quant_config.json").exists()


def test_dequantize_one_file_names_the_config(release: Path, tmp_path: Path) -> None:
    """A one-file output can't carry config.json: the report says to drop its quantization_config."""
    report = ckptfix.convert(release, tmp_path / "plain.safetensors", dequantize=True, dtype="fp32")
    assert any("config.json not written" in n and "quantization_config" in n for n in report.notes), report.notes
    assert report.num_tensors == len(LINEARS) + len(PLAIN)
    assert not (tmp_path / "config.json").exists()


def _drop_scale(sd: dict) -> None:
    del sd["model.layers.0.mlp.up_proj.weight_scale_inv"]


def _orphan_scale(sd: dict) -> None:
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)


def _wrong_grid(sd: dict) -> None:
    sd["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)  # floor grid: the ragged edges unscaled


def _bad_scale(value: float):
    def spoil(sd: dict) -> None:
        sd["model.layers.0.mlp.up_proj.weight_scale_inv"][1, 1] = value
    return spoil


BROKEN = {"scale dropped": _drop_scale, "orphan scale": _orphan_scale, "wrong grid": _wrong_grid,
          "NaN scale": _bad_scale(float("nan")), "negative scale": _bad_scale(-1.0), "zero scale": _bad_scale(0.0)}
STRUCTURAL = ("scale dropped", "orphan scale", "wrong grid")  # found from the names and shapes alone


@pytest.mark.parametrize("variant", list(BROKEN))
def test_dequantize_refuses_a_broken_group(variant: str, tmp_path: Path, cli_runner) -> None:
    """A broken group is never dequantized, nor cast: exit 1 (a FormatError), the module named, nothing written."""
    sd = block_fp8()
    BROKEN[variant](sd)
    release = write_release(tmp_path / "broken", sd)
    out = tmp_path / "out.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(release), str(out), "--dequantize"])
    assert res.exit_code == 1, res.output
    assert "model.layers.0.mlp.up_proj" in res.output and not out.exists(), res.output
    with pytest.raises(FormatError, match="model.layers.0.mlp.up_proj"):
        ckptfix.load(release / "model.safetensors", dequantize=True)
    if variant in STRUCTURAL:  # --dtype keeps intact groups as stored; a broken one it can't keep whole: refused
        res = cli_runner.invoke(cli, ["convert", str(release), str(out), "--dtype", "bf16"])
        assert res.exit_code == 1 and "model.layers.0.mlp.up_proj" in res.output and not out.exists(), res.output


@pytest.mark.parametrize("storage", [torch.float8_e5m2, torch.int8], ids=["float8", "packed-int"])
def test_dtype_refuses_quantized_values_of_no_scheme(storage: torch.dtype, tmp_path: Path, cli_runner) -> None:
    """Float8 or packed-integer tensors beside scales of no known scheme: --dtype refuses in one line naming a key and
    the way out; --cast-unknown-quantized casts them (and their scales) as plain tensors."""
    sd = {"blocks.0.proj.qdata": torch.randn(4, 8).to(storage), "blocks.0.proj.qdata_scale": torch.ones(4),
          "head.weight": torch.randn(2, 8)}
    src = write_release(tmp_path / "odd", sd, config=None) / "model.safetensors"
    out = tmp_path / "out.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(src), str(out), "--dtype", "bf16"])
    assert res.exit_code == 1 and not out.exists(), res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "blocks.0.proj.qdata" in error[0] and "--cast-unknown-quantized" in error[0], res.output
    res = cli_runner.invoke(cli, ["convert", str(src), str(out), "--dtype", "bf16", "--cast-unknown-quantized"])
    assert res.exit_code == 0, res.output
    got = load_file(str(out))
    assert got["blocks.0.proj.qdata_scale"].dtype == torch.bfloat16
    assert got["blocks.0.proj.qdata"].dtype == (torch.bfloat16 if storage.is_floating_point else storage)


def test_load_dequantize_is_what_convert_writes(release: Path, tmp_path: Path) -> None:
    """ckptfix.load(dequantize=True) gives convert --dequantize's tensors; load(dtype=...) keeps the groups."""
    loaded = ckptfix.load(release / "model.safetensors", dequantize=True)
    ckptfix.convert(release, tmp_path / "out.safetensors", dequantize=True)
    written = load_file(str(tmp_path / "out.safetensors"))
    assert set(loaded) == set(written) and all(torch.equal(loaded[k], written[k]) for k in written)
    cast = ckptfix.load(release / "model.safetensors", dtype="fp16")
    src = load_file(str(release / "model.safetensors"))
    assert all(torch.equal(raw(cast[k]), raw(src[k])) for k in group_keys())
    assert all(cast[k].dtype == torch.float16 for k in PLAIN)


class Tiny(nn.Module):
    """The release's model: Linear layers (plain float weights), or with ``quantized`` float8 weights and their
    scales as parameters, as a serving stack that keeps FP8 holds them."""

    def __init__(self, quantized: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for module, (rows, cols) in LINEARS.items():
            layer = nn.Linear(cols, rows, bias=False)
            if quantized:
                layer.weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
                layer.weight_scale_inv = nn.Parameter(torch.zeros(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)),
                                                      requires_grad=False)
            self.layers[module.replace(".", "_")] = layer
        self.norm = nn.Parameter(torch.zeros(PLAIN["model.norm.weight"]))
        self.embed = nn.Embedding(*PLAIN["model.embed_tokens.weight"])

    def state_dict_keys(self) -> dict[str, str]:
        """Checkpoint key -> this model's key."""
        out = {f"{m}.{s}": f"layers.{m.replace('.', '_')}.{s}" for m in LINEARS for s in ("weight", "weight_scale_inv")}
        return out | {"model.norm.weight": "norm", "model.embed_tokens.weight": "embed.weight"}


@pytest.fixture(scope="module")
def model_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release under the model's own key names (load_into's key repair is not what is tested here)."""
    names = Tiny().state_dict_keys()
    return write_release(tmp_path_factory.mktemp("fp8m") / "r", {names[k]: v for k, v in block_fp8().items()})


def test_load_into_plain_model_refuses_without_dequantize(model_release: Path) -> None:
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoadError, match=r"layers\.model_layers_0_mlp_up_proj\.weight.*dequantize=True"):
        ckptfix.load_into(model, model_release / "model.safetensors")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_into_plain_model_dequantizes(model_release: Path, dtype: torch.dtype) -> None:
    """dequantize=True: each group into the model's plain weight, in its dtype, and the report says so."""
    model = Tiny().to(dtype)
    report = ckptfix.load_into(model, model_release / "model.safetensors", dequantize=True)
    assert any(n.startswith("dequantized 2 quantized groups (fp8-block)") for n in report.notes), report.notes
    src = load_file(str(model_release / "model.safetensors"))
    for module in LINEARS:
        name = f"layers.{module.replace('.', '_')}"
        want = deepseek_dequant(src[f"{name}.weight"], src[f"{name}.weight_scale_inv"]).to(dtype)
        assert torch.equal(model.get_submodule(name).weight.detach(), want), module


def test_load_into_quantized_model_loads_as_stored(model_release: Path) -> None:
    """A model holding float8 weights and their scales gets them bit-exact, dequantize or not."""
    src = load_file(str(model_release / "model.safetensors"))
    for dequantize in (False, True):
        model = Tiny(quantized=True)
        report = ckptfix.load_into(model, model_release / "model.safetensors", dequantize=dequantize)
        assert not any("dequantized" in n for n in report.notes)
        state = model.state_dict()
        assert all(torch.equal(raw(state[k]), raw(v)) for k, v in src.items())


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, quant_layouts.Built]]:
    """Every scheme's group as its publisher lays it out (tests/quant_layouts), each a save_pretrained directory."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for case in quant_layouts.CASES:
        built = quant_layouts.build(case)
        out[case] = (write_release(root / case, built.state_dict, built.config), built)
    return out


@pytest.mark.parametrize("case", list(quant_layouts.CASES))
def test_every_scheme_kept_by_dtype_and_dequantized(case: str, layouts: dict, tmp_path: Path) -> None:
    """Per scheme: --dtype bf16 writes the group's tensors bit-exact (the report names the scheme); --dequantize
    --dtype fp32 writes the publisher's dequantization (within float32's rounding), no companion left."""
    release, built = layouts[case]
    scheme = quant_layouts.CASES[case][1]
    report = ckptfix.convert(release, tmp_path / "cast.safetensors", dtype="bf16")
    assert f"kept 1 quantized group ({scheme}) as stored" in report.notes, report.notes
    cast = load_file(str(tmp_path / "cast.safetensors"))
    (group,) = find_groups(quant_layouts.infos(built.state_dict), built.config).groups
    quantized = set(group.keys)
    for key in quantized:
        assert cast[key].dtype == built.state_dict[key].dtype and torch.equal(raw(cast[key]), raw(built.state_dict[key]))
    ckptfix.convert(release, tmp_path / "plain.safetensors", dequantize=True, dtype="fp32")
    plain = load_file(str(tmp_path / "plain.safetensors"))
    assert set(plain) == set(built.state_dict) - quantized | {group.dequantized_key}
    torch.testing.assert_close(plain[group.dequantized_key], built.reference[group.module].to(torch.float32).reshape(
        plain[group.dequantized_key].shape))


@pytest.mark.parametrize("release", sorted(REAL_RELEASES))
def test_real_release_dequantized_as_its_library_does(release: str, tmp_path: Path, cli_runner) -> None:
    """A release the publishing library wrote (fixtures/quant): --dequantize into a directory equals the library's own
    dequantization (reference.safetensors) rounded to the target dtype, config.json loses quantization_config;
    --dtype keeps every quantized tensor bit-exact."""
    src = REAL / release  # (the file: its directory holds reference.safetensors too; config.json is read beside it)
    reference = load_file(str(REAL / REAL_RELEASES[release]))
    for dtype, rtol in (("fp32", 1.3e-6), ("bf16", 2 ** -8)):
        out = tmp_path / f"plain_{dtype}"
        res = cli_runner.invoke(cli, ["convert", str(src), str(out), "--dequantize", "--dtype", dtype,
                                      "--max-shard-size", "5GB"])
        assert res.exit_code == 0, res.output
        got = load_file(str(out / "model.safetensors"))
        assert set(reference) <= set(got) and not any("scale" in k or "packed" in k for k in got), sorted(got)
        for key, want in reference.items():
            assert got[key].dtype == DTYPES[dtype]
            # a library that dequantizes in the model's bf16 or fp16 (compressed-tensors' NVFP4, AutoAWQ's GEMM) is
            # matched within bf16's rounding, as tests/statedict/test_quant_real.py does
            low = any(torch.equal(want, want.to(half).float()) for half in (torch.bfloat16, torch.float16))
            within = max(rtol, 2 ** -8 if low else 0)
            torch.testing.assert_close(got[key].float(), want.float(), rtol=within, atol=0)
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        assert not (out / "hf_quant_config.json").exists()
    report = ckptfix.convert(src, tmp_path / "cast.safetensors", dtype="bf16")
    stored, cast = load_file(str(src)), load_file(str(tmp_path / "cast.safetensors"))
    config = json.loads((src.parent / "config.json").read_text())
    layout = find_groups(quant_layouts.infos(stored), config)
    assert len(layout.groups) == len(reference) and f"kept {len(reference)} quantized groups" in " ".join(report.notes)
    for key in stored:
        if key in layout.plain and stored[key].is_floating_point():
            assert cast[key].dtype == torch.bfloat16, key
        else:
            assert torch.equal(raw(cast[key]), raw(stored[key])), key

