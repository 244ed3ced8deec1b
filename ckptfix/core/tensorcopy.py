"""Copying tensors with the NaN/Inf check fused in: each chunk is checked while it is still in cache.

``torch.isfinite(t).all()`` allocates a bool tensor the size of ``t`` and reads ``t`` a second time from
memory; on a 1 GiB model it cost 3× the load itself. Here a copy goes chunk by chunk (1 MiB), and each
chunk just written is reduced to one number (its dot product with itself, or its sum): a finite result proves
every element finite (a NaN or an Inf makes it non-finite), and only a non-finite one — a real NaN/Inf, or
finite values overflowing — needs the exact test (the chunk's minimum and maximum, which NaN and Inf propagate
to). No temporary larger than a chunk. Measured here (2 cores): the check adds about a fifth to a copy from the
page cache (bench/RESULTS.md); the plain `isfinite` pass added three times the copy.

A built CPU tensor filled from a file (:func:`fill_from_file`, what ``load_into`` does for a CPU-built model) is
read straight into its memory with ``preadv`` — the kernel copies from the page cache: no page faults on a
mapping — in chunks of :data:`READ_BYTES`, each checked just after it landed, while it is still in that core's
cache, by a few threads (each reads and checks its own chunks; both release the GIL). fp32/fp64 chunks are
checked with numpy's ``dot`` (single-threaded BLAS): torch's reductions start an OpenMP team per call, which on
a busy machine waits for a core (measured here: 0.4–1.4 ms per MiB with the other core busy, against 35 µs).
A file not in the page cache is asked for ahead of the reads (``POSIX_FADV_WILLNEED``), found out with
``RWF_NOWAIT``: nothing is asked of the kernel when the file is cached.

A copy to a CUDA device goes through two pinned staging buffers, so reading the next chunk from the
mapped file overlaps the transfer of the last one.
"""

from __future__ import annotations

import errno
import math
import os
import threading
from typing import Any

from ..errors import FormatError

#: bytes per chunk: small enough to stay in a core's cache between the copy and the check (measured best here:
#: 1 MiB; larger chunks leave the cache, smaller ones cost more in per-call overhead than the check itself)
CHUNK_BYTES = 2**20
#: bytes per pinned staging buffer (two are used) for a copy from the CPU to a CUDA device
STAGING_BYTES = 32 * 2**20
#: bytes per ``preadv`` (and per check) when a tensor is filled from a file: small enough to be checked in cache
READ_BYTES = 2**19
#: threads filling tensors from files: torch's thread count (what its ``copy_`` uses), at most this many
MAX_READERS = 8
#: bytes asked for ahead of the reads (``POSIX_FADV_WILLNEED``) where the file isn't in the page cache
READAHEAD_BYTES = 64 * 2**20


def checks_values(t: Any) -> bool:
    """Floating and complex tensors can hold NaN/Inf; integer and bool tensors can't."""
    return bool(t.is_floating_point() or t.is_complex())


def _summable(x: Any) -> Any:
    import torch

    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = x.float()  # float8 kinds: torch has no sum for them (a chunk-sized temporary)
    return x


def _reduce(x: Any) -> Any:
    """One number that is finite only if every element of the 1-D chunk ``x`` is (it may also be non-finite for
    large finite values: then the exact test decides). fp32/fp64: ``x·x`` (BLAS, the fastest pass measured);
    other dtypes: the sum."""
    import torch

    x = _summable(x).reshape(-1)  # (a complex chunk's real view is 2-D)
    return torch.dot(x, x) if x.dtype in (torch.float32, torch.float64) else x.sum()


def _exact(x: Any) -> Any:
    """A 0-d bool tensor: every element of ``x`` is finite (NaN and Inf propagate to the minimum or maximum)."""
    import torch

    x = _summable(x)
    if x.numel() == 0:
        return torch.tensor(True, device=x.device)
    lo, hi = torch.aminmax(x.reshape(-1))
    return torch.isfinite(lo) & torch.isfinite(hi)


def _finite(parts: list[Any], sums: list[Any]) -> bool:
    """Every element of ``parts`` finite, given each part's sum: a finite sum proves its part finite; the
    others (a NaN/Inf, or finite values overflowing) get the exact test. One host sync for the common case."""
    import torch

    if not sums:
        return True
    ok = torch.isfinite(torch.stack(sums))
    if bool(ok.all()):
        return True
    return all(bool(_exact(parts[i])) for i in (~ok).nonzero().flatten().tolist())


