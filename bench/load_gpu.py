"""load_into onto a CUDA device against the plain loaders, side by side in one process (needs a GPU).

    python bench/load_gpu.py [--size-mib 1024] [--runs 5]

Rows: ``safetensors.torch.load_model(model, path, device="cuda")`` and ``model.load_state_dict(
torch.load(path, mmap=True, weights_only=True))`` into a model built on the GPU (the anchors);
``ckptfix.load_into`` into the same model (checks on and off); ``load_state_dict(load_file(path,
device="cuda"), assign=True)`` and ``ckptfix.load_into(meta_model, path, map_location="cuda")`` into a
meta-built model. File in the page cache; median of alternating runs; each time ends with a device sync.
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


def main() -> None:
    import safetensors.torch as st
    import torch
    from torch import nn

    import ckptfix

    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    layers = max(1, args.size_mib // 16)

    def net() -> nn.Module:
        return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])

    work = tempfile.mkdtemp()
    src = net()
    st.save_model(src, f"{work}/m.safetensors")
    torch.save(src.state_dict(), f"{work}/m.pth")
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, f"{work}/m_ddp.pth")
    for name in ("m.safetensors", "m.pth", "m_ddp.pth"):
        with open(f"{work}/{name}", "rb") as f:
            while f.read(64 << 20):
                pass
    model = net().cuda()

    def meta_then(fn: Callable[[nn.Module], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.device("meta"):
                m = net()
            return fn(m)
        return run

    cases: dict[str, Callable[[], object]] = {
        "safetensors.load_model (cuda)": lambda: st.load_model(model, f"{work}/m.safetensors", device="cuda"),
        "ckptfix.load_into safetensors": lambda: ckptfix.load_into(model, f"{work}/m.safetensors"),
        "ckptfix.load_into safetensors, check_values=False":
            lambda: ckptfix.load_into(model, f"{work}/m.safetensors", check_values=False),
        "torch.load(mmap) + load_state_dict": lambda: model.load_state_dict(
            torch.load(f"{work}/m.pth", mmap=True, weights_only=True)),
        "ckptfix.load_into m_ddp.pth": lambda: ckptfix.load_into(model, f"{work}/m_ddp.pth"),
        "ckptfix.load_into m_ddp.pth, check_values=False":
            lambda: ckptfix.load_into(model, f"{work}/m_ddp.pth", check_values=False),
        "meta: load_file(cuda) + assign=True": meta_then(lambda m: m.load_state_dict(
            st.load_file(f"{work}/m.safetensors", device="cuda"), assign=True)),
        "meta: ckptfix.load_into map_location=cuda": meta_then(
            lambda m: ckptfix.load_into(m, f"{work}/m.safetensors", map_location="cuda")),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.runs):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    print(f"| {torch.cuda.get_device_name()}, {layers * 16} MiB fp32, median of {args.runs} | s | ratio |")
    print("|---|---|---|")
    anchor = None
    for name, ts in times.items():
        med = statistics.median(ts)
        if "ckptfix" not in name:
            anchor = med
        print(f"| {name} | {med:.3f} | {med / anchor:.2f}× |" if anchor else f"| {name} | {med:.3f} | |")


if __name__ == "__main__":
    main()
