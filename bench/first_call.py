"""bench/load.py's ``first-call`` mode (issue 29): the first load of a fresh process — a server's only call.

Each run is a fresh ``python -c`` process that, before the clock, imports torch, safetensors and ckptfix and its
row's loader (``from safetensors.torch import load_file``; ``from ckptfix import load_into``: resolving the verb is
ckptfix's documented warm-up, it imports everything a call needs), builds the model (on the CPU, or on meta), reads
the file once (warm page cache) and collects garbage (no collection left pending, for every row alike). Only the one
call is timed, wall and CPU (``time.process_time``: every thread of the process); then the loaded model is compared
bit for bit with the file, and the modules the call imported are counted (the warm-up's promise: none). The model
has GPT-2's 148 tensors (12 blocks of two LayerNorms and four Linears, token and position embeddings, a final
LayerNorm), its width set by the size. Rounds alternate the rows' order; "ms above plain" is the median over rounds
of the row's time minus the plain loader's on the same file in the same round (7 rounds unless ``--rounds`` says
otherwise; the issue asks for at least 7). The import of each row's loader is timed too (its own column: excluded
from the call on both sides). One row loads with ``check_values=False``: beside the checked row, what the NaN/Inf check
costs of the call; one with ``CKPTFIX_NO_NATIVE=1``: what a build without the compiled kernels (no C compiler at
install) takes (no bound on either: the issue's is the default checked call's).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: (vocabulary, positions) per unit of width, as GPT-2's 50257 and 1024 to its 768
VOCAB, POSITIONS = 50257 / 768, 1024 / 768
#: parameters per width²: 12 blocks of 12·d² (attention 4·d², MLP 8·d²), and the embeddings
PER_WIDTH2 = 12 * 12 + VOCAB + POSITIONS
TARGET_MS = 10.0  # the bound: ms above the plain loader's first call

MODEL = '''
import torch
from torch import nn
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
class GPT(nn.Module):
    def __init__(self, d, vocab, positions):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(Block(d) for _ in range(12))
        self.ln_f = nn.LayerNorm(d)
'''

#: one run: argv[1] is the spec (JSON); prints one JSON line. Everything before ``t0`` is out of the timer.
CHILD = MODEL + '''
import gc, json, sys, time
import safetensors.torch, ckptfix
spec = json.loads(sys.argv[1])
t = time.perf_counter()
if spec["loader"] == "ckptfix":
    from ckptfix import load_into
elif spec["file"].endswith(".safetensors"):
    from safetensors.torch import load_file
verb_import = time.perf_counter() - t
shape = spec["shape"]
if spec["model"] == "meta":
    with torch.device("meta"):
        model = GPT(*shape)
else:
    model = GPT(*shape)
with open(spec["file"], "rb", buffering=0) as f:  # warm: the file's pages in the page cache
    while f.read(8 << 20):
        pass
gc.collect()
before = set(sys.modules)
t0, c0 = time.perf_counter(), time.process_time()
if spec["loader"] == "ckptfix":
    load_into(model, spec["file"], check_values=spec["check"])
elif spec["file"].endswith(".safetensors"):
    model.load_state_dict(load_file(spec["file"]))
else:
    model.load_state_dict(torch.load(spec["file"], weights_only=True, mmap=True))
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
imported = sorted(set(sys.modules) - before)
want = safetensors.torch.load_file(spec["truth"])
got = model.state_dict()
wrong = sorted(set(got) ^ set(want)) or [k for k in want if got[k].is_meta or not torch.equal(got[k], want[k])]
print(json.dumps({"seconds": seconds, "cpu": cpu, "verb_import": verb_import, "imported": imported,
                  "error": f"differs from the file: {wrong[:3]}" if wrong else None}))
'''


@dataclass(frozen=True)
class Row:
    """One row: ``loader`` ("plain" or "ckptfix") reads ``file`` ("st" or "pth") into a model built ``model``
    ("cpu" or "meta"); compared with the plain loader's row of the same file (``vs``)."""

    id: str
    label: str
    loader: str
    file: str
    model: str = "cpu"
    check: bool = True  # ckptfix's NaN/Inf check (False: the row shows what the check costs; the bound is not its)
    native: bool = True  # ckptfix's compiled kernels (False: CKPTFIX_NO_NATIVE=1, the numpy check a build without a
    # C compiler runs; the bound is the default's)

    @property
    def vs(self) -> str:
        return f"{self.file}.plain"


