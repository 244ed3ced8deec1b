"""Benchmark: ``ckptfix verify --exact`` against the plain serving load (issue 26, item 7): time and peak memory.

Not a test. Makes a GPT-2-shaped model from torch alone (an embedding, --layers-worth of pre-norm MLP blocks
``Linear(w, 4w)`` + GELU + ``Linear(4w, w)``, a final LayerNorm; --size-mib of fp32 weights, 1 GiB by default) and
saves it as m.pth (``torch.save``) and m.safetensors (``save_file``) under --workdir. Two rows per file:

- plain: what the server runs — the model built, ``torch.load(PATH, weights_only=True)`` (no mmap) or
  ``safetensors.torch.load_file(PATH)``, ``load_state_dict(strict=True)``, one forward on 16 token ids;
- ckptfix: ``ckptfix verify PATH --model SPEC --exact --quiet --json`` with no --reference or --golden (the gate
  CI runs: the read, SHA-256, NaN/Inf, CRCs, the static scan, and the serving loader observed in its child process).

Method. Each run is a fresh process (``python -c`` / the ``ckptfix`` command), so both pay interpreter start and
``import torch``, and ckptfix pays its child's too (the cost of containing the loader: a child forked once the
read has passed, running beside the parent's build and checks on the other core). The file is read once
before each run (warm). Rounds alternate the order (plain first, then ckptfix first …); the time ratio is the
median of the per-round ratios. Peak memory is the anonymous memory of the process and all its descendants summed
(each one's Pss_Anon: the pages ckptfix's forked observing child shares with its parent count once), sampled every
5 ms; the delta is the median ckptfix peak minus the median plain peak. Targets (issue 26): ratio ≤ 1.2,
delta ≤ +256 MiB.

    python bench/verify.py                          # 1 GiB, 5 rounds: a few minutes
    python bench/verify.py --size-mib 4 --width 64 --rounds 1 --json out.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import INTERVAL, pss_anon, read_through, rss_anon  # noqa: E402

TIME_TARGET, MEMORY_TARGET_MIB = 1.2, 256
MODEL = '''
import torch
from torch import nn

WIDTH, LAYERS, VOCAB = {width}, {layers}, {vocab}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[Block() for _ in range(LAYERS)], nn.LayerNorm(WIDTH))
'''
PLAIN = '''
import sys, torch
sys.path.insert(0, {workdir!r})
from model import build
model = build()
path = {path!r}
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    sd = load_file(path)
else:
    sd = torch.load(path, weights_only=True)
model.load_state_dict(sd, strict=True)
with torch.no_grad():
    model(torch.arange(16).unsqueeze(0))
'''


def tree_rss(pid: int) -> int:
    """The anonymous memory of ``pid`` and every process below it, summed (a process gone meanwhile counts 0):
    each one's ``Pss_Anon``, so that pages a forked child shares with its parent count once; ``RssAnon`` where the
    kernel has no ``Pss_Anon``."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += pss_anon(p) or rss_anon(p) or 0
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak tree RssAnon of one command; a failure ends the bench with its stderr."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(INTERVAL)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            err.seek(0)
            out.seek(0)
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out.read().decode()[-2000:]}"
                             f"{err.read().decode()[-3000:]}")
    return wall, peak


def make(workdir: Path, size_mib: int, width: int) -> dict[str, Path]:
    """The model's file and its two checkpoints."""
    import torch
    from safetensors.torch import save_file

    vocab = 4 * width
    layers = max(1, (size_mib << 20) // (4 * (8 * width * width + 7 * width)) - vocab // (8 * width))
    (workdir / "model.py").write_text(MODEL.format(width=width, layers=layers, vocab=vocab))
    sys.path.insert(0, str(workdir))
    from model import build  # type: ignore[import-not-found]

    sd = build().state_dict()
    torch.save(sd, workdir / "m.pth")
    save_file({k: v.contiguous() for k, v in sd.items()}, workdir / "m.safetensors")
    return {"pth": workdir / "m.pth", "safetensors": workdir / "m.safetensors"}


def bench(workdir: Path, path: Path, rounds: int) -> dict:
    """One file's row: both commands, ``rounds`` alternating warm rounds."""
    commands = {"plain": [sys.executable, "-c", PLAIN.format(workdir=str(workdir), path=str(path))],
                "ckptfix": [sys.executable, "-m", "ckptfix", "verify", str(path), "--model",
                            f"{workdir / 'model.py'}:build", "--exact", "--quiet", "--json"]}
    runs: dict[str, list[tuple[float, int]]] = {"plain": [], "ckptfix": []}
    for r in range(rounds):
        for name in (("plain", "ckptfix") if r % 2 == 0 else ("ckptfix", "plain")):
            read_through(path)
            runs[name].append(run(commands[name]))
    ratio = statistics.median(c[0] / p[0] for p, c in zip(runs["plain"], runs["ckptfix"]))
    peaks = {name: statistics.median(peak for _, peak in rows) / (1 << 20) for name, rows in runs.items()}
    delta = peaks["ckptfix"] - peaks["plain"]
    return {"file": path.name, "size_mib": round(path.stat().st_size / (1 << 20), 1), "rounds": rounds,
            "plain_s": [round(t, 3) for t, _ in runs["plain"]], "ckptfix_s": [round(t, 3) for t, _ in runs["ckptfix"]],
            "ratio": round(ratio, 3), "plain_peak_mib": round(peaks["plain"], 1),
            "ckptfix_peak_mib": round(peaks["ckptfix"], 1), "delta_mib": round(delta, 1),
            "status": "ok" if ratio <= TIME_TARGET and delta <= MEMORY_TARGET_MIB else "over target"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ckptfix-bench-verify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [bench(workdir, path, args.rounds) for path in make(workdir, args.size_mib, args.width).values()]
    print(f"| file | plain build + load + forward (s, median) | verify --exact (s, median) | ratio (≤ {TIME_TARGET}) "
          f"| plain peak MiB | verify peak MiB | Δ MiB (≤ +{MEMORY_TARGET_MIB}) | status |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['file']} ({row['size_mib']} MiB) | {statistics.median(row['plain_s']):.2f} | "
              f"{statistics.median(row['ckptfix_s']):.2f} | {row['ratio']:.2f}× | {row['plain_peak_mib']:.0f} | "
              f"{row['ckptfix_peak_mib']:.0f} | {row['delta_mib']:+.0f} | {row['status']} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
