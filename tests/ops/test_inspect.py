"""inspect / read: the summary, and that inspect reads no tensor data whatever the file's size."""

from __future__ import annotations

import io
import mmap
import os
import sys
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import torch

import ckptfix
from tests.page_cache import drop_from_page_cache, resident_bytes


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


class _SparseWriter(io.RawIOBase):
    """A file for ``torch.save`` that seeks over zero-filled chunks: 512 MiB of zero tensors, no disk."""

    def __init__(self, f: BinaryIO):
        self.f = f

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(view) >= mmap.PAGESIZE and not np.frombuffer(view, dtype=np.uint8).any():
            self.f.seek(len(view), os.SEEK_CUR)
        else:
            self.f.write(view)
        return len(view)


@pytest.mark.skipif(not (sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")),
                    reason="page-cache residency: Linux mincore(2) and posix_fadvise")
@pytest.mark.parametrize("legacy", [False, True])
def test_inspect_reads_no_tensor_data(legacy: bool, tmp_path: Path) -> None:
    """Every read — read() calls, page faults on a mapping, torch's own loader — brings the bytes it
    touches into the page cache. With the file dropped from it, inspect leaves only readahead around
    the headers of its 512 MiB of tensor data resident; touching the tensors fills it."""
    path, tensor_bytes = tmp_path / "big.pth", 4 * 2**27
    with open(path, "wb") as f:
        torch.save({f"module.layer{i}.weight": torch.zeros(2**25) for i in range(4)}, _SparseWriter(f),
                   _use_new_zipfile_serialization=not legacy)
        f.truncate()  # the file's size, past a trailing hole
    if drop_from_page_cache(path):
        pytest.skip(f"{path.parent}: the file system keeps the file's pages cached (tmpfs?)")
    info = ckptfix.inspect(path)
    assert info.nbytes == tensor_bytes and info.wrappers == ["module"]
    assert resident_bytes(path) < tensor_bytes // 8, f"inspect brought {resident_bytes(path)} bytes into the cache"
    # the measurement sees reads through a mapping: a zip's tensors are mapped, not read, until touched
    assert drop_from_page_cache(path) == 0
    sd = ckptfix.read(path).state_dict
    if not legacy:
        assert resident_bytes(path) < tensor_bytes // 8
    assert all(not t.any() for t in sd.values())
    assert resident_bytes(path) > tensor_bytes // 2
