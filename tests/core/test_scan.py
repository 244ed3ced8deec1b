"""ckptfix.core._scan, the compiled kernels: built wherever a C compiler is; each copy bit-identical to its source and
its check exact for every width, alignment, length and position (AVX2 and portable kernels alike, streamed stores or
not); and filefill's copy from a leased file's mapping — taken only while every lease holds and the pages were found
cached, and exact there too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch as st
import torch

from ckptfix.core import checksums, filefill, rollback, tensorcopy
from tests.page_cache import drop_from_page_cache

#: a (width, mask, value) of each width: float32's and float64's exponents, float16's, and the fnuz kinds' one NaN
RULES = [(1, 0xFF, 0x80), (1, 0x7C, 0x7C), (2, 0x7C00, 0x7C00), (4, 0x7F800000, 0x7F800000),
         (8, 0x7FF0000000000000, 0x7FF0000000000000), (4, 0, 0)]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def test_built_where_a_compiler_is() -> None:
    """setup.py builds the kernels optionally: where this machine has a C compiler, a missing module is a failed build
    (the loads would silently take the slower numpy check), not a skip."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the kernels are optional")
    assert tensorcopy.native() is not None, "ckptfix.core._scan was not built: pip install -e . shows why"
    assert tensorcopy.native().isa() in ("avx2", "portable")


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_ckptfix_no_native_turns_the_kernels_off(value: str) -> None:
    """``CKPTFIX_NO_NATIVE=1`` (read at import): the numpy check, as a build without a C compiler runs it."""
    code = "from ckptfix.core import tensorcopy; print(tensorcopy.native() is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CKPTFIX_NO_NATIVE": value})
    assert out.stdout.strip() == str(value == "1" or tensorcopy.native() is None)


def _elements(rng: np.random.Generator, width: int, mask: int, value: int, n: int) -> np.ndarray:
    """``n`` random elements of ``width`` bytes, none matching ``bits & mask == value``."""
    x = rng.integers(0, 2 ** (8 * width), size=n, dtype=UINT[width], endpoint=False)
    if mask:
        hit = (x & UINT[width](mask)) == UINT[width](value)
        x[hit] ^= UINT[width](value & -value)  # (the lowest bit of the pattern flipped: no longer a match)
    return x


