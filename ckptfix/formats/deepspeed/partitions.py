"""Where each fp32 master weight sits in a DeepSpeed ZeRO checkpoint: zero_to_fp32.py's rules as data.

Pure bookkeeping over shapes: every output tensor becomes a :class:`Spec`, the list of
(source tensor, first element, count) pieces that, concatenated, are its values. Nothing is read
here; the reader decides whether a spec is copied in the kernel, gathered while writing, or
loaded. The rules are those of deepspeed 0.19.8's ``zero_to_fp32.py``:

- buffers (``buffer_names``) come from rank 0's ``module``;
- frozen parameters (``frozen_param_shapes``, stages 2–3 only) from ``frozen_param_fragments``, saved
  in the training dtype: whole (stage 2), or each rank's padded slice concatenated (stage 3);
- every floating-point tensor is written as float32 (the script's ``--dtype`` default: a bf16 buffer
  or frozen parameter is upcast; integer buffers keep their dtype);
- stages 1–2: each param group's per-rank ``single_partition_of_fp32_groups`` concatenated in rank
  order hold the parameters of ``param_shapes`` back to back, each followed by its
  ``param_alignment_paddings`` entry; the total, rounded up to 2 × world size, must match;
- stage 3: every parameter is split into ``ceil(numel / world)``-element slices, one per rank, at
  the same offset of each rank's ``fp32_flat_groups`` (concatenated); the last slice is padded;
- ``shared_params`` (rank 0) name the tensor each tied parameter shares.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import DeepSpeedZeroError


@dataclass
class Spec:
    """One output tensor: its shape and dtype, and the pieces of flattened source tensors it is made of."""

    shape: tuple[int, ...]
    dtype: Any
    pieces: list[tuple[Any, int, int]]  # (source tensor, first element of its flattened values, count)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _out_dtype(dtype: Any) -> Any:
    """float32 for every floating-point dtype, as zero_to_fp32.py writes them; others as they are."""
    import torch

    return torch.float32 if dtype.is_floating_point else dtype


def _numel(shape: Any) -> int:
    return shape.numel() if hasattr(shape, "numel") else math.prod(shape)


def _slices(sources: list[Any], start: int, count: int) -> list[tuple[Any, int, int]]:
    """``count`` elements from ``start`` of the concatenation of the 1-D ``sources``, as pieces."""
    pieces, base = [], 0
    for t in sources:
        n = t.numel()
        lo, hi = max(start, base), min(start + count, base + n)
        if lo < hi:
            pieces.append((t, lo - base, hi - lo))
        base += n
    return pieces


def _trim(pieces: list[tuple[Any, int, int]], count: int) -> list[tuple[Any, int, int]]:
    """The first ``count`` elements of ``pieces`` (the padding at the end dropped)."""
    out = []
    for t, s, n in pieces:
        if count <= 0:
            break
        out.append((t, s, min(n, count)))
        count -= n
    return out


def plan(stage: int, world: int, model_states: list[Mapping], flat: list[list[Any]], paddings: Any,
         where: str) -> OrderedDict:
    """key → Spec (or → the key whose tensor it shares), in zero_to_fp32.py's order.

    ``model_states``: rank 0's first (stage 3: every rank's, for frozen fragments); ``flat``: per rank,
    its fp32 groups; ``paddings``: ``param_alignment_paddings`` (stages 1–2) or None.
    """
    import torch

    first = model_states[0]
    out: OrderedDict = OrderedDict()
    names = set(first.get("buffer_names") or [])
    for k, v in first["module"].items():
        if k in names and isinstance(v, torch.Tensor):
            out[k] = Spec(tuple(v.shape), _out_dtype(v.dtype), [(v, 0, v.numel())])
    for name, shape in (first.get("frozen_param_shapes") or {}).items():
        out[name] = _frozen(stage, name, shape, model_states, where)
    shapes = first.get("param_shapes") or []
    if stage <= 2:
        for i, group in enumerate(shapes):
            _zero2_group(out, i, group, [ranks[i] for ranks in flat], world, paddings, where)
    else:
        _zero3(out, {k: v for g in shapes for k, v in g.items()}, flat, world, where)
    for name, target in (first.get("shared_params") or {}).items():
        if target in out:
            out[name] = target
    return out


def _frozen(stage: int, name: str, shape: Any, model_states: list[Mapping], where: str) -> Spec:
    numel = _numel(shape)
    if stage <= 2:
        frag = model_states[0]["frozen_param_fragments"][name]
        return Spec(tuple(frag.shape), _out_dtype(frag.dtype), [(frag, 0, frag.numel())])
    frags = [ms["frozen_param_fragments"][name] for ms in model_states]
    if sum(f.numel() for f in frags) < numel:
        raise DeepSpeedZeroError(f"{where}: frozen parameter {name!r} needs {numel} elements; its fragments hold "
                                 f"{sum(f.numel() for f in frags)}: a rank's model_states is from another save")
    return Spec(tuple(int(n) for n in shape), _out_dtype(frags[0].dtype), _trim([(f, 0, f.numel()) for f in frags], numel))


def _zero2_group(out: OrderedDict, i: int, shapes: Mapping, partitions: list[Any], world: int, paddings: Any,
                 where: str) -> None:
    group_paddings = None
    if paddings is not None:
        group_paddings = paddings[i]
        if len(group_paddings) != len(shapes):
            raise DeepSpeedZeroError(f"{where}: param group {i} lists {len(shapes)} parameters but "
                                     f"{len(group_paddings)} alignment paddings")
    offset, avail = 0, sum(p.numel() for p in partitions)
    dtype = _out_dtype(partitions[0].dtype)
    for j, (name, shape) in enumerate(shapes.items()):
        numel = _numel(shape)
        if offset + numel > avail:
            raise DeepSpeedZeroError(f"{where}: parameter {name!r} reaches element {offset + numel} of param group {i}, "
                                     f"whose fp32 partitions hold {avail}: a rank's file is missing or from another save")
        out[name] = Spec(tuple(int(n) for n in shape), dtype, _slices(partitions, offset, numel))
        offset += numel + (group_paddings[j] if group_paddings is not None else 0)
    align = 2 * world
    if math.ceil(offset / align) * align != math.ceil(avail / align) * align:
        raise DeepSpeedZeroError(f"{where}: param group {i}'s parameters use {offset} elements of the {avail} its fp32 "
                                 "partitions hold: the files don't belong together (zero_to_fp32.py fails the same way)")


def _zero3(out: OrderedDict, shapes: Mapping, flat: list[list[Any]], world: int, where: str) -> None:
    avail = sum(t.numel() for t in flat[0]) * world
    offset = 0
    for name, shape in shapes.items():
        numel = _numel(shape)
        part = math.ceil(numel / world)
        pieces = [p for groups in flat for p in _slices(groups, offset, part)]
        if sum(n for _t, _s, n in pieces) < numel:
            raise DeepSpeedZeroError(f"{where}: parameter {name!r} runs past the end of the ranks' fp32_flat_groups: "
                                     "a rank's file is missing or from another save")
        out[name] = Spec(tuple(int(n) for n in shape), _out_dtype(flat[0][0].dtype), _trim(pieces, numel))
        offset += part
    if offset * world != avail:
        raise DeepSpeedZeroError(f"{where}: the parameters use {offset * world} elements of the {avail} the ranks' "
                                 "fp32_flat_groups hold: the files don't belong together (zero_to_fp32.py fails the same way)")
