"""Benchmark: dequantization throughput of ckptfix against the publishing library's own, on the same file (issue 28).

Not a test. Each row (:data:`CASES`) reads a real file under fixtures/quant/ (fixtures/quant/MANIFEST.json), makes
its quantized groups --factor times taller (each group's tensors repeated along their first dimension — rows, or
gpt-oss's experts —, ``weight_shape`` adjusted: the same layout, the same scales, more of them), holds them in
memory, then dequantizes group by group on each side:

- ckptfix: ``ckptfix.statedict.quant_dequant.dequantize(group, tensors, dtype)`` on the groups
  ``quant_groups.find_groups`` finds;
- the library: compressed-tensors' compressor its ``quantization_config`` names (``BaseCompressor.load_from_registry(
  format).decompress(module_tensors, scheme)``, as fixtures/quant/make_llmcompressor.py made the references) for
  llmcompressor's FP8 block, FP8 per-channel, NVFP4A16 and W4A16; transformers' own for block FP8 in DeepSeek's
  layout (the FP8 block file's values with ``weight_scale_inv`` keys: ``integrations/finegrained_fp8.
  _dequantize_fp8_weight``) and for gpt-oss MXFP4 (``integrations/mxfp4.convert_moe_packed_tensors``).

Both produce the dtype the library returns (compressed-tensors: its scales' dtype; transformers: bf16, asked); the
outputs are compared once, outside the timers (a row whose outputs part beyond that dtype's rounding fails). Rounds
alternate the order of the two sides; each side's time is the median over rounds, the ratio the median of per-round
ratios; throughput is the stored bytes of the quantized groups per second. Where the library does not import, the
row says ``skipped`` (ckptfix's time is still taken).

    python bench/quant.py                      # --factor 64, 5 rounds: about a minute
    python bench/quant.py --factor 2 --rounds 1 --json out.json    # the smoke run tests/test_bench_quant.py makes
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
QUANT = ROOT / "fixtures" / "quant"
#: DeepSeek-V3 / Qwen3 block FP8's config (transformers' finegrained_fp8 reads it)
DEEPSEEK_FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


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
    """Each group's tensors of two dimensions or more repeated ``factor`` times along dim 0 (``weight_shape``'s rows
    too): the same layout, ``factor`` times the rows (or experts), every block and scale as stored (a block grid
    with a partial last row of blocks stays as stored)."""
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
            elif t.dim() >= 2 and (t.numel() > 1 or block):  # not a per-tensor scale (a 1×1 grid of blocks is not)
                out[key] = t.repeat(factor, *[1] * (t.dim() - 1))
    return out


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


Side = Callable[[dict[str, Any], list[Any], dict[str, Any]], Callable[[], dict[str, Any]]]


def compressed_tensors_side(tensors: dict[str, Any], groups: list[Any], config: dict[str, Any]) -> Callable[[], dict]:
    """compressed-tensors' own decompression of every group (the compressor its config names)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(config["quantization_config"])
    (scheme,) = qc.config_groups.values()
    compressor = BaseCompressor.load_from_registry(qc.format)
    local = {g.module: {k[len(g.module) + 1:]: tensors[k] for k in g.keys} for g in groups}
    return lambda: {m: compressor.decompress(t, scheme)["weight"] for m, t in local.items()}


def transformers_fp8_side(tensors: dict[str, Any], groups: list[Any], config: dict[str, Any]) -> Callable[[], dict]:
    """transformers' block-FP8 dequantization (integrations/finegrained_fp8.py), in bf16."""
    import torch
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    block = config["quantization_config"]["weight_block_size"]
    return lambda: {g.module: _dequantize_fp8_weight(tensors[g.weight], tensors[g.companions["scale"]], block,
                                                     torch.bfloat16) for g in groups}


def transformers_mxfp4_side(tensors: dict[str, Any], groups: list[Any], config: dict[str, Any]) -> Callable[[], dict]:
    """transformers' gpt-oss MXFP4 conversion (integrations/mxfp4.py), in bf16."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return lambda: {g.module: convert_moe_packed_tensors(tensors[g.weight], tensors[g.companions["scale"]],
                                                         dtype=torch.bfloat16) for g in groups}


def deepseek_layout(tensors: dict[str, Any], config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A compressed-tensors FP8 block file's values as DeepSeek-V3 publishes block FP8: ``weight_scale_inv`` (F32)."""
    import torch

    return ({k.removesuffix("_scale") + "_scale_inv" if k.endswith(".weight_scale") else k:
             v.to(torch.float32) if k.endswith(".weight_scale") else v for k, v in tensors.items()}, DEEPSEEK_FP8)


