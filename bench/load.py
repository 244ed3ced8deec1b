"""Benchmark: ``ckptfix.load_into`` against the plain loaders (issue 18): time and peak anonymous memory.

Not a test. Makes a model of --size-mib of fp32 weights (Linear(--width, --width) layers; 64 × 2048 =
1 GiB by default) and four files of it under --workdir: m.safetensors (``save_model``) and m.pth (plain keys), both
rewritten by ``ckptfix convert`` (per-tensor digests, which ckptfix's loads check by default),
m_ddp.pth (``module.``, as DataParallel/DDP save it) and m_compiled.pth (``_orig_mod.``, a ``torch.compile``d
model's keys), then loads each row's file into a model, in groups that share an anchor:

- safetensors file, CPU-built model: ``safetensors.torch.load_model``; ckptfix with its checks on and with
  ``check_values=False``; runai-model-streamer's ``SafetensorsStreamer`` (CPU) + ``load_state_dict``;
- torch zip file, CPU-built model: ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict`` on the
  plain keys; the same without mmap; ckptfix on each of the three zips (checks on / off);
- safetensors file, meta-built model: ``load_state_dict(load_file(path), assign=True)``; ckptfix (the NaN/Inf check
  on and digest checks off, against ``load_model`` into a CPU-built model as the issue asks; the same with the
  file's digests checked, as a meta-built load does by default; checks off);
- FSDP2, 2 ranks (gloo, CPU, one thread each): each rank ``torch.load(mmap=True)`` + ``set_model_state_dict(
  full_state_dict=True)`` (which ``distribute_tensor``s every parameter); ckptfix. Time of the slowest rank.

Method. Every run is its own process, forked from a server that has imported torch, safetensors and ckptfix
(multiprocessing's forkserver), so each starts fresh (no allocator or mapping left by another row, no
leftover cached state) without paying ``import torch`` each time. In it, before the timer: the model is
built (CPU: allocated and written; meta: ``with torch.device("meta")``; FSDP2: ``fully_shard`` per layer, then
``to_empty``); the row's loader runs once on a tiny file of the same format and keys (first-call imports
and lazy set-up out of the timer, for every row alike); then the file is read once (warm) or ``os.sync()`` +
POSIX_FADV_DONTNEED drop its pages (cold; mincore(2) counts any that stayed: then the row says "cold not
possible", and the rows whose ratio is to it have no cold ratio). Only the load call is
timed. After it, the loaded values are compared bit for bit with rows of the saved model (a wrong or
partial load fails the row). Rounds alternate the order of the runs (forward, then backward); the ratio
to the anchor is the median of the per-round ratios, anchor and row timed in the same round. Peak RssAnon
is sampled every 5 ms from outside the process within the load's window (and once right after it):
"growth" is that peak minus the process's RssAnon just before the load, "− anchor" the difference of the
two rows' peaks (the same model built in both).

    python bench/load.py                       # 1 GiB, 5 rounds, warm and cold: about 10 minutes
    python bench/load.py --size-mib 64 --rounds 3 --json out.json
    python bench/load.py --modes first-call    # a fresh process's first call, 7 rounds (bench/first_call.py)
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

import first_call  # bench/first_call.py
from measure import AnonSampler, busy, drop_from_page_cache, read_through, rss_anon  # bench/measure.py
from load_report import render_first_call, render_markdown, summarise, summarise_first_call  # bench/load_report.py

ROOT = Path(__file__).resolve().parent.parent
FILES = {"st": "m.safetensors", "pth": "m.pth", "ddp": "m_ddp.pth", "compiled": "m_compiled.pth"}
TINY_WIDTH = 8
WORLD = 2  # FSDP2 ranks
#: what the server that forks every run imports first (the rest of a run's first-call costs: its warm-up)
PRELOAD = ["torch", "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.tensor", "safetensors.torch", "ckptfix", "ckptfix.ops.api"]


class Net(nn.Module):
    """``layers`` Linear(width, width): keys ``layers.N.weight`` / ``layers.N.bias``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


# -- the loaders, one per row kind: (model, path) -> None, the model built before ------------------------------

def _load_model(model: nn.Module, path: str) -> None:
    from safetensors.torch import load_model

    load_model(model, path)


