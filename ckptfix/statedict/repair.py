"""Target-guided repair: adapt a state dict's keys to a model's own, shared by verify and load_into.

Only the fixes ckptfix knows are tried: wrapper segments removed or added to match the model's
wrapping, and a leading attribute prefix a training framework adds (Lightning's ``model.``)
removed — or the model's own prefix added. The candidate with the most keys matching in name
and shape wins; ties keep the simpler one. Other renames (``layer4.`` → ``stage4.``) are never
applied, only suggested (:func:`suggest_renames`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from dataclasses import dataclass, field
from typing import Any

from . import wrappers
from ..core import tensorcopy
from ..core.units import SHOWN_ITEMS, dtype_name, few, shown
from ..errors import LoadError

_MAX_PREFIX_DEPTH = 3


@dataclass
class Target:
    """What a model expects: shape/dtype per key (``None`` for non-tensors), tied keys, module paths."""

    shapes: dict[str, tuple[int, ...] | None]
    dtypes: dict[str, str | None]
    tied: list[list[str]]
    module_names: list[str]
    wrappers: list[str]


def describe_target(model: Any, float_dtype: Any = None, state_dict: Any = None,
                    module_names: list[str] | None = None) -> Target:
    """Read a model's expectations from ``state_dict(keep_vars=True)`` (``state_dict``, ``module_names``: those
    and ``named_modules()``'s names, when the caller has them already); tied keys share one object.

    ``float_dtype`` (a torch dtype): the model as it will run after ``.to(float_dtype)``, every
    floating entry that dtype (integer and bool buffers keep theirs).
    """
    import torch

    sd = model.state_dict(keep_vars=True) if state_dict is None else state_dict
    groups: dict[int, list[str]] = {}
    shapes: dict[str, tuple[int, ...] | None] = {}
    dtypes: dict[str, str | None] = {}
    for key, value in sd.items():
        is_t = isinstance(value, torch.Tensor)
        if is_t and value.is_nested:
            raise LoadError(f"{shown(key)}: the model's tensor is a nested tensor, which has no one shape to fill; "
                            "nothing was loaded (torch's load_state_dict fails on it too). Set it yourself, e.g. "
                            f"model.{shown(key)} = ckptfix.load(PATH)[{shown(key)!r}]")
        shapes[key] = tuple(value.shape) if is_t else None
        dtypes[key] = dtype_name(value.dtype) if is_t else None
        if is_t and float_dtype is not None and value.is_floating_point():
            dtypes[key] = dtype_name(float_dtype)
        if is_t:
            groups.setdefault(id(value), []).append(key)
    return Target(
        shapes=shapes,
        dtypes=dtypes,
        tied=[keys for keys in groups.values() if len(keys) > 1],
        module_names=[name for name, _ in model.named_modules()] if module_names is None else module_names,
        wrappers=wrappers.detect_wrappers(sd.keys()),
    )



def shape_of(value: Any) -> tuple[int, ...] | None:
    """A tensor's shape as a tuple; ``None`` for anything that isn't a tensor."""
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None and hasattr(value, "dtype") else None


@dataclass
class Repair:
    """One key adaptation: strip/add a prefix on the single form, then match the model's wrappers."""

    strip_prefix: str | None = None
    add_prefix: str | None = None
    fn: Callable[[str], str] = field(default=lambda k: k, repr=False)
    changed: int = 0
    matched: int = 0
    shape_ok: int = 0
    total: int = 0
    description: str | None = None

    @property
    def summary(self) -> str:
        """``'strip module.: 102/102 keys match'``, or ``'as saved: 102/102 keys match'``."""
        return f"{self.description or 'as saved'}: {self.matched}/{self.total} keys match"


def _prefix_fn(strip: str | None, add: str | None) -> Callable[[str], str]:
    def fn(single: str) -> str:
        if strip is not None and single.startswith(strip + "."):
            single = single[len(strip) + 1:]
        return f"{add}.{single}" if add is not None else single

    return fn


