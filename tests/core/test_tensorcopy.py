"""tensorcopy: the NaN/Inf check on a tensor's bytes (numpy or the compiled kernels, no torch reduction), exact for
every bit pattern of the 8- and 16-bit kinds, and the jobs its threads share."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.core import libc, tensorcopy
from tests.page_cache import drop_from_page_cache

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.float8_e4m3fn,
          torch.float8_e5m2]


BIT_KINDS = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
             torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


@pytest.mark.parametrize("dtype", BIT_KINDS, ids=str)
def test_bit_test_agrees_with_torch_on_every_bit_pattern(dtype: torch.dtype, check_kernels: str) -> None:
    """The 8- and 16-bit kinds: every bit pattern, one at a time, judged as torch.isfinite judges it — by each
    kernel (numpy's maxima, the compiled mask test with AVX2 and without)."""
    width = torch.empty((), dtype=dtype).element_size()
    ints = torch.arange(2 ** (8 * width), dtype=torch.int32)
    patterns = (ints.to(torch.uint8) if width == 1 else ints.to(torch.int16)).view(dtype)
    want = torch.isfinite(patterns.float())  # (the cast keeps NaN and Inf; torch has no isfinite for float8)
    raw = patterns.view(torch.uint8).numpy()
    got = [tensorcopy.bits_finite(raw[i * width : (i + 1) * width], dtype) for i in range(patterns.numel())]
    assert got == want.tolist()


@pytest.mark.parametrize("dtype", FLOATS + [torch.complex128, torch.float8_e4m3fnuz, torch.float8_e8m0fnu], ids=str)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "big", "none"])
@pytest.mark.parametrize("where", ["first", "chunk_edge", "last"])
def test_all_finite_of_a_cpu_tensor_needs_no_torch_reduction(dtype: torch.dtype, value: str, where: str,
                                                             monkeypatch: pytest.MonkeyPatch, check_kernels: str) -> None:
    """A CPU tensor of three chunks and a bit is checked on its bytes by numpy (torch's reductions, which start an
    OpenMP team per call, are made to fail here): a NaN/Inf anywhere is found, huge finite values are finite."""
    size = torch.empty((), dtype=dtype).element_size()
    n = 3 * tensorcopy.READ_BYTES // size + 5
    t = (torch.rand(n, dtype=torch.float64) + 0.5).to(dtype)
    i = {"first": 0, "chunk_edge": tensorcopy.READ_BYTES // size, "last": n - 1}[where]
    special = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "big": 2.0**100 if size >= 4 else 1.0,
               "none": 1.0}[value]
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e8m0fnu) and "inf" in value:
        special = float("nan")  # (no Inf in these kinds: torch casts one to NaN)
    t[i] = special
    want = bool(torch.isfinite(t if t.is_complex() else t.double()).all())
    for name in ("dot", "aminmax", "isfinite"):
        monkeypatch.setattr(torch, name, _refuse)
    monkeypatch.setattr(torch.Tensor, "sum", _refuse)
    assert tensorcopy.all_finite(t) is want
    assert want is (value in ("none", "big"))


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("a torch reduction was called")


def test_run_jobs_raises_the_first_error_and_stops() -> None:
    done: list[int] = []

    def job(j: int) -> None:
        if j == 3:
            raise OSError("boom")
        done.append(j)

    with pytest.raises(OSError, match="boom"):
        tensorcopy.run_jobs(1000, job, 4)
    assert len(done) < 1000


def test_run_jobs_raises_an_interrupt_only_after_every_started_job_ended() -> None:
    """A real SIGINT while this thread waits for another's job: raised here only once that job has ended (an undo
    log put back under a job still writing would be overwritten)."""
    started, ended = threading.Event(), []

    def job(j: int) -> None:
        if threading.current_thread() is threading.main_thread():
            assert started.wait(30)  # (the other thread holds the other job)
            return
        started.set()
        time.sleep(0.2)  # this thread is waiting in join by now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        ended.append(j)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tensorcopy.run_jobs(2, job, 2)
        assert len(ended) == 1, "raised while a job was still running"
    finally:
        signal.signal(signal.SIGINT, previous)


def test_run_jobs_gives_up_on_a_job_that_never_ends_at_a_second_interrupt() -> None:
    """A job hung (a read that never returns): the first SIGINT waits for it, a second is raised at once."""
    started, release = threading.Event(), threading.Event()

    def job(j: int) -> None:
        if threading.current_thread() is threading.main_thread():
            assert started.wait(30)
            return
        started.set()
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(30)  # (hung until the test lets it go)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            tensorcopy.run_jobs(2, job, 2)
        assert time.monotonic() - start < 10 and not release.is_set()
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_a_mapped_tensor_is_read_ahead_only_when_its_file_is_cold(tmp_path: Path, cache: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of views of a mapped file asks the kernel to read a tensor's pages ahead (MADV_WILLNEED) where they
    are not in the page cache; on a warm file it asks nothing (the advice only walks the cached pages: 4–7 ms of CPU
    per GiB here) — and finds the same values either way."""
    t = torch.randn(3 * tensorcopy.READ_BYTES // 4)
    t[-1] = float("nan")
    path = tmp_path / "t.bin"
    path.write_bytes(t.numpy().tobytes())
    if cache == "cold" and drop_from_page_cache(path):
        pytest.skip("the file system keeps this file's pages in memory (tmpfs): no cold file here")
    asked: list[int] = []
    monkeypatch.setattr(libc, "will_need", lambda address, nbytes: asked.append(nbytes))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with warnings.catch_warnings():  # (a read-only buffer: torch warns that it can't protect it)
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(m, dtype=torch.float32)
        assert tensorcopy.all_finite_many([view, view[:-1]]) == [False, True]
        del view
    assert asked == ([t.nbytes, t.nbytes - 4] if cache == "cold" else [])
