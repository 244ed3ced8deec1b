"""A state dict's quantized groups, found from key names, dtypes and shapes by the schemes table, and their checks.

:func:`find_groups` needs only each key's dtype and shape (``inspect`` answers without torch); :func:`check_values`
reads the companions' values (scales finite and positive, no NaN E8M0 byte) and imports torch when called.

>>> layout = find_groups({"fc.weight": ("float8_e4m3fn", (256, 256)),
...                       "fc.weight_scale_inv": ("float32", (2, 2))}, None)
>>> [(g.scheme, g.module, g.companions) for g in layout.groups], layout.problems
([('fp8-block', 'fc', {'scale': 'fc.weight_scale_inv'})], [])
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

from ..core.tensorinfo import is_tensor, layout_name, shape_and_dtype
from .quant_schemes import (ACTIVATION_SCALES, BY_NAME, COMPANION_SUFFIXES, QUANT_ONLY_SUFFIXES, QUANT_STORAGE,
                            SCALED_ONLY, SCHEMES, STANDALONE_SCALES, Scheme, Shape, quant_config)

if TYPE_CHECKING:
    import torch

Infos = Mapping[str, "tuple[str, Shape]"]


@dataclass(frozen=True)
class QuantProblem:
    """What is wrong with a module's quantized tensors. ``kind``: ``orphan`` (a scale without its weight),
    ``missing`` (a weight without its scales), ``shape`` (a wrong grid or packed byte count), ``ambiguous``,
    ``value`` (a scale not finite or not positive, a 0xFF E8M0 byte)."""

    module: str
    key: str
    message: str
    kind: str = "shape"


@dataclass(frozen=True)
class QuantGroup:
    """One quantized weight and its companions (role → key), with the parameters its shapes and config gave
    (block size, bits, group size); ``also``: look-alike schemes with the same values (no config decided)."""

    scheme: str
    module: str
    weight: str
    companions: dict[str, str]
    params: dict[str, Any] = field(default_factory=dict)
    also: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.weight, *self.companions.values())

    @property
    def rtn(self) -> bool:
        return BY_NAME[self.scheme].rtn

    @property
    def dequantized_key(self) -> str:
        """The key the dequantized weight goes under (``…q_proj.weight``; gpt-oss: ``…experts.gate_up_proj``)."""
        return self.module + BY_NAME[self.scheme].dequantized_suffix


@dataclass(frozen=True)
class QuantLayout:
    """Every quantized group of a state dict, what is wrong with them, the keys in no group, and the tensors that
    look quantized (float8 or packed integers beside a ``*scale*`` key) but match no scheme."""

    groups: list[QuantGroup]
    problems: list[QuantProblem]
    plain: frozenset[str]
    unknown: list[str]

    def counts(self) -> dict[str, int]:
        """Groups per scheme, in the table's order."""
        names = [g.scheme for g in self.groups]
        return {s.name: names.count(s.name) for s in SCHEMES if s.name in names}


def infos_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[str, Shape]]:
    """Each strided tensor's dtype name and shape, from real tensors, meta tensors or TensorInfo alike (no torch
    import); sparse and nested tensors are no quantized group's."""
    out: dict[str, tuple[str, Shape]] = {}
    for key, value in state_dict.items():
        if is_tensor(value) and layout_name(value) is None:
            shape, dtype = shape_and_dtype(value)
            if None not in shape:
                out[key] = (dtype, tuple(int(d) for d in shape if d is not None))
    return out


_WEIGHT_SUFFIXES = tuple({s.weight_suffix for s in SCHEMES})


def _candidates(key: str, dtype: str, infos: Infos) -> list[tuple[Scheme, str, dict[str, str], list[str]]]:
    """Rows whose weight suffix and dtype fit ``key``: (row, module, companions present, required ones missing)."""
    out = []
    for scheme in SCHEMES:
        if not key.endswith(scheme.weight_suffix) or dtype not in scheme.weight_dtypes:
            continue
        module = key[:-len(scheme.weight_suffix)]
        present = {c.role: module + c.suffix for c in scheme.companions
                   if module + c.suffix in infos and infos[module + c.suffix][0] in c.dtypes}
        missing = [module + c.suffix for c in scheme.companions if c.required and c.role not in present]
        out.append((scheme, module, present, missing))
    return out