@pytest.mark.parametrize("width,mask,value", RULES)
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("check_kernels", ["avx2", "portable"], indirect=True)
def test_copy_and_scan_are_exact_at_every_alignment_length_and_position(width: int, mask: int, value: int,
                                                                        stream: bool, check_kernels: str) -> None:
    """Lengths around the 64-byte step, destinations at every alignment a tensor's chunk can have, the one matching
    element at each position (or none): the copy is the source's bytes, the bytes around it untouched, and the flag is
    the match's (scan's too)."""
    kernels = tensorcopy.native()
    rng = np.random.default_rng(width)
    for n in [0, 1, 7, 8, 9, 63 // width, 64 // width, 65 // width + 1, 300 // width, 1000]:
        for shift in range(0, 64, width * 3 if width < 4 else width):
            for hit in ([None, 0, n - 1] + list(range(0, n, max(1, n // 9)))) if n else [None]:
                src = _elements(rng, width, mask, value, n)
                if hit is not None and mask:
                    src[hit] = value
                space = np.full(shift + n * width + 64, 0xA5, dtype=np.uint8)
                dst = space[shift : shift + n * width]
                bad = kernels.copy(dst, src.view(np.uint8), width, mask, value, stream)
                assert bad is (hit is not None and mask != 0), (n, shift, hit)
                assert dst.tobytes() == src.tobytes(), (n, shift, hit)
                assert (space[:shift] == 0xA5).all() and (space[shift + n * width :] == 0xA5).all()
                assert kernels.scan(src.view(np.uint8), width, mask, value) is bad


@pytest.mark.parametrize("call", ["lengths", "width", "whole", "read_only"])
def test_wrong_arguments_are_errors_not_overruns(call: str) -> None:
    kernels = tensorcopy.native()
    if kernels is None:
        pytest.skip("ckptfix.core._scan is not built")
    a, b = np.zeros(16, np.uint8), np.zeros(17, np.uint8)
    with pytest.raises((ValueError, TypeError)):
        if call == "lengths":
            kernels.copy(a, b, 1, 0xFF, 0xFF, False)
        elif call == "width":
            kernels.copy(a, a.copy(), 3, 0, 0, False)
        elif call == "whole":
            kernels.scan(b, 4, 0x7F800000, 0x7F800000)
        else:
            kernels.copy(bytes(16), a, 1, 0, 0, False)
    with pytest.raises(ValueError, match="no avx3"):
        kernels.set_isa("avx3")


class _Counting:
    """The kernels, with the copies counted (filefill's mapped path is the only caller of ``copy``)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.copies = kernels, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernels, name)

    def copy(self, *args: Any) -> bool:
        self.copies += 1
        return bool(self.kernels.copy(*args))


def _saved(tmp_path: Path, dtype: torch.dtype, nonfinite: int | None) -> tuple[Path, dict[str, torch.Tensor]]:
    n = 3 * filefill.JOB_BYTES // torch.empty((), dtype=dtype).element_size() + 11
    big = (torch.randn(n, dtype=torch.float64) + 0.1).to(dtype)
    if nonfinite is not None:
        big[nonfinite] = float("nan")
    tensors = {"a": torch.arange(5.0).to(dtype), "big": big, "ints": torch.arange(7)}
    path = tmp_path / "m.safetensors"
    st.save_file(tensors, path)
    return path, tensors


def _offsets(path: Path) -> dict[str, int]:
    """Each tensor's offset in the safetensors file ``path``, from its header."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _fill(path: Path, like: dict[str, torch.Tensor], leased: bool = True, tally: Any = None,
          broken: bool = False) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """``like``'s tensors filled from ``path`` by filefill, the file leased (``broken``: the lease being broken)."""
    offsets = _offsets(path)
    out = {k: torch.full_like(v, 7) for k, v in like.items()}
    leases = rollback.Leases({str(path): os.path.getsize(path)} if leased else None)
    assert leases.held is leased
    if broken:
        leases.intact = lambda: False  # type: ignore[method-assign]  (a writer waits on it)
    fd = os.open(path, os.O_RDONLY)
    try:
        finite = filefill.fill_from_file([(out[k], fd, offsets[k], str(path)) for k in like], True, tally=tally,
                                         leases=leases)
    finally:
        os.close(fd)
        leases.release()
    return out, finite


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("where", [None, "first_read", "mapped", "last"])
def test_a_leased_cached_file_is_copied_from_its_mapping_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 dtype: torch.dtype, where: str | None,
                                                                 check_kernels: str) -> None:
    """Leased and cached: each job's first read probes the page cache, the rest is copied from the mapping by the
    kernel — bit-identical, a NaN found in the read part or the mapped part, integers unchecked; the CRC-32s a digest
    check takes are the unleased reads' (with numpy, no kernels: every byte read)."""
    size = torch.empty((), dtype=dtype).element_size()
    at = {None: None, "first_read": 1, "mapped": tensorcopy.READ_BYTES // size + 3, "last": -1}[where]
    path, tensors = _saved(tmp_path, dtype, at)
    counting = _Counting(tensorcopy.native()) if check_kernels != "numpy" else None
    if counting is not None:
        monkeypatch.setattr(tensorcopy, "_scan", counting)
    tallies = {}
    for leased in (True, False):
        for tally in (None, checksums.Tally()):
            got, finite = _fill(path, tensors, leased, tally)
            assert all(torch.equal(_bits(got[k]), _bits(v)) for k, v in tensors.items()), (leased, tally)
            assert finite == [True, where is None, True], (leased, tally)
            tallies[leased] = tally
    if counting is not None:
        assert counting.copies >= 2 * 3  # (a copy per job of the big tensor, beyond its first read; with a tally too)

    def unread(offset: int, length: int) -> int:
        raise AssertionError(f"bytes {offset}..{offset + length} not tallied")

    offsets = _offsets(path)
    for k, v in tensors.items():
        crcs = {leased: t.crc(str(path), offsets[k], v.nbytes, unread) for leased, t in tallies.items()}
        assert crcs[True] == crcs[False] == zlib.crc32(_bits(v).numpy().tobytes()), k


@pytest.mark.parametrize("state", ["broken_lease", "cold"])
def test_no_mapped_copy_under_a_broken_lease_or_from_a_cold_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 state: str) -> None:
    """A lease that a writer is breaking (it may soon shrink the file: SIGBUS from a mapping) sends every job to the
    reads; so do pages not in the cache (each job's first read misses). Either way the values are the file's."""
    kernels = tensorcopy.native()
    if kernels is None:
        pytest.skip("ckptfix.core._scan is not built")
    counting = _Counting(kernels)
    monkeypatch.setattr(tensorcopy, "_scan", counting)
    monkeypatch.setattr(filefill, "READAHEAD_BYTES", 4096)  # (cold: no job's pages read ahead of its first read)
    path, tensors = _saved(tmp_path, torch.float32, None)
    if state == "cold":
        drop_from_page_cache(path)
    got, finite = _fill(path, tensors, broken=state == "broken_lease")
    assert finite == [True, True, True]
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    if state == "broken_lease":
        assert counting.copies == 0


_TRUNCATE = "import os, sys, time; sys.stdin.readline(); os.truncate(sys.argv[1], int(sys.argv[2])); print(time.monotonic())"


def test_a_writer_that_comes_mid_fill_waits_and_the_jobs_after_it_read(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real truncation from another process while a mapped copy runs: the lease makes it wait, the copy in flight
    finishes from pages that are still there, every later job reads (its lease is breaking), and only the release
    lets the writer through — the values are the file's as it was, nothing is SIGBUS."""
    kernels = tensorcopy.native()
    if kernels is None:
        pytest.skip("ckptfix.core._scan is not built")
    counting = _Counting(kernels)
    monkeypatch.setattr(tensorcopy, "_scan", counting)
    monkeypatch.setattr(tensorcopy, "MAX_READERS", 1)  # (one thread: the jobs in order)
    path, tensors = _saved(tmp_path, torch.float32, None)
    size = os.path.getsize(path)
    writer = subprocess.Popen([sys.executable, "-c", _TRUNCATE, str(path), str(size // 4)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    real = filefill._Reader._copy_mapped
    copying: list[float] = []

    def writer_comes(self: Any, *args: Any) -> None:
        if counting.copies == 0:
            writer.stdin.write("go\n")  # type: ignore[union-attr]
            writer.stdin.flush()  # type: ignore[union-attr]
            for _ in range(600):  # blocked in truncate(2): the kernel breaks the lease, then waits for us
                if not self.leases.intact():
                    break
                time.sleep(0.05)
            assert not self.leases.intact(), "the truncation never reached the lease"
            time.sleep(0.2)  # (a writer the lease didn't hold would be through by now)
            copying.append(time.monotonic())
        real(self, *args)

    monkeypatch.setattr(filefill._Reader, "_copy_mapped", writer_comes)
    try:
        got, finite = _fill(path, tensors)
    finally:
        cut_at = float(writer.communicate(timeout=60)[0])
    assert finite == [True, True, True]
    assert all(torch.equal(_bits(got[k]), _bits(v)) for k, v in tensors.items())
    assert counting.copies == 1 and cut_at > copying[0]
    assert os.path.getsize(path) == size // 4


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("check_kernels", ["avx2", "portable"], indirect=True)
def test_widen_bf16_is_torchs_cast_of_every_bit_pattern(stream: bool, check_kernels: str) -> None:
    """Every one of the 65536 bfloat16 bit patterns (NaN payloads, signed zeros, subnormals, ±Inf) widened to float32:
    bit for bit torch's cast, at every destination alignment and around the 16-element step; the flag says whether a
    NaN/Inf was among them (only when asked), the bytes around the destination untouched."""
    kernels = tensorcopy.native()
    every = np.arange(2**16, dtype=np.uint16)
    want = torch.from_numpy(every.view(np.int16).copy()).view(torch.bfloat16).float().view(torch.int32).numpy()
    finite = (every & 0x7F80) != 0x7F80
    rng = np.random.default_rng(0)
    for n in [0, 1, 15, 16, 17, 33, 1000, 2**16]:
        for shift in (0, 4, 12, 28):
            pick = np.arange(n) if n == 2**16 else rng.integers(0, 2**16, size=n)
            if n and n < 2**16:
                pick[rng.integers(0, n)] = rng.choice(np.flatnonzero(finite))  # (a finite one at least)
            src = every[pick]
            space = np.full(shift + 4 * n + 64, 0xA5, dtype=np.uint8)
            dst = space[shift : shift + 4 * n]
            for check in (True, False):
                bad = kernels.widen_bf16(dst, src.view(np.uint8), check, stream)
                assert bad is (check and not bool(finite[pick].all())), (n, shift)
                assert (dst.view(np.int32) == want[pick]).all(), (n, shift)
                assert (space[:shift] == 0xA5).all() and (space[shift + 4 * n :] == 0xA5).all()
            finite_only = src[finite[pick]]
            out = np.empty(4 * finite_only.size, np.uint8)
            assert kernels.widen_bf16(out, finite_only.view(np.uint8), True, stream) is False
    with pytest.raises(ValueError, match="widen into"):
        kernels.widen_bf16(np.zeros(8, np.uint8), np.zeros(8, np.uint8), True, False)
