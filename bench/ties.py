"""A model's tied weight that the file stores under both names: what ckptfix.load_into's check of the twin costs.

GPT-2's embedding (50257 × 768, fp32: 154 MB) tied to its head, in three files: stored once (``save_model``), twice
with ckptfix's digests (``ckptfix.convert`` stores every tied name), twice without (``save_file`` of clones, what
users write when safetensors refuses shared tensors). load_into compares the twin with the tensor it loads before
anything is touched (different values are refused); the rows time it beside the plain loaders and the floor for any
check of the twin (the clones file's bytes read once: numpy sums it through a memmap, one thread), each row's median of
per-round times over alternating rounds, warm, as ratios to ``safetensors.torch.load_model`` of the file stored once;
``--busy N``: N CPU-bound processes spinning throughout (bench/measure.py's).

    python bench/ties.py [--vocab 50257] [--dim 768] [--rounds 7] [--busy 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import busy  # noqa: E402  (bench/measure.py, beside this script)


class Tied(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


def make_files(folder: Path, model: nn.Module) -> dict[str, str]:
    import ckptfix
    from safetensors.torch import save_file, save_model

    sd = model.state_dict()
    files = {name: str(folder / f"{name}.safetensors") for name in ("once", "digests", "clones")}
    save_model(model, files["once"])
    torch.save(sd, folder / "tied.pth")
    ckptfix.convert(folder / "tied.pth", files["digests"])
    save_file({k: v.clone() for k, v in sd.items()}, files["clones"])
    return files


def _floor(path: str) -> None:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    data[: data.size // 8 * 8].view(np.uint64).sum()
    del data


def rows(files: dict[str, str]) -> dict[str, tuple[str, Callable[[nn.Module], Any]]]:
    import ckptfix
    from safetensors.torch import load_file, load_model

    return {  # id -> (label, load into the model)
        "floor": ("the floor: the clones file's bytes read once (numpy memmap sum, one thread)",
                  lambda m: _floor(files["clones"])),
        "load_model": ("safetensors.torch.load_model, stored once (the anchor)", lambda m: load_model(m, files["once"])),
        "once": ("ckptfix.load_into, stored once", lambda m: ckptfix.load_into(m, files["once"])),
        "digests": ("ckptfix.load_into, stored twice, digests recorded (ckptfix convert)",
                    lambda m: ckptfix.load_into(m, files["digests"])),
        "clones": ("ckptfix.load_into, stored twice, no digests (save_file of clones)",
                   lambda m: ckptfix.load_into(m, files["clones"])),
        "plain_clones": ("load_state_dict(load_file()), stored twice (both copied in)",
                         lambda m: m.load_state_dict(load_file(files["clones"]))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes spinning throughout (default 0)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Tied(args.vocab, args.dim)
        table = rows(make_files(Path(tmp), model))
        times: dict[str, list[float]] = {k: [] for k in table}
        spinners = busy(args.busy)
        try:
            for _ in range(args.rounds + 1):  # (the first round warms the page cache and imports: dropped)
                for key, (_label, load) in table.items():
                    start = time.perf_counter()
                    load(model)
                    times[key].append(time.perf_counter() - start)
        finally:
            for spinner in spinners:
                spinner.kill()
        medians = {k: statistics.median(v[1:]) for k, v in times.items()}
        out = [{"id": k, "label": label, "s": medians[k], "x_anchor": medians[k] / medians["load_model"]}
               for k, (label, _load) in table.items()]
    print("| row | s | × load_model |\n|---|---:|---:|")
    for row in out:
        print(f"| {row['label']} | {row['s']:.4f} | {row['x_anchor']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"vocab": args.vocab, "dim": args.dim, "rounds": args.rounds,
                                               "busy": args.busy, "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
