"""A/B of ``ckptfix convert``: two variants of the same conversion, alternating, side by side in one run.

A variant is a tree (this checkout, or a git revision checked out as a worktree) and optionally the output's write-
back behind the copy turned off (``core/libc.start_writeback`` a no-op: the kernel's flushers write it back alone, as
before issue 30). Each round runs `cp` + fsync, then every variant on every destination format, the order of the
variants reversed every other round, each tree's bytecode compiled first; each command after ``sync`` and a pause, its
output deleted once measured (a full page cache of outputs evicts the source). Reported: each command's median and the
median over rounds of each variant's time divided by the first variant's (a drifting machine cancels out). ``--busy
N`` runs N CPU-bound processes through every round.

    python bench/convert_ab.py --size-gb 2 --rounds 5 --variants HEAD~1 .           # a change's effect
    python bench/convert_ab.py --rounds 5 --variants . .:no-writeback --busy 2       # write-back behind, busy
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import busy

ROOT = Path(__file__).resolve().parent.parent
#: a variant's command line: this tree's CLI, or with the write-back behind the copy off
RUN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from ckptfix.cli import main; main()"
NO_WRITEBACK = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from ckptfix.core import libc; "
                "libc.start_writeback = lambda fd, offset, n: None; from ckptfix.cli import main; main()")


def tree(rev: str, work: Path) -> Path:
    """The checkout of ``rev`` ("." is this one), a worktree under ``work`` otherwise."""
    if rev == ".":
        return ROOT
    path = work / f"tree-{len(list(work.glob('tree-*')))}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    return path


def timed(cmd: list[str], settle: float) -> float:
    os.sync()
    time.sleep(settle)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=[".", ".:no-writeback"],
                    help="REV or REV:no-writeback each (REV '.': this checkout); the first is the anchor")
    ap.add_argument("--formats", nargs="+", default=["safetensors", "pth"], help="destination formats")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes through every round")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds to pause after the sync before each command")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir under /var/tmp)")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="ckptfix-convert-ab-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src.pth"
    if not src.exists():
        import torch

        g = torch.Generator().manual_seed(0)
        n = max(1, round(args.size_gb * 2**30 / (4096 * 4096 * 4)))
        torch.save({f"layer{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(n)}, src)
    trees: dict[str, Path] = {}
    commands = {}
    for v in args.variants:
        rev, _, how = v.partition(":")
        if rev not in trees:
            trees[rev] = tree(rev, work)
            # every tree's bytecode compiled first: a tree without it compiles on each run (PYTHONDONTWRITEBYTECODE)
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(trees[rev] / "ckptfix")], check=True)
        commands[v] = [sys.executable, "-c", NO_WRITEBACK if how == "no-writeback" else RUN, str(trees[rev])]
    times: dict[str, list[float]] = {}
    spinning = busy(args.busy)
    try:
        with open(src, "rb") as f:  # warm
            while f.read(64 << 20):
                pass
        for r in range(args.rounds):
            cp = work / "cp.bin"
            times.setdefault("cp + fsync", []).append(
                timed(["sh", "-c", f"cp {src} {cp} && python3 -c 'import os; os.fsync(os.open(\"{cp}\", os.O_RDONLY))'"],
                      args.settle))
            cp.unlink()
            for v in args.variants if r % 2 == 0 else list(reversed(args.variants)):
                for fmt in args.formats:
                    out = work / f"out.{fmt}"
                    times.setdefault(f"{v} -> {fmt}", []).append(
                        timed([*commands[v], "convert", str(src), str(out), "--quiet"], args.settle))
                    out.unlink()
            print(f"round {r + 1} done", file=sys.stderr)
    finally:
        for p in spinning:
            p.kill()
        for path in trees.values():
            if path != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)
    print(f"`python bench/convert_ab.py --size-gb {args.size_gb} --rounds {args.rounds} --variants "
          f"{' '.join(args.variants)} --busy {args.busy}` ({src.stat().st_size / 2**30:.2f} GiB, warm)\n")
    print("| command | median (s) | runs (s) |\n|---|---:|---|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v):.3f} | {' '.join(f'{x:.2f}' for x in v)} |")
    anchor = args.variants[0]
    for v in args.variants[1:]:
        for fmt in args.formats:
            ratios = [a / b for a, b in zip(times[f"{v} -> {fmt}"], times[f"{anchor} -> {fmt}"])]
            print(f"\n{v} / {anchor} -> {fmt}: median of per-round ratios {statistics.median(ratios):.3f}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