@dataclass(frozen=True)
class Case:
    """One row: the file (under fixtures/quant), the library module that must import, its side, and a change of
    layout applied to the file's tensors first (None: as stored)."""

    id: str
    folder: str
    library: str
    side: Side
    relayout: Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]] | None = None


CASES = (
    Case("ct-fp8-block", "llmcompressor/fp8_block", "compressed_tensors", compressed_tensors_side),
    Case("ct-fp8-channel", "llmcompressor/fp8_channel", "compressed_tensors", compressed_tensors_side),
    Case("ct-nvfp4", "llmcompressor/nvfp4a16", "compressed_tensors", compressed_tensors_side),
    Case("ct-w4a16", "llmcompressor/w4a16", "compressed_tensors", compressed_tensors_side),
    Case("fp8-block-deepseek", "llmcompressor/fp8_block", "transformers", transformers_fp8_side, deepseek_layout),
    Case("mxfp4-gpt-oss", "mxfp4/gpt_oss", "transformers", transformers_mxfp4_side),
)


def _load(case: Case, factor: int) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    """The case's file as tensors (in its library's layout), its groups, made ``factor`` times taller, and its config."""
    from safetensors.torch import load_file

    from ckptfix.ops.quantized import read_configs
    from ckptfix.statedict import quant_groups

    path = QUANT / case.folder / "model.safetensors"
    tensors, config = load_file(str(path)), read_configs(str(path)).for_schemes() or {}
    if case.relayout is not None:
        tensors, config = case.relayout(tensors, config)
    infos = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()}
    groups = quant_groups.find_groups(infos, config).groups
    return taller(tensors, groups, factor), groups, config


def run_row(case: Case, factor: int, rounds: int) -> Row:
    import torch

    from ckptfix.statedict import quant_dequant

    row = Row(case.id, f"{case.id} ({case.folder}, x{factor})")
    tensors, groups, config = _load(case, factor)
    row.groups = len(groups)
    row.stored_mib = sum(tensors[k].numel() * tensors[k].element_size() for g in groups for k in g.keys) / 2**20
    if importlib.util.find_spec(case.library) is None:
        row.status = f"skipped: {case.library} is not installed"
        theirs, dtype = None, torch.bfloat16
    else:
        theirs = case.side(tensors, groups, config)
        want = theirs()  # first calls (imports, registries) outside the timers
        dtype = next(iter(want.values())).dtype
    ours = lambda: {g.module: quant_dequant.dequantize(g, tensors, dtype=dtype) for g in groups}  # noqa: E731
    got = ours()
    if theirs is not None:
        row.max_abs_diff = max(float((got[m].float() - want[m].float()).abs().max()) for m in want)
        if any(not torch.allclose(got[m].float(), want[m].float(), rtol=2 ** -7, atol=0) for m in want):
            row.status = f"FAILED: the outputs part beyond {dtype}'s rounding (max abs {row.max_abs_diff:.3g})"
    times: dict[str, list[float]] = {"ckptfix": [], "library": []}
    for r in range(rounds):
        order = [("ckptfix", ours), ("library", theirs)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            if fn is not None:
                times[name].append(_time(fn))
    row.ckptfix_s = statistics.median(times["ckptfix"])
    if times["library"]:
        row.library_s = statistics.median(times["library"])
        row.ratio = statistics.median(a / b for a, b in zip(times["ckptfix"], times["library"]))
    return row


def table(rows: list[Row]) -> str:
    def speed(row: Row, seconds: float | None) -> str:
        return f"{row.stored_mib / seconds:.3g} MiB/s" if seconds else "—"

    lines = ["| file | groups | stored | ckptfix | library | ratio | status |", "|---|---|---|---|---|---|---|"]
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
    for case in CASES:
        try:
            rows.append(run_row(case, args.factor, args.rounds))
        except Exception as e:  # a row that breaks says so; the others still run
            rows.append(Row(case.id, case.id, status=f"error: {type(e).__name__}: {e}", traceback=traceback.format_exc()))
    import torch

    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("compressed-tensors", "transformers"):
        if importlib.util.find_spec(dist.replace("-", "_")) is not None:
            versions[dist] = importlib.metadata.version(dist)
    print(table(rows))
    print(f"\n{versions}; --factor {args.factor}, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "factor": args.factor, "rounds": args.rounds,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    return 0 if all(r.status == "ok" or r.status.startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
