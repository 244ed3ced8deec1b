"""Real FSDP2 DCP directories for the streaming-conversion tests and bench/dcp.py: two gloo
processes, ``fully_shard`` on a CPU mesh, a training step, ``dcp.save`` on every rank.

    python tests/fsdp2_dirs.py OUT_DIR [--width N --layers L --model-only]   # OUT_DIR/{rows,rows_bf16,cols}

``rows``: FSDP2's default dim-0 sharding (uneven: 7 rows → 4 + 3, 1 row → 1 + 0), BatchNorm buffers
(replicated; a 0-d int64) and Adam state. ``rows_bf16``: the same in bfloat16. ``cols``:
``shard_placement_fn`` puts the Linear weights on ``Shard(1)``, so their chunks don't tile row-major.
``--width``/``--layers`` add ``layers`` Linear(width, width) for benchmarks (bench/dcp.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
VARIANTS = ("rows", "rows_bf16", "cols")


class Net(nn.Module):
    """The model every variant saves (``load_state_dict(strict=True)`` target)."""

    def __init__(self, width: int = 256, layers: int = 1):
        super().__init__()
        body = [nn.Linear(13, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, width)]
        self.body = nn.Sequential(*body, *(nn.Linear(width, width) for _ in range(layers)))
        self.head = nn.Linear(width, 1)
        self.out = nn.Linear(1, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.body(x)))


def net(width: int = 256, layers: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return Net(width, layers)


def _save(out: Path, variant: str, width: int, layers: int, optim: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = net(width, layers)
    if variant == "rows_bf16":
        model = model.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (WORLD,))
    placement = (lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % WORLD == 0 else None) if variant == "cols" else None
    for m in model.modules():
        if m is not model and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(8, 13, generator=g, dtype=next(model.parameters()).dtype)
    model(x).square().mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd} if optim else {"model": model_sd}, checkpoint_id=str(out / variant))


def _worker(rank: int, out: Path, variants: list[str], width: int, layers: int, optim: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        for variant in variants:
            _save(out, variant, width, layers, optim)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def make(out: str | os.PathLike[str], variants: tuple[str, ...] = VARIANTS, width: int = 256, layers: int = 1,
         optim: bool = True, timeout: float = 600, attempts: int = 3) -> dict[str, Path]:
    """Run the two ranks; returns variant → its DCP directory (``optim``: Adam's state saved too).

    A gloo rendezvous can lose its port to another process between picking it and binding it (the
    workers then abort): a failed run is retried on a fresh port, its partial variant directories
    removed first (they are this function's own output)."""
    for attempt in range(1, attempts + 1):
        try:
            return _run(out, variants, width, layers, optim, timeout)
        except RuntimeError:
            if attempt == attempts:
                raise
            for v in variants:
                shutil.rmtree(Path(out) / v, ignore_errors=True)
    raise AssertionError("unreachable")


def _run(out: str | os.PathLike[str], variants: tuple[str, ...], width: int, layers: int, optim: bool,
         timeout: float) -> dict[str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, str(out), "--width", str(width), "--layers", str(layers), "--variants", *variants,
           *([] if optim else ["--model-only"])]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:  # not retried: a hang would only hang again
                raise TimeoutError(f"FSDP2 workers still running after {timeout:.0f} s")
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"FSDP2 workers failed: return codes {[p.poll() for p in procs]}")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"FSDP2 workers failed: return codes {[p.returncode for p in procs]}")
    return {v: Path(out) / v for v in variants}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--model-only", action="store_true", help="save the model's state dict alone")
    ap.add_argument("--rank", type=int)
    args = ap.parse_args()
    if args.rank is None:
        make(args.out, tuple(args.variants), args.width, args.layers, not args.model_only)
    else:
        _worker(args.rank, Path(args.out), args.variants, args.width, args.layers, not args.model_only)


if __name__ == "__main__":
    main()
