"""Loads onto a CUDA device against the plain loaders and the roofline, side by side in one process (needs a GPU).

    python bench/load_gpu.py [--size-mib 1024] [--runs 5] [--json out.json]

The roofline, measured in the same run (issue 29 item 3): the lower of one pinned 256 MiB host-to-device copy
(``copy_(non_blocking=True)`` + sync) and parallel ``pread`` of the whole file into pinned buffers (one 32 MiB buffer
per thread, 4 threads), each as bytes per second, the roofline time being the file's size at that rate. Every load row
is reported as seconds, as a ratio to its group's anchor (the plain loader), and as the share of the roofline it
reaches (roofline time / its time; the goal: at least 80 %).

Groups: a model built on the GPU — ``safetensors.torch.load_model(model, path, device="cuda")`` (anchor),
``ckptfix.load_into`` (checks on and off), the staging pipeline at its plainest (:class:`Pipeline`),
fastsafetensors and runai-model-streamer where they import (each a ``load_state_dict`` of what it streamed to the
GPU); a torch zip — ``load_state_dict(torch.load(mmap=True))``
(anchor), ``ckptfix.load_into`` of the ``module.`` file; the torch zip onto the GPU — ``torch.load(mmap=True,
map_location="cuda")`` (anchor), ``ckptfix.load(map_location="cuda")``; a cast (the file saved as bf16, the model
fp32 on the GPU; its roofline is the bf16 file's) — ``load_state_dict(load_file(path, device="cuda"))`` (anchor),
``ckptfix.load_into``;
a meta-built model — ``load_state_dict(load_file(path, device="cuda"), assign=True)`` (anchor),
``ckptfix.load_into(map_location="cuda")`` (checks on, off), ``ckptfix.load``.
A row whose package doesn't import is printed as skipped. The files are in the page cache; each run ends with a
device sync; runs alternate; medians. ``--sweep`` adds ``ckptfix.load_into`` (the fp32 file and the cast) with each
of :data:`SWEEP`'s staging shapes (``filefill.DEVICE_READERS`` × ``DEVICE_WINDOWS_PER_READER`` × ``DEVICE_WINDOW_BYTES``,
and the NaN/Inf reduction), and the reductions alone; ``--busy`` the first group with every core kept busy;
``--cold N`` the first load in a fresh process (a server's start), taken apart.
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
import traceback
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


def pread_rate(torch: Any, path: str, chunk: int = 32 * MiB, runs: int = 3) -> float:
    """Bytes per second of reading the whole (cached) file with ``pread`` into pinned buffers: the best of 4, 8 and 16
    threads (at most the cores)."""
    cores = len(os.sched_getaffinity(0))
    return max(_pread_rate(torch, path, n, chunk, runs) for n in (4, 8, 16) if n <= max(4, cores))


def _pread_rate(torch: Any, path: str, threads: int, chunk: int, runs: int) -> float:
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


class Pipeline:
    """The staging pipeline at its plainest (the floor of its design, nothing of ckptfix's around it): ``threads``
    threads each read the file's next ``window`` bytes (``preadv``) into a pinned window of their own (two each, the
    older reused once an event says its copy is done), then copy it to one device buffer on a side stream."""

    def __init__(self, torch: Any, path: str, threads: int = 8, window: int = 16 * MiB) -> None:
        self.torch, self.path, self.threads, self.window = torch, path, threads, window
        self.size = os.path.getsize(path)
        self.dev = torch.empty(self.size, dtype=torch.uint8, device="cuda")
        self.windows = [[(torch.empty(window, dtype=torch.uint8, pin_memory=True), None) for _ in range(2)]
                        for _ in range(threads)]
        self.stream = torch.cuda.Stream()

    def __call__(self) -> None:
        torch = self.torch
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pool = [threading.Thread(target=self._share, args=(fd, n)) for n in range(self.threads)]
            for th in pool:
                th.start()
            for th in pool:
                th.join()
        finally:
            os.close(fd)
        torch.cuda.current_stream().wait_stream(self.stream)

    def _share(self, fd: int, n: int) -> None:
        torch = self.torch
        mine = self.windows[n]
        for i, at in enumerate(range(n * self.window, self.size, self.threads * self.window)):
            buf, done = mine[i % 2]
            if done is not None:
                done.synchronize()
            count = min(self.window, self.size - at)
            os.preadv(fd, [buf[:count].numpy()], at)
            with torch.cuda.stream(self.stream):
                self.dev[at : at + count].copy_(buf[:count], non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(self.stream)
            mine[i % 2] = (buf, event)


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
    ap.add_argument("--sweep", action="store_true", help="also time ckptfix.load_into over a grid of "
                    "filefill.DEVICE_READERS x DEVICE_WINDOWS_PER_READER x DEVICE_WINDOW_BYTES")
    ap.add_argument("--busy", action="store_true", help="also time the first group with every core kept busy")
    ap.add_argument("--cold", type=int, default=0, metavar="N",
                    help="also time N first loads, each in a fresh process (a server's start)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also say where load_into's reader threads spend their time (reads, waits for windows, the rest)")
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
    st.save_file({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, f"{work}/m_bf16.safetensors")
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, f"{work}/m_ddp.pth")
    torch.save(src.state_dict(), f"{work}/m.pth")
    for name in ("m.safetensors", "m_bf16.safetensors", "m.pth", "m_ddp.pth"):
        with open(f"{work}/{name}", "rb") as f:
            while f.read(64 * MiB):
                pass
    path, half = f"{work}/m.safetensors", f"{work}/m_bf16.safetensors"
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
            "the pipeline's floor: pread into pinned windows, async copies (8 threads, no checks)": Pipeline(torch, path),
            **optional_rows(torch, model, path),
        },
        "built on the GPU, torch zip": {
            "torch.load(mmap) + load_state_dict": lambda: model.load_state_dict(
                torch.load(f"{work}/m.pth", mmap=True, weights_only=True)),
            "ckptfix.load_into m_ddp.pth": lambda: ckptfix.load_into(model, f"{work}/m_ddp.pth"),
        },
        "a torch zip onto the GPU (no model)": {
            "torch.load(mmap, map_location=cuda)": lambda: torch.load(f"{work}/m.pth", mmap=True, weights_only=True,
                                                                      map_location="cuda"),
            "ckptfix.load m.pth map_location=cuda": lambda: ckptfix.load(f"{work}/m.pth", map_location="cuda"),
        },
        "built on the GPU, bf16 file into fp32 (a cast)": {
            "load_state_dict(load_file(cuda))": lambda: model.load_state_dict(st.load_file(half, device="cuda")),
            "ckptfix.load_into (cast)": lambda: ckptfix.load_into(model, half),
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
    rooflines = {group: (os.path.getsize(half) if "bf16" in group else size) / min(rates.values()) for group in groups}
    runnable = {name: fn for rows in groups.values() for name, fn in rows.items() if callable(fn)}
    failed: dict[str, str] = {}
    for name, fn in list(runnable.items()):  # (first-call set-up out of the timings; a row that fails is reported)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the other rows still measured)
            traceback.print_exc()
            failed[name] = f"failed: {type(e).__name__}: {e}"[:300]
            del runnable[name]
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
            if not callable(fn) or name in failed:
                print(f"| {group} | {name} | {failed.get(name, fn)} | | |")
                continue
            med = statistics.median(times[name])
            anchor = anchor or med
            print(f"| {group} | {name} | {med:.3f} | {med / anchor:.2f} | {100 * rooflines[group] / med:.0f} % |")
            out["rows"][name] = {"group": group, "s": med, "ratio": med / anchor, "roofline": rooflines[group] / med}
    if args.busy:
        out["busy"] = busy(torch, groups["built on the GPU, safetensors"], runnable, args.runs, rooflines)
    if args.cold:
        out["cold"] = cold(path, layers, args.cold, roofline)
    if args.breakdown:
        out["breakdown"] = {label: breakdown(torch, lambda p=p: ckptfix.load_into(model, p), args.runs)
                            for label, p in {"fp32": path, "bf16 cast": half}.items()}
    if args.sweep:
        out["reductions"] = reductions(torch)
        out["sweep"] = sweep(torch, ckptfix, model, {"fp32": path, "bf16 cast": half}, args.runs, min(rates.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


#: the staging's (readers, windows per reader, MiB per window) that --sweep compares
#: (and the NaN/Inf reduction queued per piece: tensorcopy.reduction's x·x, a sum, or none: check_values=False)
SWEEP = [(4, 2, 16, "dot"), (8, 1, 16, "dot"), (8, 2, 16, "dot"), (8, 3, 16, "dot"), (8, 2, 32, "dot"),
         (16, 2, 16, "dot"), (8, 2, 16, "sum"), (16, 2, 16, "sum"), (8, 2, 16, "off")]


def sweep(torch: Any, ckptfix: Any, model: Any, paths: dict[str, str], runs: int, rate: float) -> list[Any]:
    """``ckptfix.load_into(model, path)`` (a model built on the GPU) for each of ``paths`` with each of :data:`SWEEP`'s
    staging shapes (issue 29's tuning), the shapes interleaved in each round (the machine's drift shared); the defaults
    restored after. Median seconds per cell, and the share of the roofline (each file's size at ``rate``)."""
    from ckptfix.core import filefill, tensorcopy

    knobs = ("DEVICE_READERS", "DEVICE_WINDOWS_PER_READER", "DEVICE_WINDOW_BYTES")
    saved = {k: getattr(filefill, k) for k in knobs}
    dot = tensorcopy.reduction
    kinds = {"dot": dot, "sum": lambda x: x.sum(), "off": dot}
    times: dict[tuple[Any, str], list[float]] = {(shape, label): [] for shape in SWEEP for label in paths}
    try:
        for r in range(runs + 1):
            for shape in SWEEP if r % 2 else reversed(SWEEP):
                readers, each, mib, kind = shape
                for k, v in zip(knobs, (readers, each, mib * MiB)):
                    setattr(filefill, k, v)
                tensorcopy.reduction = kinds[kind]
                for label, p in paths.items():
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    ckptfix.load_into(model, p, check_values=kind != "off")
                    torch.cuda.synchronize()
                    if r:  # (round 0 untimed)
                        times[shape, label].append(time.perf_counter() - t)
    finally:
        for k, v in saved.items():
            setattr(filefill, k, v)
        tensorcopy.reduction = dot
    print("\n| readers | windows each | MiB each | reduction | " + " | ".join(f"{k} s | {k} % of roofline" for k in paths) + " |")
    print("|---:|---:|---:|---|" + "---:|---:|" * len(paths))
    cells = []
    for shape in SWEEP:
        cell: dict[str, Any] = dict(zip(("readers", "windows_each", "mib", "reduction"), shape))
        for label in paths:
            cell[label] = statistics.median(times[shape, label])
        cells.append(cell)
        print("| " + " | ".join(map(str, shape)) + " | " + " | ".join(
            f"{cell[k]:.4f} | {100 * os.path.getsize(p) / rate / cell[k]:.0f} %" for k, p in paths.items()) + " |")
    return cells


def reductions(torch: Any, chunks: int = 64, nbytes: int = 16 * MiB) -> dict[str, float]:
    """Seconds of the NaN/Inf reductions a GPU fill may queue behind its copies: one per 16 MiB fp32 chunk of 1 GiB,
    on one stream, one sync at the end (the median of 5)."""
    xs = [torch.randn(nbytes // 4, device="cuda") for _ in range(chunks)]
    kinds = {"dot(x, x)": lambda x: torch.dot(x, x), "sum": lambda x: x.sum(),
             "aminmax": lambda x: torch.aminmax(x), "isfinite().all()": lambda x: torch.isfinite(x).all()}
    got = {}
    for name, fn in kinds.items():
        got[name] = statistics.median(timed(torch, lambda fn=fn: [fn(x) for x in xs], 5))
    print("\nNaN/Inf reductions over 1 GiB of fp32 in 16 MiB chunks (s): "
          + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
    return got


def breakdown(torch: Any, load: Callable[[], object], runs: int) -> dict[str, float]:
    """Where the staging's reader threads spend a load (``runs`` loads, seconds per load summed over the threads):
    reading (``_Reader._read``: ``preadv``), taking a window (``_Staging._take``: waiting for a window's copies, or
    pinning a new one), and the rest of each job (the copies' and reductions' launches, Python); beside the load's
    own time. Measured by wrapping those methods, the library untouched."""
    from ckptfix.core import filefill

    spent = {"read": 0.0, "take": 0.0, "job": 0.0}
    lock = threading.Lock()
    originals = (filefill._Reader._read, filefill._Staging._take, filefill._Staging.job)

    def timing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t
        return wrapped

    filefill._Reader._read = timing("read", originals[0])  # type: ignore[method-assign]
    filefill._Staging._take = timing("take", originals[1])  # type: ignore[method-assign]
    filefill._Staging.job = timing("job", originals[2])  # type: ignore[method-assign]
    try:
        wall = statistics.median(timed(torch, load, runs))
    finally:
        filefill._Reader._read, filefill._Staging._take, filefill._Staging.job = originals  # type: ignore[method-assign]
    per = {k: v / (runs + 1) for k, v in spent.items()}  # (timed() runs it once untimed first)
    got = {"wall": wall, "read": per["read"], "take": per["take"],
           "rest of the jobs": per["job"] - per["read"] - per["take"]}
    print("\nload_into's readers, s per load summed over threads: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
    return got


def timed(torch: Any, fn: Callable[[], object], runs: int) -> list[float]:
    """Seconds of each of ``runs`` calls of ``fn`` (after one untimed), each ended by a device sync."""
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def busy(torch: Any, rows: dict[str, Any], runnable: dict[str, Any], runs: int, rooflines: dict[str, float]) -> Any:
    """The rows of the first group again, every core kept busy by a spinning process (the page faults and the
    readers share them)."""
    import subprocess

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.5)
        got = {name: statistics.median(timed(torch, runnable[name], runs)) for name in rows if name in runnable}
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    roof = next(iter(rooflines.values()))
    anchor = next(iter(got.values()))
    print(f"\nevery core busy ({len(spinners)} spinning processes):")
    for name, s in got.items():
        print(f"| busy | {name} | {s:.3f} | {s / anchor:.2f} | {100 * roof / s:.0f} % |")
    return got


COLD = """
import json, os, sys, time, torch
from torch import nn
path, tiny, layers, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with torch.device("cuda"):
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
torch.cuda.synchronize()
got = {}
if how.startswith("safetensors"):
    import safetensors.torch as st
    load = lambda: st.load_model(model, path, device="cuda")
else:
    import ckptfix
    from ckptfix.core import filefill
    load = lambda: ckptfix.load_into(model, path)
    if "warmed" in how:  # (ckptfix's own imports, then the windows' pinned bytes, each timed, before the load)
        t = time.perf_counter()
        ckptfix.load_into(nn.Linear(64, 64, bias=False), tiny)
        got["imports"] = time.perf_counter() - t
        t = time.perf_counter()
        windows = [torch.empty(filefill.DEVICE_WINDOW_BYTES, dtype=torch.uint8, pin_memory=True)
                   for _ in range(filefill.DEVICE_READERS * filefill.DEVICE_WINDOWS_PER_READER)]
        got["pinned windows"] = time.perf_counter() - t
        del windows
for n in ("first", "second"):
    t = time.perf_counter()
    load()
    torch.cuda.synchronize()
    got[n] = time.perf_counter() - t
print(json.dumps(got))
"""

#: the fresh-process rows: (name, extra environment)
COLD_ROWS = {
    "safetensors": {},
    "ckptfix": {},
    "ckptfix warmed": {},
    "ckptfix, pinned by cudaHostRegister on 8 threads": {
        "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"},
}


def cold(path: str, layers: int, n: int, roofline: float) -> dict[str, list[Any]]:
    """A server's start: the first load in a fresh process (CUDA initialised, the model built on the GPU, the file in
    the page cache), ``n`` times for each of :data:`COLD_ROWS`, alternating; the pinned windows' allocation is in it.
    'warmed' times ckptfix's imports (a tiny load) and the windows' pinned allocation first, then the load."""
    import json
    import subprocess

    import safetensors.torch as st
    import torch

    tiny = os.path.join(os.path.dirname(path), "tiny.safetensors")
    st.save_file({"weight": torch.zeros(64, 64)}, tiny)
    got: dict[str, list[Any]] = {k: [] for k in COLD_ROWS}
    for _ in range(n):
        for how, extra in COLD_ROWS.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}
            res = subprocess.run([sys.executable, "-c", COLD, path, tiny, str(layers), how], capture_output=True,
                                 text=True, env=env, check=False)
            if res.returncode:
                print(f"cold {how} failed: {res.stderr[-2000:]}")
                continue
            got[how].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"\nfirst load in a fresh process (median of {n}; s):")
    for how, runs in got.items():
        if runs:
            parts = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| cold | {how} | {parts['first']:.3f} | {100 * roofline / parts['first']:.0f} % | "
                  + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()) + " |")
    return got


if __name__ == "__main__":
    main()
