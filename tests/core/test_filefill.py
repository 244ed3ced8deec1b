"""filefill.fill_from_file: built CPU tensors read straight from a file (preadv, by several threads; a leased file's
mapped copy: tests/core/test_scan.py) with the NaN/Inf check on each chunk just read — bit-identical to the file,
exact for every float dtype, per tensor."""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from torch import nn

import ckptfix
from ckptfix.core import filefill, tensorcopy
from ckptfix.errors import FormatError
from ckptfix.ops.sources import Sources
from tests.page_cache import drop_from_page_cache

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.float8_e4m3fn,
          torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _file(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, dict[str, int]]:
    """``tensors`` saved by safetensors; each one's offset in the file (read from the file's header)."""
    path = tmp_path / "t.safetensors"
    st.save_file(tensors, path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    return path, {k: 8 + n + header[k]["data_offsets"][0] for k in tensors}


def _fill(path: Path, offsets: dict[str, int], like: dict[str, torch.Tensor],
          check: bool = True) -> tuple[dict[str, torch.Tensor], list[bool]]:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    fd = os.open(path, os.O_RDONLY)
    try:
        finite = filefill.fill_from_file([(out[k], fd, offsets[k], str(path)) for k in like], check)
    finally:
        os.close(fd)
    return out, finite


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "big", "none"])
@pytest.mark.parametrize("where", ["first", "chunk_edge", "last"])
def test_every_value_read_and_every_nonfinite_found(tmp_path: Path, dtype: torch.dtype, value: str, where: str) -> None:
    """Three chunks and a bit of one tensor, beside small ones: bit-identical to the file; a NaN/Inf anywhere is
    found in its tensor only; finite values whose x·x overflows are finite (the exact test decides)."""
    size = torch.empty((), dtype=dtype).element_size()
    n = 3 * tensorcopy.READ_BYTES // size + 5
    x = torch.randn(n, dtype=torch.float64) * 2
    if value == "big":
        x.fill_(torch.finfo(torch.float16 if dtype in (torch.float16, torch.float8_e5m2) else
                            torch.float8_e4m3fn if dtype == torch.float8_e4m3fn else torch.float32).max / 2)
    elif value != "none":
        x[{"first": 0, "chunk_edge": tensorcopy.READ_BYTES // size, "last": n - 1}[where]] = float(value)
    tensors = {"a_small": torch.ones(3, dtype=dtype), "big": x.to(dtype), "z_small": torch.arange(4.0).to(dtype),
               "ints": torch.arange(10, dtype=torch.int64)}
    path, offsets = _file(tmp_path, tensors)
    got, finite = _fill(path, offsets, tensors)
    for k in tensors:
        assert torch.equal(_bits(got[k]), _bits(tensors[k])), k
    big = tensors["big"]  # (float8_e4m3fn has no Inf: the cast saturates it to 448)
    want = value == "big" or bool(torch.isfinite(big.to(torch.complex128 if big.is_complex() else torch.float64)).all())
    assert want is (value in ("big", "none") or (dtype == torch.float8_e4m3fn and value != "nan"))
    assert finite == [True, want, True, True]
    _got, unchecked = _fill(path, offsets, tensors, check=False)
    assert unchecked == [True] * 4


def test_many_tensors_by_several_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of tensors of every size, in file order or not, filled by several threads, a run of reads per job:
    each exactly its bytes, a NaN in one of them (in its last job's last read) found there only."""
    monkeypatch.setattr(tensorcopy, "READ_BYTES", 4096)
    monkeypatch.setattr(filefill, "JOB_BYTES", 3 * 4096)  # (a job of three reads: several per tensor, the last short)
    monkeypatch.setattr(tensorcopy, "MAX_READERS", 4)
    monkeypatch.setattr(tensorcopy, "THREAD_BYTES", 4096)  # (a thread per 4 KiB: several, at this size)
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i:03d}": torch.randn(int(torch.randint(0, 5000, (), generator=g)), generator=g) for i in range(300)}
    tensors["t150"][-1] = float("nan")
    path, offsets = _file(tmp_path, tensors)
    keys = sorted(tensors, reverse=True)
    got, finite = _fill(path, offsets, {k: tensors[k] for k in keys})
    assert all(torch.equal(_bits(got[k]), _bits(tensors[k])) for k in keys)
    assert [k for k, ok in zip(keys, finite) if not ok] == ["t150"]


def test_a_file_that_ends_first_is_a_format_error(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(3 * tensorcopy.READ_BYTES // 4)}
    path, offsets = _file(tmp_path, tensors)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(FormatError, match=r"t\.safetensors: ends at byte .*truncated"):
        _fill(path, offsets, tensors)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(600, 700)
        self.b = nn.Linear(700, 5)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_built_model_is_filled_from_the_file_not_from_a_mapped_view(tmp_path: Path, fmt: str, cache: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-built model in the file's dtype is filled by filefill (reads, or the kernels' copy from the leased file's
    mapping: tests/core/test_scan.py), never by torch from a view of the mapped file (none is made for it), warm or
    with the file's pages dropped: bit-identical to the plain loader, no warning for finite values whose x·x
    overflows."""
    sd = Net().state_dict()
    sd["a.weight"].fill_(3e38)  # finite; x·x overflows
    path = tmp_path / f"m.{fmt}"
    st.save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    want = Net()
    want.load_state_dict(st.load_file(path) if fmt == "safetensors" else torch.load(path, weights_only=True))

    def no_mapped_copy(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("copied from the mapped file")

    monkeypatch.setattr(tensorcopy, "copy_checked", no_mapped_copy)
    monkeypatch.setattr(Sources, "view", no_mapped_copy)
    if cache == "cold":
        drop_from_page_cache(path)
    got = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = ckptfix.load_into(got, path)
    assert report.nonfinite == [] and report.copied == len(sd)
    for k, v in want.state_dict().items():
        assert torch.equal(_bits(got.state_dict()[k]), _bits(v)), k