def _torch_mmap(model: nn.Module, path: str) -> None:
    model.load_state_dict(torch.load(path, map_location="cpu", mmap=True, weights_only=True))


def _torch_read(model: nn.Module, path: str) -> None:
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def _load_file_assign(model: nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    model.load_state_dict(load_file(path), assign=True)


def _runai(model: nn.Module, path: str) -> None:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(path, device="cpu")
        state_dict = dict(streamer.get_tensors())
    model.load_state_dict(state_dict)


def _ckptfix(model: nn.Module, path: str) -> None:
    import ckptfix

    ckptfix.load_into(model, path)


def _ckptfix_no_digests(model: nn.Module, path: str) -> None:
    """The issue's bounds are measured with digest checks off (a meta-built load checks the file's digests by default)."""
    import ckptfix

    ckptfix.load_into(model, path, check_digests=False)


def _ckptfix_unchecked(model: nn.Module, path: str) -> None:
    import ckptfix

    ckptfix.load_into(model, path, check_values=False)


def _fsdp_plain(model: nn.Module, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def _floor(_model: nn.Module, path: str) -> None:
    """The floor of any check that looks at every value: every byte of the file read once (numpy sums it as
    uint64 through a memmap, one thread)."""
    import numpy as np

    data = np.memmap(path, dtype=np.uint8, mode="r")
    data[: data.size // 8 * 8].view(np.uint64).sum()
    del data


LOADERS: dict[str, Callable[[nn.Module, str], None]] = {
    "floor": _floor, "load_model": _load_model, "torch_mmap": _torch_mmap, "torch_read": _torch_read, "assign": _load_file_assign,
    "runai": _runai, "ckptfix": _ckptfix, "ckptfix_no_digests": _ckptfix_no_digests, "ckptfix_unchecked": _ckptfix_unchecked,
    "fsdp_plain": _fsdp_plain,
}


@dataclass(frozen=True)
class Case:
    """One row: ``loader`` reads ``file`` into a ``model`` ("cpu", "meta" or "fsdp2"); its ratio is to the row
    ``vs`` (default: its group's first row, the anchor), bounded by the issue's ``target`` where it sets one;
    ``mem_target``: the issue's 64 MiB above the anchor's peak RssAnon."""

    id: str
    group: str
    label: str
    loader: str
    file: str
    model: str = "cpu"
    vs: str | None = None
    target: float | None = None
    mem_target: bool = False


FLOOR = "the floor: every byte read once (numpy sums the safetensors file through a memmap, one thread)"
ST, PTH, META, FSDP = ("safetensors file, CPU-built model", "torch zip file, CPU-built model",
                       "safetensors file, meta-built model", f"FSDP2, {WORLD} ranks (gloo), torch zip file, slowest rank")
KEYS = {"pth": "plain keys", "ddp": "`module.` keys", "compiled": "`_orig_mod.` keys"}
CASES: list[Case] = [
    Case("floor", FLOOR, "numpy memmap sum (uint64, one thread)", "floor", "st", "meta"),
    Case("st.load_model", ST, "safetensors.torch.load_model", "load_model", "st"),
    Case("st.ckptfix", ST, "ckptfix.load_into", "ckptfix", "st", target=1.25, mem_target=True),
    Case("st.ckptfix_unchecked", ST, "ckptfix.load_into(check_values=False)", "ckptfix_unchecked", "st",
         target=1.05, mem_target=True),
    Case("st.runai", ST, "runai SafetensorsStreamer (CPU) + load_state_dict", "runai", "st"),
    Case("pth.torch_mmap", PTH, "torch.load(mmap=True, weights_only=True) + load_state_dict", "torch_mmap", "pth"),
    Case("pth.torch_read", PTH, "torch.load(weights_only=True) + load_state_dict, no mmap", "torch_read", "pth"),
    *(case for file, keys in KEYS.items() for case in (
        Case(f"{file}.ckptfix", PTH, f"ckptfix.load_into, {keys}", "ckptfix", file, target=1.25, mem_target=True),
        Case(f"{file}.ckptfix_unchecked", PTH, f"ckptfix.load_into(check_values=False), {keys}", "ckptfix_unchecked",
             file, target=1.05, mem_target=True))),
    Case("meta.assign", META, "load_state_dict(load_file(), assign=True)", "assign", "st", "meta"),
    Case("meta.ckptfix", META, "ckptfix.load_into(check_digests=False) (× load_model into a CPU-built model)",
         "ckptfix_no_digests", "st", "meta", vs="st.load_model", target=1.0),
    Case("meta.ckptfix_digests", META, "ckptfix.load_into, its digests checked (× load_model into a CPU-built model)",
         "ckptfix", "st", "meta", vs="st.load_model"),
    Case("meta.ckptfix_unchecked", META, "ckptfix.load_into(check_values=False)", "ckptfix_unchecked", "st", "meta",
         target=1.1),
    Case("fsdp2.plain", FSDP, "torch.load(mmap=True) + set_model_state_dict(full_state_dict=True)", "fsdp_plain", "pth",
         "fsdp2"),
    Case("fsdp2.ckptfix", FSDP, "ckptfix.load_into", "ckptfix", "pth", "fsdp2"),
    Case("fsdp2.ckptfix_unchecked", FSDP, "ckptfix.load_into(check_values=False)", "ckptfix_unchecked", "pth", "fsdp2"),
    Case("fsdp2.ddp.ckptfix", FSDP, "ckptfix.load_into, `module.` keys", "ckptfix", "ddp", "fsdp2"),
]
BY_ID = {case.id: case for case in CASES}


def anchor_of(case: Case) -> str:
    return case.vs or next(c.id for c in CASES if c.group == case.group)


# -- the files ---------------------------------------------------------------------------------------------

def make_files(folder: Path, width: int, layers: int) -> dict[str, str]:
    """The four files of one ``Net(width, layers)`` of seeded normal values (kept when ``folder`` already holds
    them for the same shape), and ``fingerprint.pt``: rows of every parameter, to check a load against."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: str(folder / name) for kind, name in FILES.items()}
    stamp = folder / "shape.json"
    made = [width, layers, "digests"]
    if stamp.exists() and json.loads(stamp.read_text()) == made and all(map(os.path.exists, paths.values())):
        return paths
    from safetensors.torch import save_model

    with torch.device("meta"):
        net = Net(width, layers)
    net.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(generator=g)
    save_model(net, paths["st"] + ".plain")
    torch.save(net.state_dict(), paths["pth"] + ".plain")
    import ckptfix

    for kind in ("st", "pth"):  # written again by ckptfix: per-tensor digests, which ckptfix's loads check by default
        ckptfix.convert(paths[kind] + ".plain", paths[kind], force=True)
        os.remove(paths[kind] + ".plain")
    # the wrapper alone, `module.` keys (with a GPU, DataParallel moves the module there: saved from, and put back on, the CPU)
    torch.save({k: v.cpu() for k, v in nn.DataParallel(net).state_dict().items()}, paths["ddp"])
    net.cpu()
    torch.save(torch.compile(net).state_dict(), paths["compiled"])  # not compiled until called: `_orig_mod.` keys
    rows = sorted({0, width // 2 - 1, width // 2, width - 1})
    torch.save({name: (rows, p.detach()[rows].clone()) for name, p in net.named_parameters()}, folder / "fingerprint.pt")
    stamp.write_text(json.dumps(made))
    return paths


# -- one run, in a child process ---------------------------------------------------------------------------

def build(kind: str, width: int, layers: int) -> nn.Module:
    """The model a row loads into: on meta, or allocated on CPU (FSDP2: sharded first) and written."""
    with torch.device("meta"):
        net = Net(width, layers)
    if kind == "meta":
        return net
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    net.to_empty(device="cpu")
    with torch.no_grad():
        for p in net.parameters():
            _local(p).fill_(1.0)  # touch every page, as a model's initialisation does
    return net


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def mismatch(model: nn.Module, fingerprint_path: str) -> str | None:
    """What differs between the loaded model and the saved rows (None: every row bit for bit)."""
    from torch.distributed.tensor import DTensor

    fingerprint = torch.load(fingerprint_path, weights_only=True)
    params = dict(model.named_parameters())
    if sorted(params) != sorted(fingerprint):
        return f"parameters {sorted(params)[:3]}… ≠ the file's {sorted(fingerprint)[:3]}…"
    for name, (rows, want) in fingerprint.items():
        p = params[name].detach()
        if p.is_meta:
            return f"{name} is still on the meta device after the load"
        if isinstance(p, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            mine = [i for i, r in enumerate(rows) if offset[0] <= r < offset[0] + shape[0]]
            got, want = p.to_local()[[rows[i] - offset[0] for i in mine]], want[mine]
        else:
            got = p[rows]
        if got.dtype != want.dtype or not torch.equal(got, want):
            return f"{name}: the loaded values differ from the file's"
    return None


def _one_run(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    case = BY_ID[spec["case"]]
    world = WORLD if case.model == "fsdp2" else 1
    if world > 1:
        torch.set_num_threads(1)  # two ranks, one core each
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=spec["timeout"]))
    try:
        load = LOADERS[case.loader]
        load(build(case.model, TINY_WIDTH, 1), spec["tiny"][case.file])  # first-call costs out of the timer
        model = build(case.model, spec["width"], spec["layers"])
        path = spec["files"][case.file]
        stayed = 0
        if rank == 0:
            if spec["mode"].startswith("cold"):
                stayed = drop_from_page_cache(path)
            else:
                read_through(path)
        if world > 1:
            dist.barrier()
        gc.collect()
        before = rss_anon()
        start, t0 = time.monotonic(), time.perf_counter()
        load(model, path)
        seconds = time.perf_counter() - t0
        end = time.monotonic()
        after = rss_anon()
        wrong = None if case.loader == "floor" else mismatch(model, spec["fingerprint"])
        if world > 1:
            dist.barrier()
        return {"seconds": seconds, "start": start, "end": end, "before": before, "after": after, "error": wrong,
                "stayed_cached": stayed}
    finally:
        if world > 1:
            dist.destroy_process_group()


def _child(spec: dict[str, Any], rank: int, results: Any) -> None:
    try:
        result = _one_run(spec, rank)
    except BaseException as e:  # reported as the row's failure, with its traceback in the JSON
        result = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:300], "traceback": traceback.format_exc()}
    results.put((rank, result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(ctx: Any, sampler: AnonSampler, spec: dict[str, Any]) -> dict[str, Any]:
    """One run of one row: its process(es), the slowest rank's seconds and the highest peak."""
    world = WORLD if BY_ID[spec["case"]].model == "fsdp2" else 1
    spec = {**spec, "port": _free_port() if world > 1 else 0}
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(spec, rank, results)) for rank in range(world)]
    spinners = busy(spec["busy"] if spec["mode"].endswith("-busy") else 0)
    for p in procs:
        p.start()
        sampler.watch(p.pid)
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + spec["timeout"]
    try:
        while len(got) < world:
            try:
                rank, result = results.get(timeout=0.5)
                got[rank] = result
            except queue.Empty:
                dead = [p.exitcode for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    return {"error": f"exit codes {dead}" if dead else f"no result after {spec['timeout']} s"}
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
                p.join()
    try:
        errors = [r["error"] for r in got.values() if r.get("error")]
        if errors:
            return {"error": errors[0], "traceback": next((r["traceback"] for r in got.values() if "traceback" in r), None)}
        peaks = {r: max(sampler.peak(procs[r].pid, got[r]["start"], got[r]["end"]) or 0, got[r]["after"]) for r in got}
        return {"seconds": max(r["seconds"] for r in got.values()), "peak": max(peaks.values()),
                "growth": max(peaks[r] - got[r]["before"] for r in got),
                "stayed_cached": max(r["stayed_cached"] for r in got.values())}
    finally:
        for p in procs:
            sampler.forget(p.pid)


# -- the whole bench ---------------------------------------------------------------------------------------

def skip_reason(case: Case) -> str | None:
    if case.loader == "runai" and importlib.util.find_spec("runai_model_streamer") is None:
        return "runai-model-streamer is not installed (`pip install runai-model-streamer`)"
    return None


def chosen(case: Case, prefixes: list[str] | None) -> bool:
    """The row is asked for (``--cases``); a row's anchor comes with it."""
    if prefixes is None or case.loader == "floor":  # (the floor: every row's second ratio)
        return True
    wanted = {c.id for c in CASES if c.id.startswith(tuple(prefixes))}
    return case.id in wanted or case.id in {anchor_of(c) for c in CASES if c.id in wanted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=1024, help="fp32 weights of the model (default 1 GiB)")
    ap.add_argument("--width", type=int, default=2048, help="the Linear layers' width (default 2048: 16 MiB each)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; first-call: 7, as issue 29 asks)")
    ap.add_argument("--modes", nargs="+", choices=("warm", "cold", "warm-busy", "cold-busy", "first-call"),
                    default=["warm", "cold"], help="warm / cold page cache; -busy: with --busy CPU-bound processes "
                    "running beside each run; first-call: a fresh process's first call (bench/first_call.py)")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes of the -busy modes (default 2)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the files go (kept, and reused by the next run of the same size; default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    ap.add_argument("--cases", nargs="+", default=None, metavar="PREFIX",
                    help="only the rows whose id starts with one of these (e.g. st. pth. ddp. meta.; default: all), "
                         "and their anchors")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = ap.parse_args(argv)
    first = "first-call" in args.modes
    args.modes = [m for m in args.modes if m != "first-call"]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ckptfix-bench-load-", dir="/var/tmp"))
    try:
        out: dict[str, Any] = {}
        if first:
            out["first_call"] = summarise_first_call(first_call.run(workdir / "first-call", args.size_mib,
                                                                    args.rounds or 7, args.timeout))
            print(render_first_call(out["first_call"], _machine()))
        if args.modes:
            args.rounds = args.rounds or 5
            out.update(_bench_rows(args, workdir))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        failed = [row for part in (out.get("rows", []), out.get("first_call", {}).get("rows", [])) for row in part
                  if row["status"].startswith("failed")]
        return 1 if failed else 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, {'CUDA' if torch.cuda.is_available() else 'no GPU'}, "
            f"Python {platform.python_version()}")


def _bench_rows(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The rows of CASES in ``args.modes``, each run in a process forked from a server: the report (setup, rows)."""
    layers = max(1, round(args.size_mib * 2**20 / (4 * args.width * (args.width + 1))))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # its imports overlap the files' making
    files = make_files(workdir, args.width, layers)
    tiny = make_files(workdir / "tiny", TINY_WIDTH, 1)
    base = {"files": files, "tiny": tiny, "fingerprint": str(workdir / "fingerprint.pt"), "width": args.width,
            "layers": layers, "timeout": args.timeout, "busy": args.busy}
    cases = [c for c in CASES if not skip_reason(c) and chosen(c, args.cases)]
    items = [(c.id, mode) for c in cases for mode in args.modes]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {item: [] for item in items}
    with AnonSampler() as sampler:
        for r in range(args.rounds):
            for case_id, mode in items if r % 2 == 0 else reversed(items):
                if any(run.get("error") for run in runs[case_id, mode]):
                    runs[case_id, mode].append({"error": "skipped after an earlier failure"})
                    continue
                run = run_once(ctx, sampler, {**base, "case": case_id, "mode": mode})
                runs[case_id, mode].append(run)
                shown = f"{run['seconds']:.3f} s" if "seconds" in run else f"FAILED {run['error']}"
                print(f"round {r + 1}: {case_id} {mode}: {shown}", file=sys.stderr)
    import ckptfix

    setup = {
        "machine": _machine(), "torch": torch.__version__, "safetensors": importlib.metadata.version("safetensors"),
        "load_into": f"ckptfix.load_into({', '.join(inspect.signature(ckptfix.load_into).parameters)})",
        "size_mib": os.path.getsize(files["st"]) / 2**20, "size_mib_arg": args.size_mib,
        "width": args.width, "layers": layers, "rounds": args.rounds, "modes": args.modes, "busy": args.busy,
    }
    rows = [{"id": c.id, "group": c.group, "label": c.label, "file": FILES[c.file], "model": c.model,
             "vs": anchor_of(c), "target": c.target, "mem_target": c.mem_target, "skip": skip_reason(c)}
            for c in CASES if chosen(c, args.cases)]
    report = summarise(rows, runs, setup)
    print(render_markdown(report))
    for row in report["rows"]:  # the fastest run against the anchor's fastest: what a busy machine can't add
        mins = ", ".join(f"{m} {row[m]['ratio_of_mins']:.2f}" for m in args.modes
                         if row.get(m, {}).get("ratio_of_mins") is not None)
        print(f"min/min ratio {row['id']}: {mins}", file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(main())
