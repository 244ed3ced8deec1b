"""Copying tensors with the NaN/Inf check fused in: each chunk is checked while it is still in cache.

``torch.isfinite(t).all()`` allocates a bool tensor the size of ``t`` and reads ``t`` a second time from
memory; on a 1 GiB model it cost 3× the load itself. Here a copy goes chunk by chunk (:data:`CHUNK_BYTES`), and
each chunk just written is reduced to one number (its dot product with itself, or its sum): a finite result proves
every element finite (a NaN or an Inf makes it non-finite), and only a non-finite one — a real NaN/Inf, or
finite values overflowing — needs the exact test (the chunk's minimum and maximum, which NaN and Inf propagate
to). No temporary larger than a chunk. Measured here (2 cores): the check adds about a fifth to a copy from the
page cache (bench/RESULTS.md); the plain `isfinite` pass added three times the copy.

A contiguous CPU tensor of a known float kind is checked on its bytes (:func:`bits_finite`), in :data:`READ_BYTES`
chunks shared by a few threads (:func:`run_jobs`), never by an OpenMP team: torch's reductions start one per call,
which on a busy machine waits for a core (measured here: 0.4–1.4 ms per MiB with the other core busy, against 35 µs).
The check is the compiled kernels' where they were built (:func:`native`, ``_scan.c``: one pass testing each element's
bits against its dtype's NaN/Inf pattern, AVX2 where the CPU has it; they also copy a leased file's mapped bytes with
the check fused in, :mod:`ckptfix.core.filefill`), else numpy's: fp32/fp64 chunks by ``dot`` (finite proves them
finite; numpy's OpenBLAS doesn't thread it at this size), others by two integer maxima. Both release the GIL.

A copy to a CUDA device of a tensor with no place in a file (a URL's fetched storage, a strided view) goes through two
pinned staging buffers, so reading the next chunk overlaps the transfer of the last one; a tensor a file holds goes
to the device through :func:`ckptfix.core.filefill.fill_staged`'s windows instead, read from the file.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import Any, NamedTuple

from . import libc

try:  # (imported with this module: a load's first call imports nothing)
    from . import _scan
except ImportError:  # not built (no C compiler at install): numpy checks
    _scan = None  # type: ignore[assignment]
if os.environ.get("CKPTFIX_NO_NATIVE", "") not in ("", "0"):  # (read once: the check asks per chunk)
    _scan = None  # type: ignore[assignment]

#: bytes per chunk: small enough to stay in a core's cache between the copy and the check (measured best here:
#: 1 MiB; larger chunks leave the cache, smaller ones cost more in per-call overhead than the check itself)
CHUNK_BYTES = 2**20
#: bytes per pinned staging buffer (two are used) for a copy from the CPU to a CUDA device
STAGING_BYTES = 32 * 2**20
#: bytes per check of a tensor's bytes (and per read of :mod:`~ckptfix.core.filefill`): small enough to be checked
#: in cache
READ_BYTES = 2**19
#: threads checking (or filling) tensors: torch's thread count (what its ``copy_`` uses), at most this many
MAX_READERS = 8
#: bytes of reads and checks per extra thread: starting one (and its first GIL hand-offs) costs about what one core
#: reads and checks of this many, so a small load (a server's tiny buffers, a test) starts none
THREAD_BYTES = 8 * 2**20


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


def reduction(x: Any) -> Any:
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


def finite_given(parts: list[Any], sums: list[Any]) -> bool:
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
    """Every element of ``t`` is finite, checked chunk by chunk (no tensor-sized temporary). A CPU tensor (a view of
    a mapped file, say) is checked by numpy on its bytes (:func:`_bytes_finite`), by a few threads, never by an
    OpenMP team: on a busy machine those wait for every core, on page faults too."""
    if not checks_values(t) or t.numel() == 0:
        return True
    if is_sparse(t):  # (its values: the elements it doesn't store are zeros)
        return all_finite(sparse_values(t))
    if t.is_conj() or t.is_neg():  # the stored values, finite alike (a view without the bit: no copy)
        return all_finite(_stored(t))
    if _on_bytes(t):
        return _cpu_finite(t)
    if not t.is_contiguous():  # a strided view: its rows, in chunk-sized groups
        if t.dim() == 0:
            return bool(_exact(t))
        rows = max(1, CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
        return all(all_finite(t[i : i + rows].contiguous()) for i in range(0, t.shape[0], rows))
    parts = list(t.reshape(-1).split(max(1, CHUNK_BYTES // t.element_size())))
    return finite_given(parts, [reduction(p) for p in parts])


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
        parts, sums, finite = [], [], True
        on_bytes = _on_bytes(dst)
        for part, piece in zip(dst.view(-1).split(step), src.reshape(-1).split(step)):
            part.copy_(piece)
            if on_bytes:  # checked by numpy on its bytes while the chunk is still in cache (no OpenMP team)
                finite = finite and _bytes_finite(part.view(torch.uint8).numpy(), dst.dtype)
            else:
                sums.append(reduction(part))  # while the chunk is still in cache
                parts.append(part)
        return finite and finite_given(parts, sums)


def _to_device(dst: Any, src: Any, check: bool) -> bool:
    """CPU → CUDA through two pinned buffers: a chunk is read from ``src`` (the mapped file) into one while
    the other's transfer runs; casts happen on the device. The check runs on the device, one sync at the end. A
    pinned ``src`` is copied as it is."""
    import torch

    if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape) or src.numel() == 0:
        with torch.no_grad():
            dst.copy_(src)
        return all_finite(dst) if check else True
    if src.is_pinned():  # (staged already: a DTensor's box, read from the file into pinned memory)
        with torch.no_grad():
            dst.copy_(src, non_blocking=True)
        finite = all_finite(dst) if check else True
        torch.cuda.current_stream(dst.device).synchronize()
        return finite
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
                sums.append(reduction(out))
        stream.synchronize()
    return finite_given(parts, sums)


def _on_bytes(t: Any) -> bool:
    """``t`` is checked by numpy on its bytes (:func:`bits_finite`): a contiguous CPU tensor of a known kind."""
    return bool(t.device.type == "cpu" and not is_sparse(t) and t.is_contiguous() and not (t.is_conj() or t.is_neg())
                and bit_rule(t.dtype))


def _stored(t: Any) -> Any:
    """``t`` without its conjugate or negative bit: the values as stored (finite alike; conj and neg are involutions,
    so this is a view, no copy). A sparse tensor, or one without either bit, is itself."""
    import torch

    if is_sparse(t):
        return t
    if t.is_conj():
        t = t.conj()
    return torch._neg_view(t) if t.is_neg() else t


def is_sparse(t: Any) -> bool:
    """``t`` has a sparse layout (COO, CSR, CSC, BSR, BSC): its values and indices are tensors of their own, it has no
    strides, and torch's ``copy_`` into a dense tensor refuses it."""
    import torch

    return bool(t.layout != torch.strided)


