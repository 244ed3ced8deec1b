"""convert/inspect/load wired to directory formats: HF sharded in and out, DCP in and out."""

from __future__ import annotations

import json
import re
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
    (tmp_path / "notes.txt").write_bytes(b"x")
    with pytest.raises(FormatError, match="neither a torch.distributed.checkpoint.*nor a save_pretrained directory"):
        ckptfix.inspect(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x")  # save_pretrained's layout: read as its file, its damage named
    with pytest.raises(FormatError, match=f"^{re.escape(str(tmp_path / 'model.safetensors'))}: unknown format"):
        ckptfix.inspect(tmp_path)


@pytest.mark.parametrize("dst, flags, named", [
    ("out.safetensors", ["--max-shard-size", "1KB"], "--max-shard-size"),
    ("out.pth", ["--max-shard-size", "1KB", "--format", "pth"], "--max-shard-size"),
    ("out.bin", ["--format", "dcp"], "--format dcp"),
], ids=["shards-safetensors", "shards-pth", "dcp-bin"])
def test_directory_output_named_like_a_file_is_refused(dst: str, flags: list[str], named: str, tmp_path: Path,
                                                        fixtures_dir: Path, cli_runner) -> None:
    """A directory output under a one-file name (``x.safetensors``) would be a directory called that: refused
    before anything is read, naming the flag and a directory name to use instead."""
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(tmp_path / dst), *flags])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert named in res.stderr and f"{tmp_path / 'out'}/" in res.stderr and "directory" in res.stderr, res.stderr
    assert not (tmp_path / dst).exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dst", ["out_dir/", "out_dir"])
def test_directory_destination_without_format_names_the_directory_flags(dst: str, tmp_path: Path, fixtures_dir: Path,
                                                                         cli_runner) -> None:
    """``convert x.pth dir/``: the error names --max-shard-size and --format dcp (the directory outputs)."""
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(tmp_path) + "/" + dst])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "--max-shard-size" in res.stderr and "--format dcp" in res.stderr and ".safetensors" in res.stderr
    assert list(tmp_path.iterdir()) == []