def all_finite(t: Any) -> bool:
    """Every element of ``t`` is finite, checked chunk by chunk (no tensor-sized temporary)."""
    if not checks_values(t) or t.numel() == 0:
        return True
    if not t.is_contiguous():  # a strided view: its rows, in chunk-sized groups
        if t.dim() == 0:
            return bool(_exact(t))
        rows = max(1, CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
        return all(all_finite(t[i : i + rows].contiguous()) for i in range(0, t.shape[0], rows))
    parts = list(t.reshape(-1).split(max(1, CHUNK_BYTES // t.element_size())))
    return _finite(parts, [_reduce(p) for p in parts])


def copy_checked(dst: Any, src: Any, check: bool = True) -> bool:
    """``dst.copy_(src)`` (casting as torch does); with ``check``, returns whether every value copied is
    finite, tested on each chunk just after it is written. Returns True for integer/bool tensors."""
    import torch

    check = check and checks_values(dst)
    if dst.device.type == "cuda" and src.device.type == "cpu":
        return _to_device(dst, src, check)
    with torch.no_grad():
        if not check:
            dst.copy_(src)
            return True
        if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
            dst.copy_(src)
            return all_finite(dst)
        step = max(1, CHUNK_BYTES // max(dst.element_size(), src.element_size()))
        parts, sums = [], []
        for part, piece in zip(dst.view(-1).split(step), src.reshape(-1).split(step)):
            part.copy_(piece)
            sums.append(_reduce(part))  # while the chunk is still in cache
            parts.append(part)
        return _finite(parts, sums)


def _to_device(dst: Any, src: Any, check: bool) -> bool:
    """CPU → CUDA through two pinned buffers: a chunk is read from ``src`` (the mapped file) into one while
    the other's transfer runs; casts happen on the device. The check runs on the device, one sync at the end."""
    import torch

    if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape) or src.numel() == 0:
        with torch.no_grad():
            dst.copy_(src)
        return all_finite(dst) if check else True
    s = src.reshape(-1)
    d = dst.view(-1)
    step = max(1, STAGING_BYTES // s.element_size())
    stream = torch.cuda.current_stream(dst.device)
    buffers = [torch.empty(min(step, s.numel()), dtype=s.dtype, pin_memory=True) for _ in range(2)]
    done: list[Any] = [None, None]
    parts, sums = [], []
    with torch.no_grad():
        for n, i in enumerate(range(0, s.numel(), step)):
            k = n % 2
            if done[k] is not None:
                done[k].synchronize()  # this buffer's last transfer has finished
            part = s[i : i + step]
            staged = buffers[k][: part.numel()]
            staged.copy_(part)
            out = d[i : i + part.numel()]
            out.copy_(staged, non_blocking=True)  # casts on the device when the dtypes differ
            done[k] = torch.cuda.Event()
            done[k].record(stream)
            if check:
                parts.append(out)
                sums.append(_reduce(out))
        stream.synchronize()
    return _finite(parts, sums)


def fill_from_file(fills: list[tuple[Any, int, int, str]], check: bool = True) -> list[bool]:
    """Fill each contiguous CPU tensor ``dst`` of ``fills`` — ``(dst, fd, offset, name)`` — with the bytes of the
    file ``fd`` from ``offset`` (``dst.nbytes`` of them; ``name`` names the file in errors), read in chunks by up
    to :data:`MAX_READERS` threads; with ``check``, each chunk is checked for NaN/Inf just after it is read. Returns,
    per fill, whether its values are all finite (True unchecked or for integer tensors). A file that ends first
    is a FormatError naming it and the range."""
    import torch

    jobs = []  # (fill index, byte view of the chunk, file offset, first element, elements)
    for n, (dst, _fd, offset, _name) in sorted(enumerate(fills), key=lambda f: (f[1][1], f[1][2])):
        if dst.numel() == 0:
            continue
        raw = dst.reshape(-1).view(torch.uint8).numpy()
        size = dst.element_size()
        step = max(1, READ_BYTES // size) * size
        jobs += [(n, raw[i : i + step], offset + i, i // size, min(step, raw.size - i) // size)
                 for i in range(0, raw.size, step)]
    finite = [True] * len(fills)
    own = {fd: _sequential(fd) for fd in {f[1] for f in fills}}
    try:
        reader = _Reader([(d, own[fd], o, name) for d, fd, o, name in fills], jobs, finite, check)
        workers = max(1, min(MAX_READERS, torch.get_num_threads(), len(jobs)))
        threads = [threading.Thread(target=reader.work, daemon=True) for _ in range(workers - 1)]
        for t in threads:
            t.start()
        reader.work()
        for t in threads:
            t.join()
    finally:
        for fd, mine in own.items():
            if mine != fd:
                os.close(mine)
    if reader.error is not None:
        raise reader.error
    return finite


def _sequential(fd: int) -> int:
    """A descriptor of ``fd``'s file of its own (the same file, reopened through /proc), with the kernel's
    readahead for a sequential read: the caller's may have it off (a positional reader's POSIX_FADV_RANDOM,
    which makes a cold whole-file read 1.5× slower here); ``fd`` itself where that can't be had."""
    try:
        mine = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return fd
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(mine, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return mine


class _Reader:
    """The shared state of :func:`fill_from_file`'s threads: the next job, the readahead asked for per file."""

    def __init__(self, fills: list[tuple[Any, int, int, str]], jobs: list[Any], finite: list[bool],
                 check: bool) -> None:
        self.fills, self.jobs, self.finite = fills, jobs, finite
        self.checks = [check and checks_values(f[0]) for f in fills]
        self.kinds = [_numpy_kind(f[0].dtype) for f in fills]  # (per fill, not per chunk: chunks are many)
        self.lock = threading.Lock()
        self.next = 0
        self.ahead: dict[int, tuple[int, int]] = {}  # fd -> the range last asked for
        self.nowait = getattr(os, "RWF_NOWAIT", 0)
        self.error: BaseException | None = None

    def work(self) -> None:
        import numpy as np

        try:
            with np.errstate(all="ignore"):  # an overflowing x·x is no warning: the exact test decides
                self._work()
        except BaseException as e:  # raised by fill_from_file, in its caller's thread
            self.error = self.error or e

    def _work(self) -> None:
        while True:
            with self.lock:
                j, self.next = self.next, self.next + 1
            if j >= len(self.jobs) or self.error is not None:
                return
            n, buf, offset, first, count = self.jobs[j]
            dst, fd, _start, name = self.fills[n]
            self._read(fd, buf, offset, name)
            if self.checks[n] and not _chunk_finite(dst, first, count, buf, self.kinds[n]):
                self.finite[n] = False

    def _read(self, fd: int, buf: Any, offset: int, name: str) -> None:
        done, total = 0, buf.nbytes
        if self.nowait:  # the page cache first, without waiting: a miss means the file is cold, so read ahead
            try:
                done = max(0, os.preadv(fd, [buf], offset, self.nowait))
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.nowait = 0
            if done < total:
                self._advise(fd, offset + done)
        while done < total:
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got <= 0:
                raise FormatError(f"{name}: ends at byte {offset + done}, but bytes {offset}..{offset + total} are "
                                  "needed (a truncated file?); the model may be partly loaded")
            done += got

    def _advise(self, fd: int, offset: int) -> None:
        """POSIX_FADV_WILLNEED from ``offset`` for :data:`READAHEAD_BYTES`, unless half of that is asked for."""
        with self.lock:
            start, end = self.ahead.get(fd, (0, 0))
            if start <= offset and offset + READAHEAD_BYTES // 2 <= end:
                return
            self.ahead[fd] = (offset, offset + READAHEAD_BYTES)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, READAHEAD_BYTES, os.POSIX_FADV_WILLNEED)


def _numpy_kind(dtype: Any) -> Any:
    """The numpy float type whose ``x·x`` checks a chunk of ``dtype`` (fp32/fp64, complex as pairs), else None."""
    import numpy as np
    import torch

    return {torch.float32: np.float32, torch.complex64: np.float32, torch.float64: np.float64,
            torch.complex128: np.float64}.get(dtype)


def _chunk_finite(dst: Any, first: int, count: int, raw: Any, kind: Any) -> bool:
    """Elements ``first .. first + count`` of ``dst`` (a contiguous CPU tensor; ``raw``: their bytes as a numpy
    array) are all finite: by numpy's ``x·x`` where ``kind`` (:func:`_numpy_kind`) is one, else by torch's sum;
    exactly where that is non-finite. The chunk's tensor view is made only when torch needs it."""
    import numpy as np
    import torch

    if kind is not None:
        x = raw.view(kind)
        if math.isfinite(float(np.dot(x, x))):
            return True
    part = dst.reshape(-1)[first : first + count]
    if kind is None and bool(torch.isfinite(_reduce(part))):
        return True
    return bool(_exact(part))
