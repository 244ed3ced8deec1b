"""inspect / read: the summary, and that inspect reads no tensor data whatever the file's size."""

from __future__ import annotations

import ctypes
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


def _libc() -> Any:
    """libc's mmap, munmap and mincore, typed for ctypes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache: mincore(2) over a mapping of our own, which reads nothing."""
    libc, size = _libc(), path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), size, pages) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages) * mmap.PAGESIZE


def _drop_from_page_cache(path: Path) -> bool:
    """Write back and drop the file's cached pages; False where they stay (tmpfs keeps files in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return _resident_bytes(path) == 0


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
    if not _drop_from_page_cache(path):
        pytest.skip(f"{path.parent}: the file system keeps the file's pages cached (tmpfs?)")
    info = ckptfix.inspect(path)
    assert info.nbytes == tensor_bytes and info.wrappers == ["module"]
    assert _resident_bytes(path) < tensor_bytes // 8, f"inspect brought {_resident_bytes(path)} bytes into the cache"
    # the measurement sees reads through a mapping: a zip's tensors are mapped, not read, until touched
    assert _drop_from_page_cache(path)
    sd = ckptfix.read(path).state_dict
    if not legacy:
        assert _resident_bytes(path) < tensor_bytes // 8
    assert all(not t.any() for t in sd.values())
    assert _resident_bytes(path) > tensor_bytes // 2
