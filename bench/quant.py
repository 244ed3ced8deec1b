"""Benchmark: dequantization throughput of ckptfix against the publishing library's own, on the same file (issue 28).

Not a test. For each real file llmcompressor wrote under fixtures/quant/llmcompressor/ (FP8 block, FP8 per-channel,
NVFP4A16, W4A16; fixtures/quant/MANIFEST.json), the file's quantized groups are made --factor times taller
(each group's weight and per-row companions repeated along the output dimension, ``weight_shape`` adjusted: the same
layout, the same scales, more rows), held in memory, then dequantized group by group by each side:

- ckptfix: ``ckptfix.statedict.quant_dequant.dequantize(group, tensors, dtype)`` on the groups
  ``quant_groups.find_groups`` finds;
- compressed-tensors: the compressor the file's ``quantization_config`` names
  (``BaseCompressor.load_from_registry(format).decompress(module_tensors, scheme)``), as
  fixtures/quant/make_llmcompressor.py made the reference files with it.

Both produce the dtype compressed-tensors returns (its scales' dtype); the two outputs are compared once, outside the
timers (max abs difference; a row whose outputs part beyond that dtype's rounding fails). Rounds alternate the
order of the two sides; each side's time is the median over rounds, the ratio the median of per-round ratios;
throughput is the stored bytes of the quantized groups per second. Without compressed-tensors installed, a row's
library column says ``skipped``.

    python bench/quant.py                      # --factor 64, 5 rounds: about a minute
    python bench/quant.py --factor 1 --rounds 1 --json out.json    # the smoke run tests/test_bench_quant.py makes
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "quant" / "llmcompressor"
#: row id → the fixture folder it reads
FILES = {"ct-fp8-block": "fp8_block", "ct-fp8-channel": "fp8_channel", "ct-nvfp4": "nvfp4a16", "ct-w4a16": "w4a16"}


@dataclass
class Row:
    id: str
    label: str
    status: str = "ok"
    groups: int = 0
    stored_mib: float = 0.0
    ckptfix_s: float | None = None
    library_s: float | None = None
    ratio: float | None = None  #: ckptfix time / library time (below 1: ckptfix faster)
    max_abs_diff: float | None = None
    traceback: str | None = field(default=None, repr=False)


def taller(tensors: dict[str, Any], groups: list[Any], factor: int) -> dict[str, Any]:
    """Each group's 2-D tensors repeated ``factor`` times along dim 0 (``weight_shape``'s rows too): the same
    layout with ``factor`` times the rows, every block and scale as stored (a block grid with a partial last row of
    blocks stays as stored)."""
    import torch

    out = dict(tensors)
    for group in groups:
        block = group.params.get("block")
        if block and tensors[group.weight].shape[0] % block[0]:
            continue  # a ceil-grid edge: repeated rows would need a grid row more (kept as stored)
        for key in group.keys:
            t = tensors[key]
            if key.endswith("weight_shape"):
                out[key] = t * torch.tensor([factor, 1], dtype=t.dtype)
            elif t.dim() == 2 and t.numel() > 1:  # not a per-tensor scale
                out[key] = t.repeat(factor, 1)
    return out


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def library_side(folder: Path, tensors: dict[str, Any], groups: list[Any]) -> Callable[[], dict[str, Any]]:
    """compressed-tensors' own decompression of every group (the compressor its config names)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    compressor = BaseCompressor.load_from_registry(config.format)
    local = {g.module: {k[len(g.module) + 1:]: tensors[k] for k in g.keys} for g in groups}
    return lambda: {m: compressor.decompress(t, scheme)["weight"] for m, t in local.items()}


def ckptfix_side(tensors: dict[str, Any], groups: list[Any], dtype: Any) -> Callable[[], dict[str, Any]]:
    from ckptfix.statedict import quant_dequant

    return lambda: {g.module: quant_dequant.dequantize(g, tensors, dtype=dtype) for g in groups}


def run_row(row_id: str, factor: int, rounds: int) -> Row:
    import torch
    from safetensors.torch import load_file

    from ckptfix.ops.quantized import quant_config
    from ckptfix.statedict import quant_groups

    folder = FIXTURES / FILES[row_id]
    row = Row(row_id, f"{row_id} ({FILES[row_id]}, x{factor} rows)")
    stored = load_file(str(folder / "model.safetensors"))
    infos = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in stored.items()}
    groups = quant_groups.find_groups(infos, quant_config(str(folder / "model.safetensors"))).groups
    tensors = taller(stored, groups, factor)
    row.groups = len(groups)
    row.stored_mib = sum(tensors[k].numel() * tensors[k].element_size() for g in groups for k in g.keys) / 2**20
    if importlib.util.find_spec("compressed_tensors") is None:
        ours = ckptfix_side(tensors, groups, torch.bfloat16)
        ours()
        row.ckptfix_s = statistics.median(_time(ours) for _ in range(rounds))
        row.status = "skipped: compressed-tensors is not installed (pip install compressed-tensors==0.20.0)"
        return row
    theirs = library_side(folder, tensors, groups)
    want = theirs()  # first calls (imports, registries) outside the timers
    ours = ckptfix_side(tensors, groups, next(iter(want.values())).dtype)
    got = ours()
    row.max_abs_diff = max(float((got[m].float() - want[m].float()).abs().max()) for m in want)
    if any(not torch.allclose(got[m].float(), want[m].float(), rtol=2 ** -7, atol=0) for m in want):
        row.status = f"FAILED: the outputs part beyond the output dtype's rounding (max abs {row.max_abs_diff:.3g})"
    times: dict[str, list[float]] = {"ckptfix": [], "library": []}
    for r in range(rounds):
        order = [("ckptfix", ours), ("library", theirs)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(_time(fn))
    row.ckptfix_s, row.library_s = statistics.median(times["ckptfix"]), statistics.median(times["library"])
    row.ratio = statistics.median(a / b for a, b in zip(times["ckptfix"], times["library"]))
    return row


def table(rows: list[Row]) -> str:
    def speed(row: Row, seconds: float | None) -> str:
        return f"{row.stored_mib / seconds:.3g} MiB/s" if seconds else "—"

    lines = ["| file | groups | stored | ckptfix | compressed-tensors | ratio | status |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row.ratio:.2f}×" if row.ratio is not None else "—"
        lines.append(f"| {row.label} | {row.groups} | {row.stored_mib:.1f} MiB | {speed(row, row.ckptfix_s)} | "
                     f"{speed(row, row.library_s)} | {ratio} | {row.status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factor", type=int, default=64, help="rows of each group, times the file's (default 64)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for row_id in FILES:
        try:
            rows.append(run_row(row_id, args.factor, args.rounds))
        except Exception as e:  # a row that breaks says so; the others still run
            rows.append(Row(row_id, row_id, status=f"error: {type(e).__name__}: {e}", traceback=traceback.format_exc()))
    import torch

    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if importlib.util.find_spec("compressed_tensors") is not None:
        versions["compressed-tensors"] = importlib.metadata.version("compressed-tensors")
    print(table(rows))
    print(f"\n{versions}; --factor {args.factor}, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "factor": args.factor, "rounds": args.rounds,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