def _pick(key: str, fits: list[tuple[Scheme, str, dict[str, str], list[str]]], infos: Infos, qc: Mapping[str, Any],
          problems: list[QuantProblem]) -> QuantGroup:
    """The group of ``key`` among complete rows: the config's rows first, then the rows whose shapes fit."""
    chosen = [f for f in fits if f[0].selected_by(qc)] or fits
    judged = []
    for scheme, module, present, _missing in chosen:
        shapes = {"weight": infos[key][1], **{role: infos[k][1] for role, k in present.items()}}
        params, shape_problems = scheme.shapes(shapes, qc)
        judged.append((scheme, module, present, params, shape_problems))
    good = [j for j in judged if not j[4]] or judged[:1]
    scheme, module, present, params, shape_problems = good[0]
    problems.extend(QuantProblem(module, key, f"{scheme.name}: {m}", "shape") for m in shape_problems)
    differ = [j[0].name for j in good[1:] if j[0].dequant != scheme.dequant]
    if differ:  # look-alikes with other values, no config to decide: the default (if any) is named, never silently
        scheme, module, present, params, _ = next((j for j in good if j[0].default), good[0])
        names = ", ".join(j[0].name for j in good)
        problems.append(QuantProblem(module, key, f"scheme ambiguous: {names} fit and no quantization config says "
                                                  f"which (taken as {scheme.name})", "ambiguous"))
    also = tuple(j[0].name for j in good if j[0].dequant == scheme.dequant and j[0].name != scheme.name)
    return QuantGroup(scheme.name, module, key, present, params, also)


def find_groups(infos: Infos, config: Mapping[str, Any] | None) -> QuantLayout:
    """Group ``infos`` (key → (dtype name, shape)) by the schemes table; ``config`` is config.json, hf_quant_config.json
    or a quantization config, and decides between look-alikes (GPTQ v1/v2, compressed-tensors/modelopt)."""
    qc = quant_config(config)
    groups: list[QuantGroup] = []
    problems: list[QuantProblem] = []
    claimed: set[str] = set()
    unmatched = []
    for key, (dtype, _shape) in infos.items():
        candidates = _candidates(key, dtype, infos) if key.endswith(_WEIGHT_SUFFIXES) else []
        fits = [c for c in candidates if not c[3]]
        if fits:
            group = _pick(key, fits, infos, qc, problems)
            groups.append(group)
            claimed.update(group.keys)
        else:
            unmatched.append((key, dtype, candidates))
    scaled = _scaled_modules(infos)  # (a float8 tensor beside a scale no row knows is "unknown", below)
    for key, dtype, candidates in unmatched:  # (after every group has claimed its companions)
        partial = [c for c in candidates if any(k not in claimed and not k.endswith(ACTIVATION_SCALES)
                                                for k in c[2].values())]
        if key in claimed:
            continue
        if not partial and key.endswith(QUANT_ONLY_SUFFIXES):
            partial = candidates
        if partial:
            scheme, module, present, missing = max(partial, key=lambda c: len(c[2]))
            lacks = ", ".join(k[len(module):] for k in missing)
            problems.append(QuantProblem(module, key, f"{scheme.name} weight {key[len(module):]} without its {lacks}",
                                         "missing"))
            claimed.update({key, *present.values()})
        elif dtype in SCALED_ONLY and not key.endswith(COMPANION_SUFFIXES) and _parent(key) not in scaled:
            problems.append(QuantProblem(_parent(key), key, f"{dtype} weight with no scale beside it: its raw "
                                                            "values are not the weights", "missing"))
            claimed.add(key)
    problems.extend(_orphans(infos, claimed))
    claimed.update(p.key for p in problems)
    unknown = _unknown(infos, claimed, scaled)
    return QuantLayout(groups, problems, frozenset(infos) - claimed - set(unknown), unknown)


def _orphans(infos: Infos, claimed: set[str]) -> list[QuantProblem]:
    out = []
    for key in infos:
        if key in claimed or not key.endswith(COMPANION_SUFFIXES):
            continue
        suffix = next(s for s in COMPANION_SUFFIXES if key.endswith(s))
        out.append(QuantProblem(key[:-len(suffix)], key, f"orphan scale: {suffix} with no quantized weight beside it",
                                "orphan"))
    return out


