"""inspect / read: the summary, and that inspect reads no tensor data whatever the file's size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptfix


@pytest.mark.parametrize("name", ["mlp_ddp.pth", "mlp_compile_ddp.pth", "mlp_train_ckpt.pth", "mlp_legacy.pth",
                                  "mlp_safetensors.safetensors", "mlp_amp.pth", "mlp_model_parallel.pth"])
def test_summary_matches_manifest(name: str, fixtures_dir: Path, manifest: dict) -> None:
    entry = manifest[name]
    info = ckptfix.inspect(fixtures_dir / name)
    assert info.format == entry["format"]
    assert info.wrappers == entry["wrappers"]
    assert info.state_dict_key == entry["state_dict_key"]
    assert info.dtypes == entry["dtypes"] and info.num_tensors == entry["num_tensors"]
    if entry["format"] != "safetensors":
        assert info.devices == entry["devices"]
    assert info.num_params == 13 * 16 + 16 + 16 * 32 + 32 + 32 + 1
    assert all(t.device.type == "meta" for t in info.state_dict.values())
    d = info.to_dict()
    assert d["num_keys"] == entry["num_tensors"] and d["keys"][0]["shape"] is not None


def test_training_checkpoint_extras(fixtures_dir: Path) -> None:
    d = ckptfix.inspect(fixtures_dir / "mlp_train_ckpt.pth").to_dict()
    assert d["state_dict_key"] == "model_state_dict"
    assert set(d["extra"]) == {"optimizer_state_dict", "epoch", "loss"}
    assert d["extra"]["epoch"].startswith("int ")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.parametrize("legacy", [False, True])
def test_inspect_reads_no_tensor_data(legacy: bool, tmp_path: Path) -> None:
    """Bytes read through read() syscalls stay far below the tensor bytes (64 MiB here)."""
    path = tmp_path / "big.pth"
    torch.save({f"module.layer{i}.weight": torch.zeros(1024, 1024) for i in range(16)}, path,
               _use_new_zipfile_serialization=not legacy)
    before = _rchar()
    info = ckptfix.inspect(path)
    read_bytes = _rchar() - before
    assert info.nbytes == 64 * 2**20 and info.wrappers == ["module"]
    assert read_bytes < 4 * 2**20, read_bytes
