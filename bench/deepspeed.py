"""Benchmark: consolidating a DeepSpeed ZeRO-2 checkpoint, ckptfix against DeepSpeed's zero_to_fp32.py.

Not a test. Trains fixtures/deepspeed_train.py's ``big`` model (square Linear layers, about --size-gb
of fp32 weights) for one step with real deepspeed (CPU, gloo, 2 ranks, bf16) and saves it, then runs
each command side by side in alternating rounds: wall time and peak anonymous memory (RssAnon
sampled from /proc/PID/status by bench/measure.py), and checks every output holds the
same tensors bit for bit. Appends a section to bench/RESULTS.md (--results).

    python bench/deepspeed.py --size-gb 1 --rounds 3 --dir /tmp/ckptfix-ds-bench

Needs deepspeed importable (the Makefile's optional step): it writes the checkpoint, and
zero_to_fp32.py imports it to unpickle the optim_states files. Without it nothing is measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import measure  # bench/measure.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
PY = sys.executable
CKPTFIX = [PY, "-m", "ckptfix"]
TAG = "global_step3"


def make_checkpoint(workdir: Path, size_gb: float) -> Path:
    ckpt = workdir / "zero2_bf16"
    if not (ckpt / "latest").exists():
        subprocess.run([PY, str(HERE.parent / "fixtures" / "deepspeed_train.py"), "--out", str(workdir), "--model", "big",
                        "--size-gb", str(size_gb), "--configs", "2:bf16"], check=True)
    return ckpt


def commands(ckpt: Path, out: Path) -> dict[str, list[str]]:
    tag = ckpt / TAG
    return {
        "import torch": [PY, "-c", "import torch"],
        "cp (every file of the tag)": ["cp", "-r", str(tag), str(out / "copy")],
        "zero_to_fp32.py (pytorch_model.bin)": [PY, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out / "z2f_bin")],
        "zero_to_fp32.py --safe_serialization": [PY, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out / "z2f_st"),
                                                 "--safe_serialization"],
        "ckptfix convert -> .pth": [*CKPTFIX, "convert", str(ckpt), str(out / "c.pth"), "--force", "--quiet"],
        "ckptfix convert -> .safetensors": [*CKPTFIX, "convert", str(ckpt), str(out / "c.safetensors"), "--force", "--quiet"],
        "ckptfix inspect": [*CKPTFIX, "inspect", str(ckpt)],
    }


def check_same(out: Path) -> str:
    """Every output holds the same tensors, bit for bit."""
    import torch

    import ckptfix

    want = torch.load(out / "z2f_bin" / "pytorch_model.bin", weights_only=True, mmap=True)
    for other in (out / "z2f_st" / "model.safetensors", out / "c.pth", out / "c.safetensors"):
        got = ckptfix.load(other)
        assert sorted(got) == sorted(want), other
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (other, k)
    return (f"{len(want)} tensors, {sum(t.numel() for t in want.values()) * 4 / 2**30:.2f} GiB of fp32, "
            "identical in all four outputs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    probe = subprocess.run([PY, "-c", "import deepspeed"], capture_output=True, text=True)
    if probe.returncode:
        raise SystemExit(f"deepspeed can't be imported ({probe.stderr.strip().splitlines()[-1:]}): no checkpoint, no baseline")
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="ckptfix-ds-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out"
    try:
        ckpt = make_checkpoint(workdir, args.size_gb)
        cmds = commands(ckpt, out)
        runs: dict[str, list[tuple[float, int]]] = {name: [] for name in cmds}
        for r in range(args.rounds):
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            for name in list(cmds) if r % 2 == 0 else list(reversed(cmds)):  # alternate the order
                runs[name].append(measure(cmds[name]))
                print(f"round {r + 1}: {name}: {runs[name][-1][0]:.2f} s", file=sys.stderr)
        same = check_same(out)
        report = render(runs, ckpt, args, same)
        print(report)
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def render(runs: dict[str, list[tuple[float, int]]], ckpt: Path, args: argparse.Namespace, same: str) -> str:
    med = {n: statistics.median(w for w, _ in v) for n, v in runs.items()}
    peak = {n: max(m for _, m in v) for n, v in runs.items()}
    torch_mem = peak["import torch"]
    size = sum(p.stat().st_size for p in (ckpt / TAG).iterdir())
    base = med["zero_to_fp32.py (pytorch_model.bin)"]
    lines = [
        "## DeepSpeed ZeRO-2 consolidation: ckptfix against zero_to_fp32.py",
        "",
        f"`python bench/deepspeed.py --size-gb {args.size_gb} --rounds {args.rounds}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}: a real deepspeed ZeRO-2 bf16 checkpoint of 2 ranks "
        f"({size / 2**30:.2f} GiB in its tag directory: the bf16 module, two optim_states with the fp32 partitions and "
        f"AdamW state). {same}. Median wall of {args.rounds} alternating rounds, max peak RssAnon; page cache warm.",
        "",
        "| command | wall (s) | × zero_to_fp32.py | peak RssAnon − import torch (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for name in runs:
        lines.append(f"| {name} | {med[name]:.2f} | {med[name] / base:.2f} | {(peak[name] - torch_mem) / 2**20:.0f} |")
    lines += ["", ""]  # a blank line after the table, whatever is appended next
    return "\n".join(lines)


if __name__ == "__main__":
    main()
