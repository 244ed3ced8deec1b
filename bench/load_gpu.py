"""Loads onto a CUDA device against the plain loaders and the roofline, side by side in one process (needs a GPU).

    python bench/load_gpu.py [--size-mib 1024] [--runs 5] [--json out.json]

The roofline, measured in the same run (issue 29 item 3): the lower of one pinned 256 MiB host-to-device copy
(``copy_(non_blocking=True)`` + sync) and parallel ``pread`` of the whole file into pinned buffers (one 32 MiB buffer
per thread, 4 threads), each as bytes per second, the roofline time being the file's size at that rate. Every load row
is reported as seconds, as a ratio to its group's anchor (the plain loader), and as the share of the roofline it
reaches (roofline time / its time; the goal: at least 80 %).

Groups: a model built on the GPU — ``safetensors.torch.load_model(model, path, device="cuda")`` (anchor),
``ckptfix.load_into`` (checks on and off), fastsafetensors and runai-model-streamer where they import (each a
``load_state_dict`` of what it streamed to the GPU); a torch zip — ``load_state_dict(torch.load(mmap=True))``
(anchor), ``ckptfix.load_into`` of the ``module.`` file; a meta-built model — ``load_state_dict(load_file(path,
device="cuda"), assign=True)`` (anchor), ``ckptfix.load_into(map_location="cuda")`` (checks on, off), ``ckptfix.load``.
A row whose package doesn't import is printed as skipped. The files are in the page cache; each run ends with a
device sync; runs alternate; medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20


def h2d_rate(torch: Any, nbytes: int = 256 * MiB, runs: int = 5) -> float:
    """Bytes per second of one pinned ``nbytes`` host-to-device copy (the best of ``runs``)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def pread_rate(torch: Any, path: str, threads: int = 4, chunk: int = 32 * MiB, runs: int = 3) -> float:
    """Bytes per second of reading the whole (cached) file with ``pread`` into pinned buffers by ``threads`` threads."""
    size = os.path.getsize(path)
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(threads)]
    best = float("inf")
    for _ in range(runs):
        fd = os.open(path, os.O_RDONLY)
        try:
            t = time.perf_counter()
            pool = [threading.Thread(target=_read_share, args=(fd, size, chunk, buf, n, threads))
                    for n, buf in enumerate(buffers)]
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            best = min(best, time.perf_counter() - t)
        finally:
            os.close(fd)
    return size / best


def _read_share(fd: int, size: int, chunk: int, buf: Any, n: int, threads: int) -> None:
    """Thread ``n``'s chunks of the file (every ``threads``-th), each read into ``buf``."""
    for at in range(n * chunk, size, threads * chunk):
        os.preadv(fd, [buf[: min(chunk, size - at)]], at)


def optional_rows(torch: Any, model: Any, path: str) -> dict[str, Callable[[], object] | str]:
    """fastsafetensors and runai-model-streamer rows, or why each is skipped."""
    rows: dict[str, Callable[[], object] | str] = {}
    if importlib.util.find_spec("fastsafetensors") is None:
        rows["fastsafetensors (cuda) + load_state_dict"] = "skipped: fastsafetensors does not import"
    else:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def fast() -> None:
            loader = SafeTensorsFileLoader(SingleGroup(), torch.device("cuda:0"), nogds=True)
            loader.add_filenames({0: [path]})
            buffers = loader.copy_files_to_device()
            model.load_state_dict({k: buffers.get_tensor(k) for k in buffers.key_to_rank_lidx})
            buffers.close()
            loader.close()

        rows["fastsafetensors (cuda) + load_state_dict"] = fast
    if importlib.util.find_spec("runai_model_streamer") is None:
        rows["runai-model-streamer (cuda) + load_state_dict"] = "skipped: runai-model-streamer does not import"
    else:
        from runai_model_streamer import SafetensorsStreamer

        def runai() -> None:
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(path)
                model.load_state_dict({k: t.to("cuda", non_blocking=True) for k, t in streamer.get_tensors()})

        rows["runai-model-streamer (cuda) + load_state_dict"] = runai
    return rows


