"""Copying tensors with the NaN/Inf check fused in: each chunk is checked while it is still in cache.

``torch.isfinite(t).all()`` allocates a bool tensor the size of ``t`` and reads ``t`` a second time from
memory; on a 1 GiB model it cost 3× the load itself. Here a copy goes chunk by chunk (16 MiB), and each
chunk just written is summed: a finite sum proves every element finite (a NaN or an Inf makes the sum
non-finite), and only a non-finite sum — a real NaN/Inf, or finite values overflowing — needs the exact
test (the chunk's minimum and maximum, which NaN and Inf propagate to). No temporary larger than a chunk.

A copy to a CUDA device goes through two pinned staging buffers, so reading the next chunk from the
mapped file overlaps the transfer of the last one.
"""

from __future__ import annotations

import math
from typing import Any

#: bytes per chunk: small enough to stay in the CPU's cache between the copy and the check
CHUNK_BYTES = 16 * 2**20
#: bytes per pinned staging buffer (two are used) for a copy from the CPU to a CUDA device
STAGING_BYTES = 32 * 2**20


def checks_values(t: Any) -> bool:
    """Floating and complex tensors can hold NaN/Inf; integer and bool tensors can't."""
    return bool(t.is_floating_point() or t.is_complex())


def chunk_finite(x: Any) -> Any:
    """A 0-d bool tensor: every element of the 1-D chunk ``x`` is finite (on ``x``'s device, no sync)."""
    import torch

    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = x.float()  # float8 kinds: torch has no sum for them (a chunk-sized temporary)
    total = x.sum()
    if x.device.type == "cpu":
        if math.isfinite(float(total)):
            return torch.tensor(True)
        return _exact(x)
    return torch.isfinite(total) | _exact(x)  # on a device: both computed, no host round trip


def _exact(x: Any) -> Any:
    import torch

    if x.numel() == 0:
        return torch.tensor(True, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.isfinite(lo) & torch.isfinite(hi)


def all_finite(t: Any) -> bool:
    """Every element of ``t`` is finite, checked chunk by chunk (no tensor-sized temporary)."""
    if not checks_values(t) or t.numel() == 0:
        return True
    flat = t.reshape(-1) if t.is_contiguous() else None
    if flat is None:  # a strided view: check it row by row of its first dimension, in chunk-sized groups
        rows = max(1, CHUNK_BYTES // max(1, t[0].numel() * t.element_size())) if t.dim() > 0 else 1
        return all(all_finite(t[i : i + rows].contiguous()) for i in range(0, t.shape[0], rows))
    step = max(1, CHUNK_BYTES // t.element_size())
    flags = [chunk_finite(flat[i : i + step]) for i in range(0, flat.numel(), step)]
    return all(bool(f) for f in flags)


def copy_checked(dst: Any, src: Any, check: bool = True) -> bool:
    """``dst.copy_(src)`` (casting as torch does); with ``check``, returns whether every value copied is
    finite, tested on each chunk just after it is written. Returns True for integer/bool tensors."""
    import torch

    check = check and checks_values(dst)
    if dst.device.type == "cuda" and src.device.type == "cpu":
        return _to_device(dst, src, check)
    with torch.no_grad():
        if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
            dst.copy_(src)
            return all_finite(dst) if check else True
        d, s = dst.view(-1), src.reshape(-1)
        step = max(1, CHUNK_BYTES // max(dst.element_size(), src.element_size()))
        if not check or d.numel() <= step:
            d.copy_(s)
            return bool(chunk_finite(d)) if check and d.numel() else True
        flags = []
        for i in range(0, d.numel(), step):
            part = d[i : i + step]
            part.copy_(s[i : i + step])
            flags.append(chunk_finite(part))
        return all(bool(f) for f in flags)


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
    flags = []
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
                flags.append(chunk_finite(out))
        stream.synchronize()
    return bool(torch.stack(flags).all()) if flags else True
