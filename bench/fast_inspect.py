"""Benchmark: the short commands (``inspect``, ``scan``) against ``python -c pass`` and ``import torch``.

Not a test. Writes a small torch zip, a small safetensors file and a large torch zip (--size-gb,
100 tensors, keys ``module.layers.N.weight``) under --dir (and reads the committed FSDP2 DCP directory
fixtures/mlp_fsdp2, model and optimizer state), runs every command in alternating rounds
(``sync`` and a short pause before each run) and prints the median wall time of each and its ratio
to ``import torch`` measured in the same run (target: at most 0.15). Deletes what it wrote.

    python bench/fast_inspect.py --rounds 5 --size-gb 2 --dir /tmp/ckptfix-fast
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
CKPTFIX = [PY, "-m", "ckptfix"]


def make_inputs(d: Path, size_gb: float) -> dict[str, Path]:
    """The three inputs, written by a child process (so this one never imports torch)."""
    code = f"""
import torch
from safetensors.torch import save_file
from pathlib import Path
d = Path({str(d)!r})
small = {{f"module.layers.{{i}}.weight": torch.randn(64, 64) for i in range(20)}}
torch.save(small, d / "small.pth")
save_file({{k.removeprefix("module."): v for k, v in small.items()}}, d / "small.safetensors")
n = 100
per = int({size_gb} * 1e9 / n / 4)
big = {{f"module.layers.{{i}}.weight": torch.empty(per).fill_(i) for i in range(n)}}
torch.save(big, d / "big.pth")
"""
    subprocess.run([PY, "-c", code], check=True)
    return {"small.pth": d / "small.pth", "small.safetensors": d / "small.safetensors", "big.pth": d / "big.pth"}


def timed(cmd: list[str]) -> float:
    subprocess.run(["sync"], check=True)
    time.sleep(0.3)
    start = time.perf_counter()
    run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {run.stderr.decode()[-500:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp/ckptfix-fast-inspect")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        inputs = make_inputs(d, args.size_gb)
        commands: dict[str, list[str]] = {"python -c pass": [PY, "-c", "pass"],
                                          "python -c 'import torch'": [PY, "-c", "import torch"]}
        for name, path in inputs.items():
            for verb in ("inspect", "scan"):
                commands[f"ckptfix {verb} {name}"] = [*CKPTFIX, verb, str(path)]
        fsdp2 = str(Path(__file__).resolve().parent.parent / "fixtures" / "mlp_fsdp2")  # model + optimizer state
        for verb in ("inspect", "scan"):
            commands[f"ckptfix {verb} fixtures/mlp_fsdp2 (DCP)"] = [*CKPTFIX, verb, fsdp2]
        commands["ckptfix inspect fixtures/mlp_fsdp2 (torch path)"] = ["env", "CKPTFIX_TORCH_FREE=0", *CKPTFIX,
                                                                       "inspect", fsdp2]
        commands["ckptfix inspect small.pth (torch path)"] = ["env", "CKPTFIX_TORCH_FREE=0", *CKPTFIX, "inspect",
                                                              str(inputs["small.pth"])]
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.rounds):
            for name, cmd in commands.items():  # alternating: each round runs every command once
                times[name].append(timed(cmd))
        torch_s = statistics.median(times["python -c 'import torch'"])
        big = os.path.getsize(inputs["big.pth"]) / 1e9
        print(f"{args.rounds} rounds, big.pth {big:.2f} GB, python {sys.version.split()[0]}")
        print(f"{'command':<44} {'median s':>9} {'min s':>7} {'× import torch':>15}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<44} {med:>9.3f} {min(ts):>7.3f} {med / torch_s:>15.3f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