def sparse_values(t: Any) -> Any:
    """The stored values of the sparse tensor ``t`` (a COO one's as stored: coalescing would sum duplicates)."""
    import torch

    return t._values() if t.layout == torch.sparse_coo else t.values()


def _cpu_finite(t: Any) -> bool:
    return all_finite_many([t])[0]


def all_finite_many(tensors: list[Any], check: bool = True, places: list[tuple[str, int] | None] | None = None,
                    tally: Any = None) -> list[bool]:
    """:func:`all_finite` of each tensor (True for each without ``check``). The contiguous CPU ones (views of a mapped
    file, say) are checked on their bytes in :data:`READ_BYTES` chunks, all tensors' chunks shared by up to
    :data:`MAX_READERS` threads (torch's thread count at most), each tensor's pages asked for first unless they are
    cached already (``MADV_WILLNEED``: a mapped file's tensor region is read ahead whatever the mapping's advice; the
    header reads ask for ``MADV_RANDOM``; :func:`~ckptfix.core.libc.cached` tells a warm one). With ``tally`` (a
    ``checksums.Tally``), each chunk of a tensor whose ``places`` entry says where its bytes lie — ``(file, offset)`` —
    has its CRC-32 taken too, while it is in cache (digests). A sparse tensor's stored values are checked."""
    import torch

    tensors = [_stored(t) for t in tensors]  # (a conjugate or negative view: its stored bytes, where its place is)
    finite = [True] * len(tensors)
    chunks = []  # (tensor index, its bytes' chunk, (its file, offset) or None)
    for n, t in enumerate(tensors):
        place = places[n] if places is not None and tally is not None else None
        checked = check and checks_values(t)
        if t.numel() == 0 or not (checked or place is not None):
            continue
        if checked and not _on_bytes(t):  # a strided view, a kind the bit table doesn't know: torch's test
            finite[n] = all_finite(t)
        if not (_on_bytes(t) or (place is not None and not is_sparse(t) and t.is_contiguous()
                                 and t.device.type == "cpu")):
            continue
        raw = t.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes >= READ_BYTES and not libc.cached(raw.ctypes.data, raw.nbytes):
            libc.will_need(raw.ctypes.data, raw.nbytes)  # (a warm file's: not asked; 4–7 ms of CPU per GiB here)
        step = max(1, READ_BYTES // t.element_size()) * t.element_size()
        chunks += [(n, raw[i : i + step], None if place is None else (place[0], place[1] + i))
                   for i in range(0, raw.nbytes, step)]
    checks = [check and checks_values(t) and _on_bytes(t) for t in tensors]

    def job(j: int) -> None:
        n, raw, where = chunks[j]
        if checks[n] and finite[n] and not _bytes_finite(raw, tensors[n].dtype):
            finite[n] = False
        if where is not None:
            tally.add(where[0], where[1], raw)

    run_jobs(len(chunks), job, workers_for(sum(raw.nbytes for _n, raw, _o in chunks)))
    return finite


def workers_for(nbytes: int) -> int:
    """Threads worth running for ``nbytes`` of reads and checks: one per :data:`THREAD_BYTES`, at most torch's thread
    count (what its ``copy_`` uses) and :data:`MAX_READERS`; one (none started) for less."""
    import torch

    return max(1, min(MAX_READERS, torch.get_num_threads(), nbytes // THREAD_BYTES))


def run_jobs(count: int, job: Any, workers: int) -> None:
    """``job(0) … job(count - 1)`` by up to ``workers`` threads (this one among them), each taking the next index;
    the first exception stops the others and is raised here — a KeyboardInterrupt too, wherever it lands, and only
    once every job started has ended (an undo log puts back what they wrote after, never under, them), unless a
    second one comes while this thread waits for them. One thread (no thread started) for a single job."""
    lock = threading.Lock()
    state: dict[str, Any] = {"next": 0, "error": None}
    ended = threading.Condition()
    threads = {"running": 0, "closed": False}  # (a thread counts itself in: one whose start was interrupted too)

    def work() -> None:
        try:
            while state["error"] is None:
                with lock:
                    j = state["next"]
                    state["next"] = j + 1
                if j >= count:
                    return
                job(j)
        except BaseException as e:
            state["error"] = state["error"] or e

    def thread() -> None:
        with ended:
            if threads["closed"]:  # this call has stopped waiting for threads: no job
                return
            threads["running"] += 1
        try:
            work()
        finally:
            with ended:
                threads["running"] -= 1
                ended.notify()

    try:
        for _ in range(max(1, min(workers, count)) - 1):
            threading.Thread(target=thread, daemon=True).start()
        work()
    except BaseException as e:  # (out of a thread's start: the threads stop after their job too)
        state["error"] = state["error"] or e
        raise
    finally:  # (not Thread.join: interrupted, it marks a running thread stopped — bpo-45274)
        while True:
            try:
                with ended:
                    threads["closed"] = True
                    while not ended.wait_for(lambda: threads["running"] == 0, 0.05):
                        pass  # (back in Python each time: a signal the kernel gave another thread is handled here)
                break
            except BaseException as e:  # a signal's exception while waiting: the others stop after their job
                if isinstance(state["error"], KeyboardInterrupt) and isinstance(e, KeyboardInterrupt):
                    raise  # a second interrupt: a job that never ends (a hung read) is given up on
                state["error"] = state["error"] or e
    if state["error"] is not None:
        raise state["error"]


class BitRule(NamedTuple):
    """How NaN and Inf show in a dtype's bits. numpy's test: ``umax``, ``smax``, ``smin``, each bound exclusive (None:
    no such bound) — the element as an unsigned integer ``< umax``, as a signed one ``< smax`` and ``> smin``; the
    compiled kernels' (:func:`native`): NaN or Inf exactly when ``bits & mask == value`` (``mask`` 0: none can be)."""

    width: int
    umax: int | None
    smax: int | None
    smin: int | None
    mask: int
    value: int


def bit_rule(dtype: Any) -> BitRule | None:
    """How NaN and Inf show in ``dtype``'s bits (:class:`BitRule`); None for a dtype this table doesn't know (torch
    checks it).

    A float is NaN or Inf exactly when its exponent bits are all ones (IEEE kinds): as an unsigned integer that is
    ``>= sign | exponent`` for the negative ones and, as a signed integer, ``>= exponent`` for the positive ones —
    so two maxima over the chunk's bits decide it, exactly, without a temporary; or, one element at a time,
    ``bits & exponent == exponent``. float8 ``e4m3fn`` has only NaN (``S.1111.111``); ``e8m0fnu`` NaN is 0xFF; the
    ``fnuz`` kinds' one NaN is 0x80 (-128 as int8); ``float4`` has none. tests/core/test_tensorcopy.py checks every bit
    pattern of the 8- and 16-bit kinds against ``torch.isfinite``, both ways.
    """
    return _rules().get(dtype)


@functools.cache
def _rules() -> dict[Any, BitRule]:
    """:func:`bit_rule`'s table, built once (it is asked once per chunk read)."""
    import torch

    f64, f32 = (8, 0xFFF0000000000000, 0x7FF0000000000000, None), (4, 0xFF800000, 0x7F800000, None)
    rules = {torch.float64: BitRule(*f64, 0x7FF0000000000000, 0x7FF0000000000000),
             torch.float32: BitRule(*f32, 0x7F800000, 0x7F800000),
             torch.complex64: BitRule(*f32, 0x7F800000, 0x7F800000),
             torch.complex128: BitRule(*f64, 0x7FF0000000000000, 0x7FF0000000000000),
             torch.float16: BitRule(2, 0xFC00, 0x7C00, None, 0x7C00, 0x7C00),
             torch.complex32: BitRule(2, 0xFC00, 0x7C00, None, 0x7C00, 0x7C00),
             torch.bfloat16: BitRule(2, 0xFF80, 0x7F80, None, 0x7F80, 0x7F80),
             torch.float8_e5m2: BitRule(1, 0xFC, 0x7C, None, 0x7C, 0x7C),
             torch.float8_e4m3fn: BitRule(1, 0xFF, 0x7F, None, 0x7F, 0x7F),
             torch.float8_e5m2fnuz: BitRule(1, None, None, -128, 0xFF, 0x80),
             torch.float8_e4m3fnuz: BitRule(1, None, None, -128, 0xFF, 0x80)}
    for name, rule in (("float8_e8m0fnu", BitRule(1, 0xFF, None, None, 0xFF, 0xFF)),
                       ("float4_e2m1fn_x2", BitRule(1, None, None, None, 0, 0))):
        if hasattr(torch, name):
            rules[getattr(torch, name)] = rule
    return rules


def native() -> Any:
    """The compiled kernels (``ckptfix.core._scan``, built at install from ``_scan.c`` where a C compiler is: the check
    fused into the copy, see :mod:`ckptfix.core.filefill`), or None: not built, or ``CKPTFIX_NO_NATIVE=1`` (numpy
    checks, as measured beside them in bench/; read when this module is imported)."""
    return _scan


def _bytes_finite(raw: Any, dtype: Any) -> bool:
    """The values of ``dtype`` whose bytes are the numpy uint8 array ``raw`` are all finite. fp32/fp64 (complex as
    pairs): numpy's ``x·x`` first (one pass at memory speed; finite proves it), then the exact bit test."""
    import numpy as np

    with np.errstate(all="ignore"):  # an overflowing x·x is no warning: the exact test decides
        return bits_finite(raw, dtype)


def bits_finite(raw: Any, dtype: Any) -> bool:
    """:func:`_bytes_finite` under the caller's ``np.errstate(all="ignore")`` (entered once for many chunks)."""
    import numpy as np

    rule = bit_rule(dtype)
    assert rule is not None, dtype
    width, umax, smax, smin, mask, value = rule
    if _scan is not None:  # (:func:`native`)
        return not _scan.scan(raw, width, mask, value)
    if width >= 4 and raw.nbytes:
        x = raw.view(np.float32 if width == 4 else np.float64)
        if math.isfinite(float(np.dot(x, x))):
            return True
    unsigned = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
    signed = raw.view({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[width])
    if not raw.nbytes:
        return True
    return ((umax is None or int(unsigned.max()) < umax) and (smax is None or int(signed.max()) < smax)
            and (smin is None or int(signed.min()) > smin))
