"""The table tests/test_readme.py runs the recipes of README.md and docs/*.md by: for each command (as
the shell splits it, comment dropped) or Python example (its first line that isn't an import), the files
it names — placeholder → how it is made here (MAKERS: a committed fixture, a model built and saved, the
real Lightning sharded run) — the exit code it must end with and what else its result must show.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.cli import cli
from tests.remote_sources import masked

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------- the files they need


MYPKG = '''\
"""The README's `mypkg.models:build`: train.py's MLP shape, widths and outputs as arguments."""
from torch import nn


def build(num_classes=1, dims=(16, 32), name="mlp"):
    return nn.Sequential(nn.Linear(13, dims[0]), nn.ReLU(), nn.Linear(dims[0], dims[1]), nn.ReLU(),
                         nn.Linear(dims[1], num_classes))
'''
MYPKG_NLP = '''\
"""The README's `mypkg.nlp:build`: token IDs in (a BERT-sized vocabulary), model(**batch) works too."""
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self, vocab=30522, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.head(h)


def build():
    return Tagger()
'''
NET_PY = '''\
"""The README's `path/to/net.py:build`."""
from torch import nn


def build():
    return nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
'''


def _mypkg_build(source: str = MYPKG, **kw: Any) -> nn.Module:
    ns: dict[str, Any] = {}
    exec(source, ns)  # the module the recipes import, built here for its state dicts
    torch.manual_seed(0)
    return ns["build"](**kw)


@functools.lru_cache(maxsize=None)
def _resnet18(num_classes: int) -> dict[str, torch.Tensor]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.train()
    with torch.no_grad():  # one forward in train mode: BatchNorm's running stats and num_batches_tracked move
        model(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
    return model.state_dict()


def _save(obj: Any, dst: Path) -> None:
    if dst.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(dict(obj), dst)
    else:
        torch.save(obj, dst)


def _prefixed(prefix: str, sd: dict) -> dict:
    return {prefix + k: v for k, v in sd.items()}


def _sharded_lightning(dst: Path, request: pytest.FixtureRequest) -> None:
    shutil.copytree(request.getfixturevalue("sharded_run").dirs["ModelParallelStrategy"], dst)


def _fixture(name: str) -> Callable[[Path, Any], None]:
    def make(dst: Path, request: Any) -> None:
        src = ROOT / "fixtures" / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
    return make


def _quant_release(dst: Path, request: Any) -> None:
    """llmcompressor's FP8 block release (fixtures/quant), its weights and config only."""
    dst.mkdir()
    for name in ("model.safetensors", "config.json"):
        shutil.copyfile(ROOT / "fixtures" / "quant" / "llmcompressor" / "fp8_block" / name, dst / name)


def _on_s3(fixture: str, url: str) -> Callable[[Path, Any], None]:
    """The fixture uploaded to ``url`` on tests/remote_servers.py's S3 server (moto's, on 127.0.0.1; the
    ``s3_server`` fixture, which points AWS_ENDPOINT_URL and the keys at it for the run)."""
    def make(dst: Path, request: Any) -> None:
        server = request.getfixturevalue("s3_server")
        bucket, _, key = url.removeprefix("s3://").partition("/")
        client = server.client()
        client.create_bucket(Bucket=bucket)
        client.upload_file(str(ROOT / "fixtures" / fixture), bucket, key)
    return make


def _same_as_local(out: Path, fixture: str) -> bool:
    """``out`` (converted from a URL) holds the bytes a convert of the local fixture writes, but the lineage (which
    names the source: a URL's identity is not the local file's)."""
    local = out.with_name("local" + out.suffix)
    ckptfix.convert(ROOT / "fixtures" / fixture, local)
    return masked(out) == masked(local)


def _bucket(name: str) -> Callable[[Path, Any], None]:
    """An empty bucket on tests/remote_servers.py's S3 server (the ``s3_server`` fixture points AWS_* at it)."""
    def make(dst: Path, request: Any) -> None:
        request.getfixturevalue("s3_server").client().create_bucket(Bucket=name)
    return make


def _s3_object(url: str) -> bytes:
    """An object's bytes, from the S3 server the environment names (the ``s3_server`` fixture's)."""
    import boto3

    bucket, _, key = url.removeprefix("s3://").partition("/")
    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def _uploaded_is_the_local_convert(tmp: Path, url: str) -> bool:
    ckptfix.convert(tmp / "ddp_run.pth", tmp / "local.safetensors")
    return _s3_object(url) == (tmp / "local.safetensors").read_bytes()


def _hf_dir(dst: Path, request: Any) -> None:
    ckptfix.convert(ROOT / "fixtures" / "mlp_single.pth", dst, max_shard_size=1000)  # 3 shards + index
    assert (dst / "model.safetensors.index.json").is_file()


def _deepspeed(dst: Path, request: pytest.FixtureRequest) -> None:
    """A 2-rank ZeRO-2 bf16 run's checkpoint directory (``latest``, ``global_step5/``), as fixtures/deepspeed_layouts.py
    writes it with torch alone (tests/formats/test_deepspeed.py holds it to deepspeed's own files)."""
    train = request.getfixturevalue("train")
    train._layouts()._deepspeed_layouts().save_deepspeed(train, "mlp", dst, stage=2, precision="bf16")


def _fp8_release(dst: Path, request: Any) -> None:
    """A save_pretrained directory in DeepSeek's block-FP8 layout: an F8_E4M3 weight beside its F32
    ``weight_scale_inv`` (one scale per 128x128 block, the grid ceil-sized), ``quantization_config`` in config.json."""
    dst.mkdir()
    weight = torch.linspace(-1, 1, 160 * 64).reshape(160, 64)
    _save({"proj.weight": (weight * 4).to(torch.float8_e4m3fn), "proj.weight_scale_inv": torch.full((2, 1), 0.25),
           "norm.weight": torch.ones(64)}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))


def _dequantized(tmp: Path, res: Any) -> bool:
    """One plain bfloat16 weight for the group, no scale, and config.json without quantization_config."""
    sd = _load(tmp / "bf16_release" / "model.safetensors")
    config = json.loads((tmp / "bf16_release" / "config.json").read_text())
    return set(sd) == {"proj.weight", "norm.weight"} and sd["proj.weight"].dtype == torch.bfloat16 \
        and "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def _text(content: str | bytes) -> Callable[[Path, Any], None]:
    def make(dst: Path, request: Any) -> None:
        dst.write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def _tensors(build: Callable[[], Any]) -> Callable[[Path, Any], None]:
    return lambda dst, request: _save(build(), dst)


def _noisy_mlp() -> dict:
    sd = torch.load(ROOT / "fixtures" / "mlp_single.pth", weights_only=True)
    return {k: v + 5e-7 for k, v in sd.items()}


def _ec_key(dst: Path, request: Any) -> None:
    """docs/signing.md's key.pem (EC P-256), and its pub.pem beside it."""
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    dst.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    dst.with_name("pub.pem").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                       serialization.PublicFormat.SubjectPublicKeyInfo))


def _signed(dst: Path, request: Any) -> None:
    """mypkg's MLP (the mlp_single fixture) as safetensors, signed with key.pem beside it (its pub.pem too)."""
    _ec_key(dst.with_name("key.pem"), request)
    ckptfix.convert(ROOT / "fixtures" / "mlp_single.pth", dst, sign=str(dst.with_name("key.pem")))


MAKERS: dict[str, Callable[[Path, Any], None]] = {
    **{f"fixture:{p.name}": _fixture(p.name) for p in (ROOT / "fixtures").iterdir() if p.name.startswith("mlp_")},
    "dir": lambda dst, request: dst.mkdir(),
    "mypkg": lambda dst, request: (dst.mkdir(), (dst / "__init__.py").write_text(""),
                                   (dst / "models.py").write_text(MYPKG), (dst / "nlp.py").write_text(MYPKG_NLP)),
    "net.py": _text(NET_PY),
    "existing file": _text(b"an older output\n"),
    # builtins.exec and posix.system pickled by reference (GLOBAL), as the README's example names them
    "unsafe": _tensors(lambda: {"weight": torch.zeros(1), "run": exec, "shell": os.system}),
    "hf sharded": _hf_dir,
    "block fp8 release": _fp8_release,
    "ec key": _ec_key,
    "signed mypkg MLP": _signed,
    "quant: fp8 block release": _quant_release,
    "quant: its bf16 original": lambda dst, request: shutil.copyfile(
        ROOT / "fixtures" / "quant" / "original" / "model.safetensors", dst),
    "on s3: mlp_ddp.pth": _on_s3("mlp_ddp.pth", "s3://my-bucket/runs/ddp_run.pth"),
    "s3 bucket: my-bucket": _bucket("my-bucket"),
    "deepspeed zero-2 bf16": _deepspeed,
    "lightning sharded": _sharded_lightning,
    "mlp, noisy": _tensors(_noisy_mlp),
    "mlp_ddp as safetensors": _tensors(lambda: {k.removeprefix("module."): v for k, v in
                                                torch.load(ROOT / "fixtures" / "mlp_ddp.pth", weights_only=True).items()}),
    "resnet18 10": _tensors(lambda: _resnet18(10)),
    "resnet18 10 ddp": _tensors(lambda: _prefixed("module.", _resnet18(10))),
    "resnet18 1000": _tensors(lambda: _resnet18(1000)),
    "resnet18 1000 ddp": _tensors(lambda: _prefixed("module.", _resnet18(1000))),
    "mypkg dims=[64,128]": _tensors(lambda: _mypkg_build(dims=[64, 128]).state_dict()),
    "mypkg's MLP": _tensors(lambda: _mypkg_build().state_dict()),
    "mypkg, ddp": _tensors(lambda: _prefixed("module.", _mypkg_build().state_dict())),
    "mypkg in fp16": _tensors(lambda: {k: v.half() for k, v in _mypkg_build().state_dict().items()}),
    "mypkg.nlp": _tensors(lambda: _mypkg_build(MYPKG_NLP).state_dict()),
    "mypkg.nlp, ddp": _tensors(lambda: _prefixed("module.", _mypkg_build(MYPKG_NLP).state_dict())),
    "a batch for mypkg.nlp": _tensors(lambda: {"input_ids": torch.randint(0, 30522, (2, 16), generator=torch.Generator().manual_seed(0)),
                                               "attention_mask": torch.ones(2, 16)}),
    "mypkg num_classes=12 in fp16": _tensors(lambda: {k: v.half() for k, v in _mypkg_build(num_classes=12).state_dict().items()}),
    "mypkg num_classes=12, lightning": _tensors(lambda: {
        "epoch": 9, "global_step": 90, "pytorch-lightning_version": "2.6.6",
        "state_dict": _prefixed("model.", _mypkg_build(num_classes=12).state_dict())}),
    "10 tensors of mypkg num_classes=10, other names": _tensors(lambda: {
        f"features.{i}.{k.split('.')[-1]}": v for i, (k, v) in enumerate(_mypkg_build(num_classes=10).state_dict().items())}),
}


# ------------------------------------------------------------------------------------- the table


def _cuda0() -> int:
    return 0 if torch.cuda.device_count() >= 1 else 1  # 1: cuda:0 asked for on a machine without it


def _load(path: Path, safetensors: bool = False) -> dict:
    if safetensors or path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


Check = Callable[[Path, Any], bool]  # (run directory, CLI result / shell result / Python namespace) → as documented?


def _keys_of(path: str, want: Callable[[list[str]], bool]) -> Check:
    return lambda tmp, res: want(list(_load(tmp / path)))


def _output_has(text: str) -> Check:
    return lambda tmp, res: text in res.output


def _json(field: str, value: Any) -> Check:
    return lambda tmp, res: json.loads(res.stdout)[field] == value


def _safetensors_at(path: str) -> Check:
    return lambda tmp, res: (tmp / path).read_bytes()[8:9] == b"{" and len(_load(tmp / path, safetensors=True)) == 6


def _dtypes(path: str, want: set) -> Check:
    return lambda tmp, res: {t.dtype for t in _load(tmp / path).values()} == want


def _hashed(tmp: Path, res: Any) -> bool:
    (out,) = (tmp / "release").iterdir()
    return bool(re.fullmatch(r"resnet18-[0-9a-f]{8}\.pth", out.name))


def _half(tmp: Path, res: Any) -> bool:
    sd = _load(tmp / "half.safetensors")
    return sd["conv1.weight"].dtype == torch.float16 and sd["bn1.num_batches_tracked"].dtype == torch.int64


def _golden_again(tmp: Path, res: Any) -> bool:
    """The first run recorded golden.safetensors; the same command again compares with it."""
    from click.testing import CliRunner

    again = CliRunner().invoke(cli, ["verify", "release.pth", "--model", "mypkg.models:build", "--golden",
                                     "golden.safetensors"])
    return (tmp / "golden.safetensors").is_file() and again.exit_code == 0 and "golden" in again.output


def _resumable_ckpt(tmp: Path, res: Any) -> bool:
    ckpt = torch.load(tmp / "resume.ckpt", weights_only=True)
    return "optimizer_states" in ckpt and list(ckpt["state_dict"])[0] == "model.0.weight"


@dataclass(frozen=True)
class Entry:
    """How one README recipe is run: the files it names (placeholder → MAKERS key), the exit code it
    must end with (an int, or a function of this machine), and what else its result must show."""

    files: dict[str, str] = field(default_factory=dict)
    code: int | Callable[[], int] = 0
    check: Check | None = None
    make_args: tuple[str, ...] = ()  # make: extra arguments keeping it offline and out of the tree
    env_path: bool = False  # PYTHONPATH gets the run directory (mypkg)


MLP_DDP = {"ddp_run.pth": "fixture:mlp_ddp.pth"}
LAST = {"last.ckpt": "fixture:mlp_lightning.ckpt"}
SHARDED = {"checkpoints/epoch=2-step=3.ckpt": "lightning sharded"}
MYPKG_FILES = {"mypkg": "mypkg"}
DEEPSPEED = {"ckpt": "deepspeed zero-2 bf16"}
QUANT_FILES = {"release": "quant: fp8 block release", "bf16": "dir", "bf16/model.safetensors": "quant: its bf16 original"}

RECIPES: dict[str, Entry] = {
    # Set up
    "make demo": Entry(make_args=("-o", ".venv/.installed")),  # DEMO_DIR is set to the run directory
    "make test": Entry(make_args=("-n", "-o", ".venv/.installed", "-o", ".venv-other-torch/.installed")),  # dry run:
    # it would run this very test
    # README: Common recipes (the others it shows are in the docs' tables below)
    "ckptfix verify model.safetensors --model torchvision:resnet18 --arg num_classes=10 --reference run.pth": Entry(
        {"model.safetensors": "resnet18 10", "run.pth": "resnet18 10 ddp"}, check=_output_has("max abs diff 0")),
    "ckptfix scan downloaded.pth": Entry({"downloaded.pth": "unsafe"}, code=3, check=_output_has("builtins.exec")),
    "ckptfix inspect s3://my-bucket/runs/ddp_run.pth --json": Entry(
        {"s3": "on s3: mlp_ddp.pth"}, check=lambda tmp, res: json.loads(res.stdout)["wrappers"] == ["module"]
        and 0 < json.loads(res.stdout)["bytes_fetched"] < 64 * 1024),
    "ckptfix convert s3://my-bucket/runs/ddp_run.pth model.safetensors": Entry(
        {"s3": "on s3: mlp_ddp.pth"}, check=lambda tmp, res: _same_as_local(tmp / "model.safetensors", "mlp_ddp.pth")),


    "ckptfix convert ddp_run.pth s3://my-bucket/runs/model.safetensors": Entry(
        {**MLP_DDP, "s3": "s3 bucket: my-bucket"},
        check=lambda tmp, res: res.stdout.startswith("Wrote s3://my-bucket/runs/model.safetensors (safetensors)")
        and _uploaded_is_the_local_convert(tmp, "s3://my-bucket/runs/model.safetensors")),
    'report = ckptfix.load_into(model, "ddp_run.pth")': Entry(
        {"ddp_run.pth": "fixture:mlp_ddp.pth", "ddp_compiled.pth": "fixture:mlp_ddp_compile.pth"},
        check=lambda tmp, ns: ns["report"].fix == "strip module." and list(ns["sd"])[0] == "0.weight"
        and (tmp / "model.safetensors").is_file()),
    # docs/convert.md
    "ckptfix inspect ddp_run.pth": Entry(MLP_DDP, check=_output_has("wrappers:       module")),
    "ckptfix inspect ddp_run.pth --json": Entry(MLP_DDP, check=_json("wrappers", ["module"])),
    "ckptfix convert ddp_run.pth model.safetensors": Entry(MLP_DDP, check=_keys_of("model.safetensors", lambda k: "0.weight" in k)),
    "ckptfix convert ddp_run.pth model.pth --to single": Entry(MLP_DDP, check=_keys_of("model.pth", lambda k: k[0] == "0.weight")),
    "ckptfix convert model.pth for_ddp.pth --to ddp": Entry({"model.pth": "fixture:mlp_single.pth"},
                                                           check=_keys_of("for_ddp.pth", lambda k: k[0] == "module.0.weight")),
    "ckptfix convert gpu.pth cpu.pth --map-location cpu": Entry({"gpu.pth": "fixture:mlp_cuda0.pth"}),
    "ckptfix convert mp.pth out.pth --map-location cuda:1=cuda:0 --map-location cuda:0=cuda:0":
        Entry({"mp.pth": "fixture:mlp_model_parallel.pth"}, code=_cuda0),
    "ckptfix convert train.ckpt resume.pth --keep-extra": Entry(
        {"train.ckpt": "fixture:mlp_train_ckpt.pth"}, check=_keys_of("resume.pth", lambda k: "optimizer_state_dict" in k)),
    "ckptfix convert lightning.ckpt net.pth --strip-prefix model.": Entry(
        {"lightning.ckpt": "fixture:mlp_lightning.ckpt"}, check=_keys_of("net.pth", lambda k: k[0] == "0.weight")),
    "ckptfix convert run.pth weights.bin --format safetensors --force": Entry(
        {"run.pth": "fixture:mlp_ddp.pth", "weights.bin": "existing file"}, check=_safetensors_at("weights.bin")),
    "ckptfix convert model.pth half.safetensors --dtype fp16": Entry({"model.pth": "resnet18 10"}, check=_half),
    "ckptfix convert fp8_release/ half.safetensors --dtype fp16": Entry(  # the group kept as stored, the rest cast
        {"fp8_release": "block fp8 release"}, check=lambda tmp, res: "kept 1 quantized group (fp8-block) as stored" in
        res.output and _dtypes("half.safetensors", {torch.float8_e4m3fn, torch.float32, torch.float16})(tmp, res)),
    "ckptfix convert fp8_release/ bf16_release/ --dequantize --max-shard-size 5GB": Entry(
        {"fp8_release": "block fp8 release"}, check=_dequantized),
    r"ckptfix convert old.pth new.pth --rename layer4\.(.*)=stage4.\1": Entry(
        {"old.pth": "resnet18 10"}, check=_keys_of("new.pth", lambda k: "stage4.0.conv1.weight" in k and "layer4.0.conv1.weight" not in k)),
    "ckptfix convert vgg_weights.pth mine.pth --by-order --model mypkg.models:build --arg num_classes=10": Entry(
        {"vgg_weights.pth": "10 tensors of mypkg num_classes=10, other names", **MYPKG_FILES},
        check=_keys_of("mine.pth", lambda k: k == list(_mypkg_build(num_classes=10).state_dict())), env_path=True),
    "ckptfix convert model.pth release/resnet18.pth --hash": Entry({"model.pth": "resnet18 10", "release": "dir"}, check=_hashed),
    "ckptfix convert llama.pth hf_dir/ --max-shard-size 5GB": Entry(  # one shard: model.safetensors, no index
        {"llama.pth": "fixture:mlp_single.pth"}, check=lambda tmp, res: os.listdir(tmp / "hf_dir") == ["model.safetensors"]),
    "ckptfix convert hf_dir/ consolidated.safetensors": Entry(
        {"hf_dir": "hf sharded"}, check=_keys_of("consolidated.safetensors", lambda k: len(k) == 6)),
    "ckptfix convert fsdp2_run/step_1000/ model.pth": Entry(
        {"fsdp2_run": "dir", "fsdp2_run/step_1000": "fixture:mlp_fsdp2"}, check=_keys_of("model.pth", lambda k: k[0] == "0.weight")),
    "ckptfix convert model.pth resume_dcp/ --format dcp": Entry(
        {"model.pth": "fixture:mlp_single.pth"}, check=lambda tmp, res: (tmp / "resume_dcp" / ".metadata").is_file()),
    # docs/verify.md
    "ckptfix verify run.pth --model torchvision:resnet18 --arg num_classes=10": Entry(
        {"run.pth": "resnet18 10 ddp"}, check=_output_has("strip module.")),
    "ckptfix verify run.pth --model mypkg.models:build --arg dims=[64,128] --arg name=tiny": Entry(
        {"run.pth": "mypkg dims=[64,128]", **MYPKG_FILES}, env_path=True),
    "ckptfix verify run.pth --model path/to/net.py:build --no-forward": Entry(
        {"run.pth": "fixture:mlp_ddp.pth", "path": "dir", "path/to": "dir", "path/to/net.py": "net.py"}),
    "ckptfix verify run.pth --model path/to/net.py:build --structure-only": Entry(
        {"run.pth": "fixture:mlp_ddp.pth", "path": "dir", "path/to": "dir", "path/to/net.py": "net.py"},
        check=_output_has("structure only: values not checked")),
    "ckptfix verify model.safetensors --model timm:create_model --arg model_name=resnet18 --input-shape 1,3,224,224 "
    "--reference run.pth": Entry({"model.safetensors": "resnet18 1000", "run.pth": "resnet18 1000 ddp"},
                                 check=_output_has("max abs diff 0")),
    "ckptfix verify release.pth --model torchvision:resnet18 --exact --json": Entry(
        {"release.pth": "resnet18 1000"}, check=_json("ok", True)),
    "ckptfix verify release.pth --model torchvision:resnet18 --exact --serving-device cpu": Entry(
        {"release.pth": "resnet18 1000"}, check=_output_has("devices: cpu ×")),
    "ckptfix verify half.safetensors --model mypkg.models:build --exact --dtype fp16 --reference run.pth": Entry(
        {"half.safetensors": "mypkg in fp16", "run.pth": "mypkg, ddp", **MYPKG_FILES}, env_path=True),
    "ckptfix verify bert.pth --model mypkg.nlp:build --input-shape 1,16 --input-dtype long --input-range 0,30522 "
    "--reference run.pth": Entry({"bert.pth": "mypkg.nlp", "run.pth": "mypkg.nlp, ddp", **MYPKG_FILES}, env_path=True,
                                 check=_output_has("max abs diff 0")),
    "ckptfix verify net.pth --model mypkg.nlp:build --input batch.pt --reference run.pth": Entry(
        {"net.pth": "mypkg.nlp", "batch.pt": "a batch for mypkg.nlp", "run.pth": "mypkg.nlp, ddp", **MYPKG_FILES},
        env_path=True, check=_output_has("max abs diff 0")),
    "ckptfix verify release.pth --model mypkg.models:build --golden golden.safetensors": Entry(
        {"release.pth": "mypkg's MLP", **MYPKG_FILES}, env_path=True, check=_golden_again),
    "ckptfix diff run.pth model.safetensors": Entry(
        {"run.pth": "fixture:mlp_ddp.pth", "model.safetensors": "mlp_ddp as safetensors"}, check=_output_has("identical")),
    "ckptfix verify release/": Entry({"release": "quant: fp8 block release"}, check=_output_has("quantized: 7 groups")),
    "ckptfix verify release/ --original bf16/model.safetensors": Entry(
        QUANT_FILES, check=_output_has("(ok: step bound)")),
    "ckptfix diff release/ bf16/model.safetensors --json": Entry(QUANT_FILES, check=_json("identical", True)),
    "ckptfix diff a.pth b.pth --raw --atol 1e-6 --json": Entry(
        {"a.pth": "fixture:mlp_single.pth", "b.pth": "mlp, noisy"},
        check=_json("identical", True)),
    # inline in the prose of docs/formats.md, docs/security.md, docs/verify.md
    "ckptfix convert --trust model.pt weights.safetensors": Entry(
        {"model.pt": "fixture:mlp_torchscript.pt"}, check=_safetensors_at("weights.safetensors")),
    "ckptfix convert --trust run.pth run.safetensors": Entry(
        {"run.pth": "fixture:mlp_ddp.pth"}, check=_safetensors_at("run.safetensors")),
    "ckptfix diff release/model.pth runs/best.ckpt": Entry(
        {"release": "dir", "release/model.pth": "fixture:mlp_single.pth", "runs": "dir", "runs/best.ckpt": "mlp, noisy"},
        code=3, check=_output_has("max abs diff")),
    # docs/library.md (the Python blocks: the first line that isn't an import)
    'sd = ckptfix.load("ddp_compiled.pth")': Entry({
        "ddp_compiled.pth": "fixture:mlp_ddp_compile.pth", "ddp_run.pth": "fixture:mlp_ddp.pth",
        "train.ckpt": "fixture:mlp_lightning.ckpt", "huge.pth": "fixture:mlp_single.pth"},
        check=lambda tmp, ns: ns["report"].dst.endswith("model.safetensors") and ns["ckpt"].state_dict_key == "state_dict"),
    'with torch.device("meta"):': Entry(
        {"ddp_run.pth": "fixture:mlp_ddp.pth"},
        check=lambda tmp, ns: ns["report"].fix == "strip module." and ns["net"][0].weight.device.type == "cpu"),
    'report = ckptfix.verify("run.pth", "torchvision:resnet18", model_args={"num_classes": 10},': Entry(
        {"run.pth": "resnet18 10 ddp", "orig.pth": "resnet18 10", "model.safetensors": "resnet18 10"},
        check=lambda tmp, ns: ns["report"].ok and ns["d"].identical),
    # docs/verify.md, Pre-deploy gate: the workflow's run: script, in bash -e as GitHub runs it
    "ckptfix verify release/model.safetensors --model mypkg.models:build --arg num_classes=12 --exact --dtype fp16 "
    "--reference runs/best.ckpt --golden release/golden.safetensors --json > verify.json": Entry(
        {"release": "dir", "release/model.safetensors": "mypkg num_classes=12 in fp16", "runs": "dir",
         "runs/best.ckpt": "mypkg num_classes=12, lightning", **MYPKG_FILES},
        check=lambda tmp, res: bool(re.fullmatch(r"verified [0-9a-f]{64}\n", res.stdout)), env_path=True),
    # docs/formats.md: Training checkpoints
    "ckptfix inspect last.ckpt": Entry(LAST, check=_output_has(
        "lightning checkpoint; every key starts with 'model.' (--strip-prefix model.)")),
    "ckptfix convert last.ckpt net.safetensors --strip-prefix model.": Entry(
        LAST, check=_keys_of("net.safetensors", lambda k: "0.weight" in k)),
    "ckptfix convert last.ckpt resume.ckpt --keep-extra": Entry(LAST, check=_resumable_ckpt),
    "ckptfix convert model_best.pth.tar ema.pth --select state_dict_ema": Entry(
        {"model_best.pth.tar": "fixture:mlp_timm.pth.tar"}, check=_keys_of("ema.pth", lambda k: k[0] == "0.weight")),
    "ckptfix verify last.ckpt --model mypkg.models:build": Entry(
        {**LAST, **MYPKG_FILES}, check=_output_has("strip prefix model."), env_path=True),
    # Lightning sharded directories
    "ckptfix inspect checkpoints/epoch=2-step=3.ckpt/": Entry(
        {"checkpoints": "dir", **SHARDED}, check=_output_has("layout:         lightning checkpoint")),
    "ckptfix convert checkpoints/epoch=2-step=3.ckpt/ resume.ckpt --keep-extra": Entry(
        {"checkpoints": "dir", **SHARDED}, check=_resumable_ckpt),
    "ckptfix convert checkpoints/epoch=2-step=3.ckpt/ model.safetensors": Entry(
        {"checkpoints": "dir", **SHARDED}, check=_keys_of("model.safetensors", lambda k: "model.0.weight" in k)),
    # DeepSpeed ZeRO
    "ckptfix inspect ckpt/": Entry(DEEPSPEED, check=_output_has("DeepSpeed ZeRO-2 checkpoint")),
    "ckptfix convert ckpt/ model.safetensors": Entry(DEEPSPEED, check=_dtypes("model.safetensors", {torch.float32})),
    "ckptfix convert ckpt/ hf/ --max-shard-size 5GB": Entry(  # one shard: model.safetensors, no index
        DEEPSPEED, check=lambda tmp, res: os.listdir(tmp / "hf") == ["model.safetensors"]),
    "ckptfix convert ckpt/ half.safetensors --select module": Entry(DEEPSPEED, check=_dtypes("half.safetensors", {torch.bfloat16})),
    # docs/signing.md
    "ckptfix convert ddp_run.pth model.safetensors --sign key.pem": Entry(
        {**MLP_DDP, "key.pem": "ec key"}, check=lambda tmp, res: (tmp / "model.safetensors.sig").is_file()),
    "ckptfix sign hf_dir --key key.pem": Entry(
        {"hf_dir": "hf sharded", "key.pem": "ec key"}, check=_output_has("signed hf_dir: 4 file(s)")),
    "ckptfix verify model.safetensors --model mypkg.models:build --signature model.safetensors.sig --public-key pub.pem":
        Entry({"model.safetensors": "signed mypkg MLP", **MYPKG_FILES}, env_path=True,
              check=_output_has("signature: 1 file(s) verified against model.safetensors.sig")),
    # docs/security.md: the shown `$ ckptfix inspect model.pth` and its one line of output
    "ckptfix inspect model.pth": Entry({"model.pth": "unsafe"}, code=1),
}
