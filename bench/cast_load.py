"""A load that casts: a bf16 safetensors file into an fp32 model, side by side in one process (CPU).

    python bench/cast_load.py [--size-mib 512] [--rounds 7]

Rows, each timed in every round (rounds alternate their order; the file in the page cache): the floor (every byte of
the file read once: ``readinto`` a reused buffer, one thread), ``model.load_state_dict(load_file(path))`` (the plain
loader: the file mapped, torch's ``copy_`` casts), and ``ckptfix.load_into`` (the file read in windows by a few
threads, each window cast into the model while it is in cache, the NaN/Inf check on each chunk) into a CPU-built model,
checks on and off, and into a meta-built one (its values read the same way, into memory allocated for them;
beside it the plain loader's equivalent: ``load_file``, each tensor cast, ``assign=True``). Each row's median time, and the median
of its per-round ratios to the plain loader and to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20


def main() -> None:
    import safetensors.torch as st
    import torch
    from torch import nn

    import ckptfix

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    width = 2048
    layers = max(1, args.size_mib * MiB // (width * width * 2))  # (the file's bf16 bytes)

    def net() -> nn.Module:
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    work = tempfile.mkdtemp()
    path = f"{work}/m.safetensors"
    src = net().bfloat16()
    st.save_model(src, path)
    size = os.path.getsize(path)
    model = net()
    buf = bytearray(16 * MiB)

    def floor() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def meta() -> None:
        with torch.device("meta"):
            m = net()
        ckptfix.load_into(m, path)

    def meta_plain() -> None:  # (assign=True keeps the file's dtype: cast first, as the model's dtype asks)
        with torch.device("meta"):
            m = net()
        m.load_state_dict({k: v.float() for k, v in st.load_file(path).items()}, assign=True)

    rows: dict[str, Callable[[], object]] = {
        "floor: every byte read once": floor,
        "load_state_dict(load_file())": lambda: model.load_state_dict(st.load_file(path)),
        "ckptfix.load_into": lambda: ckptfix.load_into(model, path),
        "ckptfix.load_into(check_values=False)": lambda: ckptfix.load_into(model, path, check_values=False),
        "meta-built: load_state_dict({k: v.float() for load_file()}, assign=True)": meta_plain,
        "ckptfix.load_into, meta-built": meta,
    }
    for fn in rows.values():
        fn()  # (warm: the page cache, first-call set-up)
    want = src[0].weight.float()
    assert torch.equal(model[0].weight, want)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(args.rounds):
        for name, fn in (list(rows.items()) if r % 2 == 0 else list(reversed(rows.items()))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    plain, base = times["load_state_dict(load_file())"], times["floor: every byte read once"]
    print(f"{size / MiB:.0f} MiB bf16 file into fp32, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.rounds} rounds, median")
    print("| row | ms | × plain | × floor |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        vs_plain = statistics.median(t / p for t, p in zip(ts, plain))
        vs_floor = statistics.median(t / b for t, b in zip(ts, base))
        print(f"| {name} | {1e3 * statistics.median(ts):.1f} | {vs_plain:.2f} | {vs_floor:.2f} |")


if __name__ == "__main__":
    main()
