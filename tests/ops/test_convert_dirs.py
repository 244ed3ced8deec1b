"""convert/inspect/load wired to directory formats: HF sharded in and out, DCP in and out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError


def _tensors_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt, index", [("safetensors", "model.safetensors.index.json"),
                                        ("pth", "pytorch_model.bin.index.json")])
def test_shard_and_back(fmt: str, index: str, tmp_path: Path, fixtures_dir: Path, cli_runner) -> None:
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_compile_ddp.pth"), str(tmp_path / "shards"),
                                  "--max-shard-size", "1KB", "--format", fmt, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["bytes_written"] == sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    assert (tmp_path / "shards" / index).exists()
    info = ckptfix.inspect(tmp_path / "shards")
    assert info.format == f"sharded-{fmt}" and info.num_tensors == 6
    back = ckptfix.convert(tmp_path / "shards", tmp_path / "one.pth")
    assert back.streamed
    assert _tensors_equal(torch.load(tmp_path / "one.pth", weights_only=True), ckptfix.load(fixtures_dir / "mlp_compile_ddp.pth"))
    assert _tensors_equal(ckptfix.load(tmp_path / "shards" / index), ckptfix.load(tmp_path / "shards"))


def test_dcp_in_and_out(tmp_path: Path, fixtures_dir: Path, manifest: dict, train) -> None:
    # FSDP2's DCP directory → one file that reproduces the trained model
    ckptfix.convert(fixtures_dir / "mlp_fsdp2", tmp_path / "fsdp2.safetensors")
    model = train.mlp()
    ckptfix.load_into(model, tmp_path / "fsdp2.safetensors")
    full = torch.load(fixtures_dir / "mlp_fsdp2_full.pth", weights_only=True)
    assert _tensors_equal(ckptfix.load(tmp_path / "fsdp2.safetensors"), {k: full[k] for k in full})
    # a single file → DCP that torch.distributed.checkpoint loads (to resume FSDP2 training)
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "dcp_out", format="dcp")
    import torch.distributed.checkpoint as dcp

    target = {k: torch.zeros_like(v) for k, v in ckptfix.load(fixtures_dir / "mlp_ddp.pth").items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp_out"), no_dist=True)
    assert _tensors_equal(target, ckptfix.load(fixtures_dir / "mlp_ddp.pth"))


def test_directory_outputs_refuse_what_they_cannot_do(tmp_path: Path, fixtures_dir: Path) -> None:
    with pytest.raises(ckptfix.errors.ConversionError, match="--hash"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "s", max_shard_size="1KB", hash=True)
    with pytest.raises(ckptfix.errors.ConversionError, match="--keep-extra"):
        ckptfix.convert(fixtures_dir / "mlp_train_ckpt.pth", tmp_path / "s", max_shard_size="1KB", keep_extra=True)
    assert not (tmp_path / "s").exists()


def test_plain_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FormatError, match="neither a torch.distributed.checkpoint.*give the file inside it"):
        ckptfix.inspect(tmp_path)
