"""Benchmark: ways to fill a CPU-built model from a safetensors file with the NaN/Inf check (issue 18, item 1).

Not a test. One process, variants alternating in each round (order reversed every other round), many rounds;
prints each variant's median and min seconds and its min/median ratio to ``safetensors.torch.load_model``.
The model (``Linear(width, width)`` layers) is built on the CPU and written once; every variant overwrites it.

    python bench/copy_variants.py /var/tmp/x/m.safetensors --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root
from tests.page_cache import drop_from_page_cache  # noqa: E402


def header(path: str) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return 8 + n, meta


NET = nn.Module()


def build(path: str) -> dict[str, torch.Tensor]:
    """A module holding the file's tensors as parameters (``NET``, for load_model), ones; its state dict."""
    global NET
    _, meta = header(path)
    width = meta["layers.0.weight"]["shape"][0]
    layers = len(meta) // 2
    NET = nn.Module()
    NET.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
    with torch.no_grad():
        for p in NET.parameters():
            p.fill_(1.0)
    return {k: v.detach() for k, v in NET.state_dict().items()}


def view_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def v_load_model(model: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import load_model

    load_model(NET, path)


def v_ckptfix(check: bool) -> Callable[..., Any]:
    def run(model: dict[str, torch.Tensor], path: str) -> None:
        import ckptfix

        ckptfix.load_into(NET, path, check_values=check)
    return run


def _mapped(path: str) -> dict[str, torch.Tensor]:
    base, meta = header(path)
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    out = {}
    for k, v in meta.items():
        a, b = v["data_offsets"]
        t = torch.empty(0, dtype=torch.float32)
        t.set_(storage[base + a: base + b], 0, v["shape"])
        out[k] = t
    return out


def v_map_copy(model: dict[str, torch.Tensor], path: str) -> None:
    src = _mapped(path)
    with torch.no_grad():
        for k, t in model.items():
            t.copy_(src[k])


def v_map_copy_dot(chunk: int) -> Callable[..., Any]:
    def run(model: dict[str, torch.Tensor], path: str) -> None:
        src = _mapped(path)
        sums = []
        with torch.no_grad():
            for k, t in model.items():
                step = chunk // 4
                for part, piece in zip(t.view(-1).split(step), src[k].reshape(-1).split(step)):
                    part.copy_(piece)
                    sums.append(torch.dot(part, part))
        assert bool(torch.isfinite(torch.stack(sums)).all())
    return run


def _offsets(path: str) -> dict[str, int]:
    base, meta = header(path)
    return {k: base + v["data_offsets"][0] for k, v in meta.items()}


def v_pread(chunk: int, check: bool, advise: bool = True, reduce: str = "dot") -> Callable[..., Any]:
    def run(model: dict[str, torch.Tensor], path: str) -> None:
        offs = _offsets(path)
        fd = os.open(path, os.O_RDONLY)
        if advise:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        sums = []
        try:
            with torch.no_grad():
                for k, t in model.items():
                    buf = view_bytes(t)
                    flat = t.view(-1)
                    off = offs[k]
                    step = chunk // 4
                    for i in range(0, flat.numel(), step):
                        n = min(step, flat.numel() - i)
                        got = os.preadv(fd, [buf[i * 4:(i + n) * 4]], off + i * 4)
                        assert got == n * 4
                        if check:
                            part = flat[i:i + n]
                            fn = {"dot": torch.dot, "vdot": torch.vdot}.get(reduce)
                            sums.append(fn(part, part) if fn else part.sum())
        finally:
            os.close(fd)
        if check:
            assert bool(torch.isfinite(torch.stack(sums)).all())
    return run


def v_pread_whole_then_dot(model: dict[str, torch.Tensor], path: str) -> None:
    offs = _offsets(path)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    sums = []
    with torch.no_grad():
        for k, t in model.items():
            buf = view_bytes(t)
            os.preadv(fd, [buf], offs[k])
            f = t.view(-1)
            sums.append(torch.dot(f, f))
    os.close(fd)
    assert bool(torch.isfinite(torch.stack(sums)).all())


def v_pread_threads(chunk: int) -> Callable[..., Any]:
    """A reader thread preadv's chunks ahead; the main thread checks each chunk once it has landed."""
    def run(model: dict[str, torch.Tensor], path: str) -> None:
        offs = _offsets(path)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        jobs = []
        for k, t in model.items():
            flat = t.view(-1)
            buf = view_bytes(t)
            step = chunk // 4
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                jobs.append((buf[i * 4:(i + n) * 4], offs[k] + i * 4, flat[i:i + n]))
        done = [threading.Event() for _ in jobs]

        def reader() -> None:
            for (b, off, _), ev in zip(jobs, done):
                os.preadv(fd, [b], off)
                ev.set()

        th = threading.Thread(target=reader)
        th.start()
        sums = []
        with torch.no_grad():
            for (_, _, part), ev in zip(jobs, done):
                ev.wait()
                sums.append(torch.dot(part, part))
        th.join()
        os.close(fd)
        assert bool(torch.isfinite(torch.stack(sums)).all())
    return run


def v_pool(chunk: int, workers: int, window: int = 0, check: bool = True, dot: str = "torch") -> Callable[..., Any]:
    """``workers`` threads take chunks in turn, each preadv's its chunk and checks it on its own core, in its cache.
    ``window``: POSIX_FADV_WILLNEED that many bytes ahead of the reads (a cold file read in the background).
    ``dot``: ``torch`` (``torch.dot``: an OpenMP team per call) or ``numpy`` (``np.dot``: single-threaded OpenBLAS
    at these sizes, no team)."""
    import itertools

    import numpy as np

    reduce = (lambda x: np.dot(x, x)) if dot == "numpy" else (lambda x: torch.dot(x, x))

    def run(model: dict[str, torch.Tensor], path: str) -> None:
        offs = _offsets(path)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        step = chunk // 4
        jobs = []  # (the chunk's bytes to read into, its file offset, the chunk as the reduction takes it)
        for k, t in model.items():
            flat = t.view(-1)
            arr, buf = flat.numpy(), view_bytes(t)
            for i in range(0, flat.numel(), step):
                n = min(step, flat.numel() - i)
                jobs.append((buf[i * 4:(i + n) * 4], offs[k] + i * 4, arr[i:i + n] if dot == "numpy" else flat[i:i + n]))
        sums: list[Any] = [None] * len(jobs)
        counter = itertools.count()
        advised = [0]

        def work() -> None:
            with torch.no_grad():
                while (j := next(counter)) < len(jobs):
                    b, off, part = jobs[j]
                    if window and off + window > advised[0]:
                        start = max(advised[0], off)
                        advised[0] = start + 2 * window
                        os.posix_fadvise(fd, start, 2 * window, os.POSIX_FADV_WILLNEED)
                    os.preadv(fd, [b], off)
                    if check:
                        sums[j] = reduce(part)  # (kept as it comes: no sync per chunk)

        threads = [threading.Thread(target=work) for _ in range(workers - 1)]
        for th in threads:
            th.start()
        work()
        for th in threads:
            th.join()
        os.close(fd)
        if check:
            assert bool(np.isfinite(np.array(sums)).all() if dot == "numpy" else torch.isfinite(torch.stack(sums)).all())
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants: dict[str, Callable[..., Any]] = {
        "load_model(safe_open+copy_)": v_load_model,
        "map_copy": v_map_copy,
        "ckptfix.load_into": v_ckptfix(True),
        "ckptfix.load_into(check_values=False)": v_ckptfix(False),
        "map_copy_dot_1M": v_map_copy_dot(2**20),
        "pread_1M_nocheck": v_pread(2**20, False),
        "pread_whole_nocheck": v_pread(2**30, False),
        "pread_256K_dot": v_pread(2**18, True),
        "pread_512K_dot": v_pread(2**19, True),
        "pread_1M_dot": v_pread(2**20, True),
        "pread_2M_dot": v_pread(2**21, True),
        "pread_4M_dot": v_pread(2**22, True),
        "pread_1M_dot_noadvise": v_pread(2**20, True, advise=False),
        "pread_1M_sum": v_pread(2**20, True, reduce="sum"),
        "pread_1M_vdot": v_pread(2**20, True, reduce="vdot"),
        "pread_threads_512K": v_pread_threads(2**19),
        "pread_threads_2M": v_pread_threads(2**21),
        "pread_whole_then_dot": v_pread_whole_then_dot,
        "pread_threads_1M": v_pread_threads(2**20),
        "pool2_1M": v_pool(2**20, 2),
        "np1_1M": v_pool(2**20, 1, dot="numpy"),
        "np1_512K": v_pool(2**19, 1, dot="numpy"),
        "np1_256K": v_pool(2**18, 1, dot="numpy"),
        "np1_1M_nocheck": v_pool(2**20, 1, check=False, dot="numpy"),
        "np2_1M": v_pool(2**20, 2, dot="numpy"),
        "np2_512K": v_pool(2**19, 2, dot="numpy"),
        "np2_1M_nocheck": v_pool(2**20, 2, check=False, dot="numpy"),
        "np2_1M_win64M": v_pool(2**20, 2, window=64 * 2**20, dot="numpy"),
        "pool2_512K": v_pool(2**19, 2),
        "pool2_256K": v_pool(2**18, 2),
        "pool2_1M_nocheck": v_pool(2**20, 2, check=False),
        "pool2_1M_win64M": v_pool(2**20, 2, window=64 * 2**20),
        "pool1_1M_win64M": v_pool(2**20, 1, window=64 * 2**20),
        "pool3_1M": v_pool(2**20, 3),
        "pread_threads_4M": v_pread_threads(2**22),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
    model = build(args.path)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds + 1):
        for name in names if r % 2 == 0 else reversed(names):
            if args.cold:
                drop_from_page_cache(args.path)
            else:
                with open(args.path, "rb") as f:
                    while f.read(64 << 20):
                        pass
            t0 = time.perf_counter()
            variants[name](model, args.path)
            dt = time.perf_counter() - t0
            if r:  # round 0: warm-up
                times[name].append(dt)
    anchor = times[names[0]]
    print(f"{'variant':32} {'median':>8} {'min':>8} {'med/anc':>8} {'min/anc':>8}")
    for name in names:
        ts = times[name]
        print(f"{name:32} {statistics.median(ts):8.3f} {min(ts):8.3f} "
              f"{statistics.median(ts) / statistics.median(anchor):8.2f} {min(ts) / min(anchor):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
