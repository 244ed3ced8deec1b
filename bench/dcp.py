"""Benchmark: consolidating a 2-rank FSDP2 DCP checkpoint, torch's ``dcp_to_torch_save`` against ckptfix.

Not a test. Makes a real FSDP2 checkpoint (2 gloo processes, ``fully_shard`` on CPU, ``dcp.save``;
tests/fsdp2_dirs.py) of about --size-gb of model weights (Linear(4096, 4096) layers, 64 MiB each),
then times, in alternating rounds with ``sync`` and a short pause before each command:

- torch: ``dcp_to_torch_save(DIR, out.pth)`` (loads every chunk into memory, then ``torch.save``);
- ``ckptfix convert DIR out.pth`` and ``out.safetensors`` (each dim-0 chunk copied into place);
- ``ckptfix convert DIR out.pth --trust``: the scratch-file path (a full load), for comparison.

Each runs as its own process (``import torch`` included in all); peak anonymous memory is the
child's RssAnon sampled every 5 ms from /proc/PID/status (file-backed and shared pages excluded).
The outputs are checked bit for bit against torch's at the end. The checkpoint is deleted after.

    python bench/dcp.py --size-gb 1 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from measure import measure as _measure  # bench/measure.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: tests/fsdp2_dirs.py
PY = sys.executable
CKPTFIX = [PY, "-m", "ckptfix"]
WIDTH = 4096
TORCH = """
import sys, warnings
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
warnings.filterwarnings("ignore")
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """bench/measure.py's ``measure`` after a ``sync`` and a 1 s pause (wall seconds, peak RssAnon)."""
    return _measure(cmd, env, settle=1.0)


def check(out: Path) -> None:
    """Every output holds torch's tensors, bit for bit (and the .pth files' CRCs hold)."""
    import zipfile

    import torch
    from safetensors.torch import load_file

    want = torch.load(out / "torch.pth", weights_only=True, mmap=True)["model"]
    for name in ("ckptfix.pth", "ckptfix.safetensors", "scratch.pth"):
        path = out / name
        if name.endswith(".pth"):
            assert zipfile.ZipFile(path).testzip() is None, name
        got = load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True, mmap=True)
        assert sorted(got) == sorted(want), name
        for k, w in want.items():
            same = got[k].dtype == w.dtype and torch.equal(got[k].view(-1).view(torch.uint8), w.view(-1).view(torch.uint8))
            assert same, (name, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir under /tmp, removed after)")
    args = ap.parse_args()
    from tests import fsdp2_dirs

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="ckptfix-bench-dcp-", dir="/tmp"))
    out = workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    layers = max(1, round(args.size_gb * 2**30 / (WIDTH * WIDTH * 4)))
    try:
        t0 = time.perf_counter()
        src = fsdp2_dirs.make(workdir, ("rows",), width=WIDTH, layers=layers, optim=False)["rows"]
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"made {src}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        scratch_env = {**os.environ, "TMPDIR": str(workdir)}
        cmds = {
            "torch dcp_to_torch_save → .pth": ([PY, "-c", TORCH, str(src), str(out / "torch.pth")], None),
            "ckptfix convert → .pth": ([*CKPTFIX, "convert", str(src), str(out / "ckptfix.pth"), "--force", "-q"], None),
            "ckptfix convert → .safetensors": ([*CKPTFIX, "convert", str(src), str(out / "ckptfix.safetensors"),
                                                "--force", "-q"], None),
            "ckptfix convert → .pth --trust (scratch path)": ([*CKPTFIX, "convert", str(src), str(out / "scratch.pth"),
                                                               "--force", "-q", "--trust"], scratch_env),
        }
        runs: dict[str, list[tuple[float, int]]] = {name: [] for name in cmds}
        for r in range(args.rounds):
            names = list(cmds) if r % 2 == 0 else list(reversed(cmds))
            for name in names:
                runs[name].append(measure(*cmds[name]))
                print(f"round {r + 1}: {name}: {runs[name][-1][0]:.2f} s", file=sys.stderr)
        check(out)
        base = statistics.median(w for w, _ in runs["torch dcp_to_torch_save → .pth"])  # the same machine, same run
        print(f"2-rank FSDP2 DCP checkpoint, {size / 2**30:.2f} GiB ({layers} × Linear({WIDTH}, {WIDTH}) + small layers), "
              f"{args.rounds} alternating rounds, sync + 1 s pause before each; page cache warm.\n")
        torch_walls = [w for w, _ in runs["torch dcp_to_torch_save → .pth"]]
        print("| command | median wall (s) | runs (s) | × dcp_to_torch_save (medians) | median of per-round × "
              "| peak RssAnon (MiB) |")
        print("|---|---|---|---|---|---|")
        for name, rs in runs.items():
            walls = [w for w, _ in rs]
            med = statistics.median(walls)
            paired = statistics.median(w / t for w, t in zip(walls, torch_walls))
            print(f"| {name} | {med:.2f} | {', '.join(f'{w:.2f}' for w in walls)} | {med / base:.2f} | {paired:.2f} | "
                  f"{max(p for _, p in rs) / 2**20:.0f} |")
    finally:
        shutil.rmtree(workdir if args.dir is None else out, ignore_errors=True)
        if args.dir is not None:
            shutil.rmtree(workdir / "rows", ignore_errors=True)


if __name__ == "__main__":
    main()