ROWS = [
    Row("st.plain", "model.load_state_dict(load_file(p))", "plain", "st"),
    Row("st.ckptfix", "ckptfix.load_into(model, p)", "ckptfix", "st"),
    Row("st.ckptfix.unchecked", "ckptfix.load_into(model, p, check_values=False)", "ckptfix", "st", check=False),
    Row("st.ckptfix.numpy", "ckptfix.load_into(model, p), CKPTFIX_NO_NATIVE=1", "ckptfix", "st", native=False),
    Row("st.ckptfix.meta", "ckptfix.load_into(model, p), meta-built", "ckptfix", "st", "meta"),
    Row("pth.plain", "model.load_state_dict(torch.load(p, weights_only=True, mmap=True))", "plain", "pth"),
    Row("pth.ckptfix", "ckptfix.load_into(model, p)", "ckptfix", "pth"),
    Row("pth.ckptfix.meta", "ckptfix.load_into(model, p), meta-built", "ckptfix", "pth", "meta"),
]
FILES = {"st": "gpt.safetensors", "pth": "gpt.pth"}


def shape_for(size_mib: float) -> tuple[int, int, int]:
    """(width, vocabulary, positions) of a GPT-2-shaped fp32 model of about ``size_mib``."""
    d = max(8, round(math.sqrt(size_mib * 2**20 / 4 / PER_WIDTH2)))
    return d, round(VOCAB * d), round(POSITIONS * d)


def make_files(folder: Path, shape: tuple[int, int, int]) -> dict[str, str]:
    """The model's seeded values as ``gpt.safetensors`` and ``gpt.pth`` (kept when ``folder`` holds them for ``shape``)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: str(folder / name) for kind, name in FILES.items()}
    stamp = folder / "gpt-shape.json"
    if stamp.exists() and json.loads(stamp.read_text()) == list(shape) and all(map(os.path.exists, paths.values())):
        return paths
    import torch
    from safetensors.torch import save_file

    scope: dict[str, Any] = {}
    exec(MODEL, scope)  # the class the children build
    model = scope["GPT"](*shape)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=g)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state_dict, paths["st"])
    torch.save(state_dict, paths["pth"])
    stamp.write_text(json.dumps(list(shape)))
    return paths


def run_once(row: Row, files: dict[str, str], shape: tuple[int, int, int], timeout: float) -> dict[str, Any]:
    """One fresh process of ``row``: its call's seconds, CPU seconds, the loader's import and what the call imported."""
    spec = {"loader": row.loader, "file": files[row.file], "model": row.model, "shape": list(shape), "truth": files["st"],
            "check": row.check}
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "CKPTFIX_NO_NATIVE": "" if row.native else "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result after {timeout} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": " ".join(out.stderr.split()[-40:]) or f"exit code {out.returncode}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result if result["error"] else {k: v for k, v in result.items() if k != "error"}


def run(workdir: Path, size_mib: float, rounds: int, timeout: float) -> dict[str, Any]:
    """Every row ``rounds`` times, alternating the order; the runs per row and the setup."""
    shape = shape_for(size_mib)
    files = make_files(workdir, shape)
    runs: dict[str, list[dict[str, Any]]] = {row.id: [] for row in ROWS}
    for r in range(rounds):
        for row in ROWS if r % 2 == 0 else reversed(ROWS):
            if any(run.get("error") for run in runs[row.id]):
                runs[row.id].append({"error": "skipped after an earlier failure"})
                continue
            run_ = run_once(row, files, shape, timeout)
            runs[row.id].append(run_)
            shown = f"{run_['seconds'] * 1000:.1f} ms" if "seconds" in run_ else f"FAILED {run_['error']}"
            print(f"first-call round {r + 1}: {row.id}: {shown}", file=sys.stderr)
    rows = [{"id": row.id, "label": row.label, "file": FILES[row.file], "model": row.model, "vs": row.vs,
             "bounded": row.check and row.native}
            for row in ROWS]
    setup = {"size_mib": os.path.getsize(files["st"]) / 2**20, "size_mib_arg": size_mib, "rounds": rounds,
             "shape": list(shape), "tensors": 148, "target_ms": TARGET_MS, "when": time.strftime("%Y-%m-%d")}
    return {"setup": setup, "rows": rows, "runs": runs}
