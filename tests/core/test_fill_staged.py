"""filefill.fill_staged: tensors filled from a file through staging windows — a cast on the CPU, any tensor on a GPU.

Real safetensors files; the windows made small so that small tensors share one, a large one spans several, and the
threads (several, here) each hold one. Every value must be what torch's own cast of the file's tensor gives, bit for
bit; a NaN/Inf is found in its tensor only; a file that ends first is a FormatError and the undo log puts back every
byte the fill replaced; the CRC-32s the fill takes join into each tensor's. The GPU rows (pinned windows, a side
stream, the check on the device) run where CUDA is.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

from ckptfix.core import checksums, filefill, rollback, tensorcopy
from ckptfix.errors import FormatError
from ckptfix.parse.safetensors_header import read_header

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: (the file's dtype, the tensor's)
CASTS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float64),
         (torch.float32, torch.float16), (torch.int64, torch.int32), (torch.float8_e4m3fn, torch.float32),
         (torch.complex64, torch.complex128), (torch.float32, torch.float32)]


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filefill, "JOB_BYTES", 4096)  # (the CPU's window)
    monkeypatch.setattr(filefill, "DEVICE_WINDOW_BYTES", 4096)
    monkeypatch.setattr(filefill, "DEVICE_READERS", 2)
    monkeypatch.setattr(filefill, "DEVICE_WINDOWS_PER_READER", 1)  # (two windows, each reused many times, after its event)
    monkeypatch.setattr(tensorcopy, "MAX_READERS", 4)
    monkeypatch.setattr(tensorcopy, "THREAD_BYTES", 4096)


def _file(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, dict[str, int]]:
    """``tensors`` saved by safetensors; where each one's bytes start (its header as ckptfix's reader parses it)."""
    path = tmp_path / "t.safetensors"
    st.save_file(tensors, path)
    start, header, _meta = read_header(str(path))
    return path, {k: start + header[k]["data_offsets"][0] for k in tensors}


def _tensors(stored: torch.dtype, count: int = 120) -> dict[str, torch.Tensor]:
    """Tensors of every size (empty, one element, under a window, several windows), in one dtype."""
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 3, 5000] + [int(torch.randint(0, 3000, (), generator=g)) for _ in range(count - 4)]
    if stored.is_floating_point or stored.is_complex:
        return {f"t{i:03d}": (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(stored) for i, n in enumerate(sizes)}
    return {f"t{i:03d}": torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64) for i, n in enumerate(sizes)}


def _staged(path: Path, offsets: dict[str, int], tensors: dict[str, torch.Tensor], want: torch.dtype, device: str,
            keys: list[str], undo: rollback.Undo | None = None, tally: checksums.Tally | None = None,
            out: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], list[bool]]:
    out = out if out is not None else {k: torch.full(tensors[k].shape, 7, dtype=want, device=device) for k in keys}
    fd = os.open(path, os.O_RDONLY)
    try:
        finite = filefill.fill_staged([(out[k], fd, offsets[k], tensors[k].dtype, str(path)) for k in keys],
                                      undo=undo, tally=tally)
    finally:
        os.close(fd)
    return out, finite


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


@pytest.mark.usefixtures("small_windows")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("stored", "want"), CASTS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("check_kernels", ["avx2", "portable", "numpy"], indirect=True)
def test_every_value_is_torchs_cast_and_every_nonfinite_is_found(tmp_path: Path, device: str, stored: torch.dtype,
                                                                  want: torch.dtype, check_kernels: str) -> None:
    """Every cast (bf16 → fp32 by the compiled kernel where it is built), small tensors sharing a window and large
    ones spanning several: bit for bit torch's cast on that device (a NaN's bits are the device's: CUDA's cast from
    fp32 makes its own NaN, the CPU's keeps the payload); each NaN/Inf found in its own tensor only."""
    tensors = _tensors(stored)
    floats = stored.is_floating_point or stored.is_complex
    if floats:
        tensors["t003"][4321] = float("nan")  # (a large tensor's middle window)
        tensors["t050"][-1] = float("inf") if stored != torch.float8_e4m3fn else float("nan")
    path, offsets = _file(tmp_path, tensors)
    keys = sorted(tensors, key=lambda k: -offsets[k])  # (not in file order)
    got, finite = _staged(path, offsets, tensors, want, device, keys)
    for k in keys:
        assert torch.equal(_bits(got[k]), _bits(tensors[k].to(device).to(want))), k
    nonfinite = sorted(k for k in keys if (want.is_floating_point or want.is_complex)
                       and not bool(torch.isfinite(tensors[k].to(want)).all()))
    assert sorted(k for k, ok in zip(keys, finite) if not ok) == nonfinite
    if floats and want != torch.float16:
        assert nonfinite == ["t003", "t050"]
    elif want == torch.float16:  # (float32 values past float16's range: cast to Inf, as torch casts them)
        assert {"t003", "t050"} <= set(nonfinite)


@pytest.mark.gpu
@pytest.mark.usefixtures("small_windows")
@pytest.mark.parametrize("each", [1, 3])
def test_a_window_is_pinned_only_where_none_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, each: int) -> None:
    """Windows are pinned as the readers need them, never more than DEVICE_WINDOWS_PER_READER per reader, each reused
    once its copies are done; every byte lands."""
    monkeypatch.setattr(filefill, "DEVICE_WINDOWS_PER_READER", each)
    seen: set[int] = set()
    take = filefill._Staging._take

    def spy(self: filefill._Staging) -> torch.Tensor:
        window = take(self)
        assert window.is_pinned()
        seen.add(window.data_ptr())
        return window

    monkeypatch.setattr(filefill._Staging, "_take", spy)
    tensors = _tensors(torch.float32)
    path, offsets = _file(tmp_path, tensors)
    got, finite = _staged(path, offsets, tensors, torch.float32, "cuda", sorted(tensors))
    assert all(torch.equal(_bits(got[k]), _bits(tensors[k])) for k in tensors)
    assert all(finite)
    assert 1 <= len(seen) <= 2 * each  # (DEVICE_READERS is 2; the reads, 120 tensors, reuse them many times)