def main() -> None:
    import safetensors.torch as st
    import torch
    from torch import nn

    import ckptfix

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA: nothing measured")
        return
    layers = max(1, args.size_mib // 16)

    def net() -> nn.Module:
        return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])

    work = tempfile.mkdtemp()
    src = net()
    st.save_model(src, f"{work}/m.safetensors")
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, f"{work}/m_ddp.pth")
    torch.save(src.state_dict(), f"{work}/m.pth")
    for name in ("m.safetensors", "m.pth", "m_ddp.pth"):
        with open(f"{work}/{name}", "rb") as f:
            while f.read(64 * MiB):
                pass
    path = f"{work}/m.safetensors"
    size = os.path.getsize(path)
    model = net().cuda()

    def meta_then(fn: Callable[[nn.Module], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.device("meta"):
                m = net()
            return fn(m)
        return run

    groups: dict[str, dict[str, Callable[[], object] | str]] = {
        "built on the GPU, safetensors": {
            "safetensors.load_model (cuda)": lambda: st.load_model(model, path, device="cuda"),
            "ckptfix.load_into": lambda: ckptfix.load_into(model, path),
            "ckptfix.load_into, check_values=False": lambda: ckptfix.load_into(model, path, check_values=False),
            **optional_rows(torch, model, path),
        },
        "built on the GPU, torch zip": {
            "torch.load(mmap) + load_state_dict": lambda: model.load_state_dict(
                torch.load(f"{work}/m.pth", mmap=True, weights_only=True)),
            "ckptfix.load_into m_ddp.pth": lambda: ckptfix.load_into(model, f"{work}/m_ddp.pth"),
        },
        "meta-built, safetensors": {
            "load_file(cuda) + assign=True": meta_then(lambda m: m.load_state_dict(
                st.load_file(path, device="cuda"), assign=True)),
            "ckptfix.load_into map_location=cuda": meta_then(
                lambda m: ckptfix.load_into(m, path, map_location="cuda")),
            "ckptfix.load_into map_location=cuda, check_values=False": meta_then(
                lambda m: ckptfix.load_into(m, path, map_location="cuda", check_values=False)),
            "ckptfix.load map_location=cuda": lambda: ckptfix.load(path, map_location="cuda"),
        },
    }
    rates = {"pinned 256 MiB H2D copy": h2d_rate(torch), "parallel pread into pinned buffers": pread_rate(torch, path)}
    roofline = size / min(rates.values())
    runnable = {name: fn for rows in groups.values() for name, fn in rows.items() if callable(fn)}
    for fn in runnable.values():  # (first-call set-up out of the timings)
        fn()
    times: dict[str, list[float]] = {k: [] for k in runnable}
    for r in range(args.runs):
        for name, fn in (list(runnable.items()) if r % 2 == 0 else list(reversed(runnable.items()))):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    print(f"{torch.cuda.get_device_name()}, {size / MiB:.0f} MiB fp32 safetensors, median of {args.runs} runs; "
          + "; ".join(f"{k}: {v / 1e9:.1f} GB/s" for k, v in rates.items())
          + f"; roofline {roofline * 1e3:.1f} ms")
    print("| group | row | s | × anchor | % of roofline |")
    print("|---|---|---:|---:|---:|")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "bytes": size, "rates": rates, "rows": {}}
    for group, rows in groups.items():
        anchor = None
        for name, fn in rows.items():
            if not callable(fn):
                print(f"| {group} | {name} | {fn} | | |")
                continue
            med = statistics.median(times[name])
            anchor = anchor or med
            print(f"| {group} | {name} | {med:.3f} | {med / anchor:.2f} | {100 * roofline / med:.0f} % |")
            out["rows"][name] = {"group": group, "s": med, "ratio": med / anchor, "roofline": roofline / med}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