def _common_prefixes(keys: list[str]) -> list[str]:
    """Leading module paths (up to 3 segments) that at least half of ``keys`` share, shortest first."""
    counts: dict[str, int] = {}
    for key in keys:
        segs = key.split(".")[:-1]
        for depth in range(1, min(len(segs), _MAX_PREFIX_DEPTH) + 1):
            p = ".".join(segs[:depth])
            counts[p] = counts.get(p, 0) + 1
    need = max(1, (len(keys) + 1) // 2)
    return sorted((p for p, n in counts.items() if n >= need), key=lambda p: (p.count("."), p))


def _candidates(keys: list[str], target_keys: list[str]) -> list[tuple[str | None, str | None]]:
    singles = [wrappers.strip_wrappers(k) for k in keys]
    target_singles = [wrappers.strip_wrappers(k) for k in target_keys]
    strips: list[str | None] = [None, *_common_prefixes(singles)]
    adds: list[str | None] = [None, *_common_prefixes(target_singles)]
    pairs = [(s, a) for s in strips for a in adds if s is None or s != a]
    return sorted(pairs, key=lambda p: (p[0] is not None) + (p[1] is not None))


def _score(state_dict: Mapping[str, Any], target: Target, strip: str | None, add: str | None,
           to_model: Callable[[str], str]) -> Repair | None:
    prefix = _prefix_fn(strip, add)

    def fn(key: str) -> str:
        return to_model(prefix(wrappers.strip_wrappers(key)))

    seen: set[str] = set()
    repair = Repair(strip, add, fn, total=len(target.shapes))
    for key, value in state_dict.items():
        new = fn(key)
        if new in seen:
            return None  # two keys would collide: not a valid candidate
        seen.add(new)
        repair.changed += new != key
        if new in target.shapes:
            repair.matched += 1
            repair.shape_ok += shape_of(value) == target.shapes[new]
    return repair


def find_repair(state_dict: Mapping[str, Any], target: Target, source: str = "checkpoint") -> Repair:
    """The candidate that maximises (keys matching in shape, keys matching); simplest on ties."""
    keys = list(state_dict.keys())
    wrappers.check_no_flat_params(keys, source)
    if len(keys) == len(target.shapes) and all(k in target.shapes and shape_of(v) == target.shapes[k]
                                               for k, v in state_dict.items()):
        n = len(keys)  # every key already the model's, every shape equal: nothing to search (a server's every start)
        return Repair(matched=n, shape_ok=n, total=n)
    to_model = wrappers.match_to_target((), target.shapes.keys())
    best: Repair | None = None
    for strip, add in _candidates(keys, list(target.shapes)):
        r = _score(state_dict, target, strip, add, to_model)
        if r is not None and (best is None or (r.shape_ok, r.matched) > (best.shape_ok, best.matched)):
            best = r
        if best is not None and best.shape_ok == len(keys) == best.total:
            break
    if best is None:  # every candidate collides; leave the keys as they are
        best = Repair(total=len(target.shapes))
        best.matched = sum(k in target.shapes for k in keys)
        best.shape_ok = sum(shape_of(state_dict[k]) == target.shapes.get(k) for k in keys if k in target.shapes)
    if best.changed:
        best.description = _describe(keys, target, best)
    return best


def _dots(stack: Iterable[str]) -> str:
    return ".".join(stack) + "."


def _describe(keys: list[str], target: Target, r: Repair) -> str:
    parts = []
    have = wrappers.detect_wrappers(keys)
    if have != target.wrappers:
        if not target.wrappers:
            parts.append(f"strip {_dots(have)}")
        elif not have:
            parts.append(f"add {_dots(target.wrappers)}")
        else:
            parts.append(f"replace {_dots(have)} with {_dots(target.wrappers)}")
    inner_have = wrappers.inner_wrappers(keys)
    inner_want = wrappers.inner_wrappers(target.shapes)
    if inner_have != inner_want:
        parts.append(f"inner wrappers {', '.join(inner_have) or 'none'} -> {', '.join(inner_want) or 'none'}")
    if r.strip_prefix:
        parts.append(f"strip prefix {r.strip_prefix}.")
    if r.add_prefix:
        parts.append(f"add prefix {r.add_prefix}.")
    return ", ".join(parts) or "adapt wrapper segments"


@dataclass
class Fit:
    """A state dict after repair, against a model: what is missing, extra, or doesn't agree."""

    state_dict: Any
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatch: list[dict[str, Any]] = field(default_factory=list)
    dtype_mismatch: list[dict[str, Any]] = field(default_factory=list)
    non_tensor: list[str] = field(default_factory=list)
    tolerated: list[dict[str, str]] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        """Would ``load_state_dict(strict=True)`` take it (dtype differences are cast)?"""
        return not (self.missing or self.unexpected or self.shape_mismatch or self.non_tensor)


def apply_repair(state_dict: Mapping[str, Any], repair: Repair, target: Target, source: str = "checkpoint") -> Any:
    """Rename with ``repair``; ``_metadata`` module paths go to the model's own module names."""
    out = wrappers.rename_state_dict(state_dict, repair.fn, source=source)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        prefix = _prefix_fn(repair.strip_prefix, repair.add_prefix)
        # The deepest module of each single-form path: a wrapper's inner module, not the wrapper.
        modules = {wrappers.strip_wrappers(n): n for n in target.module_names}

        def path_fn(probe: str) -> str:
            single = prefix(wrappers.strip_wrappers(probe))[:-1].rstrip(".")  # probe ends in "x"
            name = modules.get(single, single)
            return f"{name}.x" if name else "x"

        out._metadata = wrappers.rename_metadata(meta, path_fn)  # type: ignore[attr-defined]  # torch's own attribute
    return out


def check_fit(state_dict: Any, target: Target, fill: bool = True) -> Fit:
    """Compare a (repaired) state dict with the model; ``fill`` supplies tolerated missing keys.

    Tolerated: ``num_batches_tracked`` (absent from pre-0.4 BatchNorm checkpoints; filled with 0,
    as BatchNorm itself does for old checkpoints) and a tied parameter whose twin is present.
    """
    import torch

    fit = Fit(state_dict)
    for key in target.shapes:
        if key in state_dict:
            continue
        twin = next((k for group in target.tied if key in group for k in group if k in state_dict), None)
        parent, _, leaf = key.rpartition(".")
        if twin is not None:
            fit.tolerated.append({"key": key, "kind": "tied", "reason": f"tied to {twin}, which is present"})
            if fill:
                state_dict[key] = state_dict[twin]
        elif leaf == "num_batches_tracked" and (parent + ".running_mean" if parent else "running_mean") in state_dict:
            fit.tolerated.append({"key": key, "kind": "num_batches_tracked",
                                  "reason": "missing num_batches_tracked (old BatchNorm checkpoint); set to 0"})
            if fill:
                device = next((v.device for v in state_dict.values() if isinstance(v, torch.Tensor)), "cpu")
                state_dict[key] = torch.tensor(0, dtype=torch.long, device=device)
        else:
            fit.missing.append(key)
    for key, value in state_dict.items():
        if key not in target.shapes:
            fit.unexpected.append(key)
            continue
        want = target.shapes[key]
        if want is None:
            continue  # the model keeps a non-tensor here (_extra_state)
        have = shape_of(value)
        if have is None:
            fit.non_tensor.append(key)
        elif have != want:
            fit.shape_mismatch.append({"key": key, "checkpoint": list(have), "model": list(want)})
        elif dtype_name(value.dtype) != target.dtypes[key]:
            fit.dtype_mismatch.append({"key": key, "checkpoint": dtype_name(value.dtype), "model": target.dtypes[key]})
    return fit


def fit_to_model(state_dict: Mapping[str, Any], target: Target, source: str = "checkpoint") -> tuple[Repair, Fit]:
    """Search the repair, apply it and compare: the one call verify and load_into share."""
    repair = find_repair(state_dict, target, source)
    repaired = apply_repair(state_dict, repair, target, source)
    return repair, check_fit(repaired, target)


def nonfinite_keys(state_dict: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """Those of ``keys`` whose floating or complex tensor holds a NaN or an Inf (tensors on meta: not checked)."""
    import torch

    return [k for k in keys if isinstance(t := state_dict.get(k), torch.Tensor) and t.device.type != "meta"
            and not tensorcopy.all_finite(t)]


def torch_fills_num_batches_tracked(key: str, state_dict: Any) -> bool:
    """BatchNorm adds a missing ``num_batches_tracked`` itself when the saved module version is < 2."""
    meta = getattr(state_dict, "_metadata", None) or {}
    version = meta.get(key.rpartition(".")[0], {}).get("version")
    return key.rsplit(".", 1)[-1] == "num_batches_tracked" and (version is None or version < 2)


def suggest_renames(unexpected: Mapping[str, Any], missing: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Prefix renames (``layer4.`` → ``stage4.``) that would turn unexpected keys into missing ones, each
    ``{"rename": {"from": "layer4.", "to": "stage4."}, "keys": N}`` (the convert line that applies it: ``model/fixes``).

    ``unexpected``/``missing`` map key → shape. A rule is offered only when every unexpected key
    under its prefix lands on a missing key of the same shape. Nothing is applied.
    """
    by_suffix: dict[str, list[str]] = {}
    for m in missing:
        segs = m.split(".")
        for d in range(1, len(segs)):
            by_suffix.setdefault(".".join(segs[d:]), []).append(".".join(segs[:d]))
    out: list[dict[str, Any]] = []
    covered: set[str] = set()
    landed: set[str] = set()  # missing keys a rule already reaches
    tried: set[str] = set()
    for u in unexpected:
        segs = u.split(".")
        for d in range(1, len(segs)):
            old = ".".join(segs[:d])
            if old in tried or u in covered:
                continue
            tried.add(old)
            for new in by_suffix.get(".".join(segs[d:]), [])[:20]:
                rule = _check_rule(old, new, unexpected, missing)
                if rule and not rule.keys() & covered and not set(rule.values()) & landed:
                    covered.update(rule)
                    landed.update(rule.values())
                    out.append({"rename": {"from": old + ".", "to": new + "."}, "keys": len(rule)})
                    break
    return out


def by_order_fits(state_dict: Mapping[str, Any], target: Target) -> bool:
    """Would ``convert --by-order`` take it: as many tensors as the model, shapes equal in order."""
    have = [s for s in map(shape_of, state_dict.values()) if s is not None]
    want = [s for s in target.shapes.values() if s is not None]
    return have == want


def _check_rule(old: str, new: str, unexpected: Mapping[str, Any], missing: Mapping[str, Any]) -> dict[str, str]:
    """``{unexpected key: missing key}`` if renaming ``old.`` to ``new.`` fits every key under it."""
    if old == new:
        return {}
    rule = {k: new + k[len(old):] for k in unexpected if k.startswith(old + ".")}
    ok = all(m in missing and missing[m] == unexpected[k] for k, m in rule.items())
    return rule if ok else {}


def group_keys(keys: Iterable[str], limit: int = 12) -> list[str]:
    """Keys grouped by parent module: ``['layer1.2.bn1.{weight, bias}', …]``, at most ``limit`` lines, each
    name :func:`~ckptfix.core.units.shown` (a key from a file can be anything)."""
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    lines = [(f"{shown(p)}." if p else "") + (shown(leaves[0]) if len(leaves) == 1 else "{" + few(leaves, SHOWN_ITEMS) + "}")
             for p, leaves in islice(groups.items(), limit)]
    return lines + [f"… and {len(groups) - limit} more groups"] if len(groups) > limit else lines


def fit_report(path: str, fit: Fit, chosen: Repair) -> str:
    """One paragraph: what is missing / unexpected / mismatched after the repair, and the likely cause."""
    parts = [f"{path}: does not load into the model"]
    if chosen.description:
        parts.append(f"after the repair ({chosen.summary})")
    if fit.missing:
        parts.append(f"{len(fit.missing)} missing: {few(fit.missing)}")
    if fit.unexpected:
        parts.append(f"{len(fit.unexpected)} unexpected: {few(fit.unexpected)}")
    if fit.shape_mismatch:
        parts.append(
            f"{len(fit.shape_mismatch)} shape mismatch: "
            + ", ".join(f"{r['key']} {r['checkpoint']} vs model {r['model']}" for r in fit.shape_mismatch[:5])
        )
    if fit.non_tensor:
        parts.append(f"{len(fit.non_tensor)} not tensors: {few(fit.non_tensor)}")
    if fit.missing and fit.unexpected:
        parts.append("the names differ: a renamed layer, or a different architecture (`ckptfix verify` suggests renames)")
    elif fit.missing or fit.shape_mismatch:
        parts.append("likely a different architecture or configuration (e.g. num_classes)")
    return "; ".join(parts)

