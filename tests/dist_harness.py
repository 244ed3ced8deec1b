"""Run one function on N gloo ranks on CPU, each rank its own process, and bring its return value back.

    results = dist_harness.run("tests.sharded_loads:run_cases", world=4, workdir=tmp, payload={...})

The ranks are forked from a multiprocessing forkserver that has imported torch once per session (a fresh
interpreter per rank costs seconds of import on a busy machine); each rank joins the default process
group (gloo) through a TCPStore this process hosts on a port the kernel picked, so no port can be lost
between choosing it and binding it. The rank calls ``function(rank, world, payload)`` (named by its
module's dotted name, ``tests.ops.test_x:function``) and writes the return value with ``torch.save``; an
exception is written as its traceback instead, and :func:`run` fails with every failed rank's traceback
(or the tail of its stderr). A rank still running after ``timeout`` seconds, or a few seconds after
another rank failed (stuck in a collective its peer never joins), is killed and reported with the
Python stack it was stuck in.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

#: What a rank waits for a peer in a collective before gloo raises (the run's own timeout is the parent's).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
#: How long the other ranks get to finish after one has failed.
GRACE_S = 5.0
#: Imported once by the forkserver, before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or hung; the message holds each one's traceback."""


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run of the session)
    return ctx


def run(target: str, world: int, workdir: Path, payload: Any = None, timeout: float = 120,
        cwd: list[Path] | None = None) -> list[Any]:
    """Run ``module:function`` on ``world`` ranks; returns each rank's return value, rank order.

    ``workdir`` (created) receives each rank's result, traceback and stderr; ``payload`` is handed to every
    rank (through ``torch.save``: tensors, paths and plain data). ``cwd``: one working directory per rank
    (a relative path then names a different file on each rank, as the same path does on separate hosts)."""
    import torch
    import torch.distributed as dist

    workdir.mkdir(parents=True, exist_ok=True)
    torch.save(payload, workdir / "payload.pt")
    for rank in range(world):
        (workdir / f"rank{rank}.err").unlink(missing_ok=True)
        (workdir / f"rank{rank}.pt").unlink(missing_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    ctx = _context()
    procs = [ctx.Process(target=_rank_main, name=f"rank{rank}",
                         args=(target, workdir, rank, world, store.port, cwd[rank] if cwd else None))
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline, failed_at, why = time.monotonic() + timeout, None, ""
    try:
        while any(p.exitcode is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline:
                why = f"still running after {timeout:.0f} s"
                break
            if failed_at is not None and now > failed_at + GRACE_S:
                why = f"still running {GRACE_S:.0f} s after another rank failed (waiting in a collective?)"
                break
            time.sleep(0.05)
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.exitcode is None]
        for rank in hung:  # each hung rank's Python stack into its stderr file (faulthandler), then kill it
            os.kill(procs[rank].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1)
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        del store
    problems = [_describe(workdir, rank, f"killed: {why}" if rank in hung else f"exit code {p.exitcode}")
                for rank, p in enumerate(procs) if p.exitcode != 0 or rank in hung]
    if problems:
        raise RankFailure(f"{len(problems)} of {world} ranks failed running {target}:\n\n" + "\n\n".join(problems))
    return [torch.load(workdir / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _describe(workdir: Path, rank: int, how: str) -> str:
    err = workdir / f"rank{rank}.err"
    stderr = (workdir / f"rank{rank}.stderr").read_text(errors="replace")[-3000:]
    body = err.read_text() if err.exists() else f"(no traceback written; the tail of its stderr:)\n{stderr}"
    return f"rank {rank}: {how}\n{body}"


def _rank_main(target: str, workdir: Path, rank: int, world: int, port: int, cwd: Path | None) -> None:
    """One rank, in a process forked from the forkserver: stderr to a file, the group joined, the call made."""
    with open(workdir / f"rank{rank}.stderr", "wb") as stderr:
        os.dup2(stderr.fileno(), 2)
    sys.stderr = open(2, "w", closefd=False)  # fd 2 stays open for the process
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        import importlib

        import torch
        import torch.distributed as dist

        if cwd is not None:
            os.chdir(cwd)
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        try:
            module, _, name = target.partition(":")
            function = getattr(importlib.import_module(module), name)
            result = function(rank, world, torch.load(workdir / "payload.pt", weights_only=False))
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(result, workdir / f"rank{rank}.pt")
    except BaseException:
        (workdir / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.exit(1)