def _parent(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def _unknown(infos: Infos, claimed: set[str], scaled: set[str]) -> list[str]:
    """Unclaimed float8/packed-integer tensors in a module that holds a ``*scale*`` key (not a KV-cache scale)."""
    return [k for k, (dtype, _s) in infos.items()
            if k not in claimed and dtype in QUANT_STORAGE and _parent(k) in scaled and not _is_scale(k)]


def _scaled_modules(infos: Infos) -> set[str]:
    """Modules holding a key named like a weight's scale (not an activation or KV-cache scale)."""
    return {_parent(k) for k in infos if _is_scale(k) and not k.endswith(STANDALONE_SCALES + ACTIVATION_SCALES)}


def _is_scale(key: str) -> bool:
    return "scale" in key.rsplit(".", 1)[-1].lower()


#: the roles holding scales: finite, and positive (``absmax`` may be 0: an all-zero block)
_SCALE_ROLES = {"scale": 0, "global_scale": 0, "input_scale": 0, "input_global_scale": 0, "absmax": 1,
                "nested_absmax": 1}


def check_values(group: QuantGroup, tensors: Mapping[str, torch.Tensor]) -> list[QuantProblem]:
    """The group's companions' values: scales finite and positive where the scheme multiplies or divides by them,
    no 0xFF (NaN) E8M0 exponent, GPTQ's ``g_idx`` inside its groups."""
    import torch

    out = []
    for role, key in group.companions.items():
        if role not in _SCALE_ROLES or key not in tensors:
            continue
        t = tensors[key]
        if group.scheme == "mxfp4" or t.dtype == torch.float8_e8m0fnu:
            bad = int((t.view(torch.uint8) == 0xFF).sum())
            if bad:
                out.append(QuantProblem(group.module, key, f"{bad} E8M0 scale byte(s) are 0xFF (NaN)", "value"))
            continue
        if group.scheme.startswith("bnb") and t.dtype == torch.uint8:
            continue  # a nested absmax: codes, checked through its own absmax
        v = t.float()
        nonfinite, low = int((~torch.isfinite(v)).sum()), int((v < 0).sum() if _SCALE_ROLES[role] else (v <= 0).sum())
        if nonfinite or low:
            what = "negative" if _SCALE_ROLES[role] else "zero or negative"
            out.append(QuantProblem(group.module, key, f"{role}: {nonfinite} value(s) not finite, {low} {what}",
                                    "value"))
    out += [QuantProblem(group.module, group.weight, m, "shape") for m in _packed_problems(group, tensors)]
    g_idx = group.companions.get("g_idx", "")
    if g_idx in tensors and group.companions.get("scale", "") in tensors:
        n = tensors[group.companions["scale"]].shape[0]
        idx = tensors[g_idx]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            out.append(QuantProblem(group.module, g_idx, f"g_idx points outside the {n} groups", "value"))
    return out


def bnb_state(group: QuantGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The quant state bitsandbytes packs as JSON bytes in ``quant_state.bitsandbytes__nf4|fp4`` (``{}``: unreadable)."""
    raw = bytes(tensors[group.companions["quant_state"]].reshape(-1).tolist())
    try:
        state = json.loads(raw.decode("utf-8"))
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


def _packed_problems(group: QuantGroup, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Packed byte counts against the true shape the file records (compressed-tensors' ``weight_shape``,
    bitsandbytes' quant state), which no key's shape tells."""
    weight = tensors.get(group.weight)
    if weight is None:
        return []
    if group.scheme == "ct-int-packed" and group.companions.get("shape") in tensors:
        dims = [int(v) for v in tensors[group.companions["shape"]].reshape(-1).tolist()]
        per_word = 32 // int(group.params.get("bits", 4))
        if len(dims) != 2 or dims[0] != weight.shape[0] or -(-dims[1] // per_word) != weight.shape[-1]:
            return [f"weight_shape {dims} does not fit the packed weight {list(weight.shape)} "
                    f"({per_word} values an int32)"]
    if group.scheme.startswith("bnb-") and group.companions.get("quant_state") in tensors:
        state = bnb_state(group, tensors)
        if not isinstance(state.get("shape"), list) or not isinstance(state.get("blocksize"), int):
            return ["quant_state is not bitsandbytes' JSON (shape, blocksize)"]
        n = prod(int(d) for d in state["shape"])
        absmax = tensors[group.companions["absmax"]].numel() if group.companions.get("absmax") in tensors else None
        if weight.numel() != -(-n // 2) or (absmax is not None and absmax != -(-n // state["blocksize"])):
            return [f"{weight.numel()} bytes and {absmax} absmax blocks do not hold {state['shape']} "
                    f"in blocks of {state['blocksize']}"]
    return []