@pytest.mark.gpu
def test_the_readers_are_not_bounded_by_torchs_thread_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets torch's thread count to 1 per rank: a GPU fill's readers are bounded by the cores instead."""
    threads: list[int] = []
    run = filefill.run_jobs
    monkeypatch.setattr(filefill, "run_jobs", lambda n, job, workers: (threads.append(workers), run(n, job, workers)))
    monkeypatch.setattr(filefill, "DEVICE_WINDOW_BYTES", 2**20)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensors = {f"t{i}": torch.randn(2**20) for i in range(8)}  # (32 MiB: four readers' worth at least)
        path, offsets = _file(tmp_path, tensors)
        got, _finite = _staged(path, offsets, tensors, torch.float32, "cuda", sorted(tensors))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(got[k].cpu(), tensors[k]) for k in tensors)
    assert threads == [min(filefill.DEVICE_READERS, len(os.sched_getaffinity(0)), 4)]


@pytest.mark.usefixtures("small_windows")
@pytest.mark.parametrize("device", DEVICES)
def test_a_file_that_ends_first_is_an_error_and_the_log_puts_back_every_byte(tmp_path: Path, device: str) -> None:
    tensors = _tensors(torch.bfloat16)
    path, offsets = _file(tmp_path, tensors)
    keys = sorted(tensors)
    out = {k: torch.randn(tensors[k].shape, device=device) for k in keys}
    before = {k: v.clone() for k, v in out.items()}
    os.truncate(path, offsets["t060"] + 10)  # (halfway through the tensors: some read, some not)
    undo = rollback.Undo()
    with pytest.raises(FormatError, match=r"t\.safetensors: ends at byte .*truncated"):
        _staged(path, offsets, tensors, torch.float32, device, keys, undo=undo, out=out)
    assert any(not torch.equal(out[k], before[k]) for k in keys)  # (the fill had written before it failed)
    undo.restore()
    undo.close()
    assert all(torch.equal(_bits(out[k]), _bits(before[k])) for k in keys)


@pytest.mark.usefixtures("small_windows")
@pytest.mark.parametrize("device", DEVICES)
def test_the_crcs_it_takes_join_into_each_tensors(tmp_path: Path, device: str) -> None:
    tensors = _tensors(torch.float16, 40)
    path, offsets = _file(tmp_path, tensors)
    raw = path.read_bytes()
    tally = checksums.Tally()
    _staged(path, offsets, tensors, torch.float32, device, sorted(tensors), tally=tally)

    def unread(offset: int, size: int) -> int:
        raise AssertionError(f"bytes {offset}+{size} were not tallied")

    for k, t in tensors.items():
        start = offsets[k]
        assert tally.crc(str(path), start, t.nbytes, unread) == zlib.crc32(raw[start : start + t.nbytes]), k


@pytest.mark.parametrize("lease", ["held", "broken", "none"])
def test_a_leased_files_bf16_is_widened_from_its_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         lease: str) -> None:
    """bf16 into fp32 with every file leased and its pages cached: widened by the compiled kernel straight from a
    mapping of the file (no byte read but each piece's 4 KiB probe), bit for bit torch's cast, the NaN found, the
    CRC-32s taken from the mapping; a broken lease, or none, reads every byte instead."""
    if tensorcopy.native() is None:
        pytest.skip("ckptfix.core._scan is not built")
    monkeypatch.setattr(tensorcopy, "THREAD_BYTES", 4096)  # (two threads; the windows as shipped, 4 MiB)
    tensors = _tensors(torch.bfloat16, 40)
    tensors["t003"][4321] = float("nan")
    path, offsets = _file(tmp_path, tensors)
    raw = path.read_bytes()  # (and the page cache warm)
    leases = rollback.Leases({str(path): len(raw)} if lease != "none" else None)
    if lease != "none" and (not leases.held or not filefill._mappable()):
        leases.release()
        pytest.skip("no read lease here, or a lease-break-time too short to map under")
    if lease == "broken":
        monkeypatch.setattr(leases, "intact", lambda: False)  # (a writer waits on it)
    real, read = os.preadv, []

    def preadv(fd: int, buffers: list, offset: int, *flags: int) -> int:
        got = real(fd, buffers, offset, *flags)
        read.append(got)
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    tally, keys = checksums.Tally(), sorted(tensors)
    out = {k: torch.full(tensors[k].shape, 7.0) for k in keys}
    fd = os.open(path, os.O_RDONLY)
    try:
        finite = filefill.fill_staged([(out[k], fd, offsets[k], torch.bfloat16, str(path)) for k in keys],
                                      tally=tally, leases=leases)
    finally:
        os.close(fd)
        leases.release()
    assert all(torch.equal(_bits(out[k]), _bits(tensors[k].float())) for k in keys)
    assert [k for k, ok in zip(keys, finite) if not ok] == ["t003"]
    for k, t in tensors.items():
        assert tally.crc(str(path), offsets[k], t.nbytes, lambda *a: -1) == zlib.crc32(raw[offsets[k] : offsets[k] + t.nbytes])
    total = sum(t.nbytes for t in tensors.values())
    if lease == "held":
        assert max(read) <= 4096 and sum(read) < total  # (the probes alone)
    else:
        assert sum(read) >= total
