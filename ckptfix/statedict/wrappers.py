"""Wrapper segments in state-dict keys: detect them, strip them, add them — by whole segments only.

Wrappers add whole dotted segments to every key below them: ``module`` (DataParallel, DDP),
``_orig_mod`` (torch.compile), ``_fsdp_wrapped_module`` (FSDP1), ``_checkpoint_wrapped_module``
(activation checkpointing), ``_forward_module`` (Lightning strategies). They stack in any order
and can stand mid-key when only a submodule was wrapped (``encoder._orig_mod.0.weight``).

This module knows key strings, not files or tensors: ``rename_state_dict`` applies a key
function to a state dict, keeps ``_metadata`` in step and refuses collisions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import NOTHING_WRITTEN, KeyCollisionError, WrapperError

WRAPPER_SEGMENTS: tuple[str, ...] = (
    "module",
    "_orig_mod",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_forward_module",
)

#: ``to=`` targets and the wrapper segments each puts in front of the single form.
TARGETS: dict[str, tuple[str, ...] | None] = {
    "single": (),
    "ddp": ("module",),
    "dp": ("module",),
    "compile": ("_orig_mod",),
    "keep": None,
}

_FLAT_PARAM_SEGMENTS = ("_flat_param", "flat_param")


def _segments(key: str) -> list[str]:
    return key.split(".") if key else []


def strip_wrappers(key: str) -> str:
    """Remove every wrapper segment wherever it stands.

    >>> strip_wrappers("module._orig_mod.submodule.weight")
    'submodule.weight'
    >>> strip_wrappers("module_list.0.weight")
    'module_list.0.weight'
    """
    return ".".join(s for s in _segments(key) if s not in WRAPPER_SEGMENTS)


def leading_wrappers(key: str) -> tuple[str, ...]:
    """The run of wrapper segments at the start of ``key`` (``('module', '_orig_mod')``)."""
    out = []
    for seg in _segments(key):
        if seg not in WRAPPER_SEGMENTS:
            break
        out.append(seg)
    return tuple(out)


def detect_wrappers(keys: Iterable[str]) -> list[str]:
    """The wrapper stack shared by all keys, outermost first (``['module', '_orig_mod']``).

    Segments only some keys carry (a wrapped submodule) are not part of the stack; see
    :func:`inner_wrappers` for those.
    """
    common: tuple[str, ...] | None = None
    for key in keys:
        lead = leading_wrappers(key)
        if common is None:
            common = lead
        else:
            n = 0
            while n < min(len(common), len(lead)) and common[n] == lead[n]:
                n += 1
            common = common[:n]
        if not common:
            return []
    return list(common or ())


def inner_wrappers(keys: Iterable[str]) -> list[str]:
    """Module paths of wrappers that stand mid-key, e.g. ``['encoder._orig_mod']``, sorted."""
    found: set[str] = set()
    for key in keys:
        segs = _segments(key)
        lead = len(leading_wrappers(key))
        for i in range(lead, len(segs) - 1):
            if segs[i] in WRAPPER_SEGMENTS:
                found.add(".".join(segs[: i + 1]))
    return sorted(found)


def check_no_flat_params(keys: Iterable[str], source: str = "checkpoint") -> None:
    """Refuse FSDP1 flat parameters: one flat buffer per wrapped unit can't be renamed into shape."""
    flat = [k for k in keys if any(s in _FLAT_PARAM_SEGMENTS for s in _segments(k))]
    if flat:
        raise WrapperError(
            f"{source}: holds FSDP1 flat parameters ({flat[0]!r}"
            + (f" and {len(flat) - 1} more" if len(flat) > 1 else "")
            + "): each is all of a wrapped unit's weights in one flat buffer and can't be renamed "
            "into the model's shapes. Save a full state dict instead: inside "
            "`with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):` call "
            "model.state_dict(), or use torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))."
        )


def _normalise_prefix(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    p = prefix.strip().strip(".")
    if not p or any(not s for s in p.split(".")):
        raise WrapperError(f"prefix {prefix!r} is not a dotted module path like 'backbone.' or 'model.encoder.'")
    return p


def remove_prefix(key: str, prefix: str) -> str:
    """Remove ``prefix`` (whole segments) where it stands after any leading wrapper segments:
    ``remove_prefix('module.model.fc.w', 'model') == 'module.fc.w'``; keys without it are unchanged."""
    lead = leading_wrappers(key)
    rest = ".".join(_segments(key)[len(lead):])
    if rest == prefix or rest.startswith(prefix + "."):
        rest = rest[len(prefix) + 1 :]
        return ".".join((*lead, rest)) if rest else ".".join(lead)
    return key


def has_prefix(key: str, prefix: str) -> bool:
    """Whether ``remove_prefix`` would change ``key``."""
    return remove_prefix(key, prefix) != key


def key_transform(
    to: str = "single",
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
) -> Callable[[str], str]:
    """Build the key function for a ``to=`` target and optional user prefixes.

    Order: remove ``strip_prefix`` (whole segments after any leading wrappers, where present) → remove wrappers
    → add ``add_prefix`` → put the target's wrapper segments on top. With ``to='keep'`` the
    wrappers are left as they are and ``add_prefix`` goes in front.
    """
    if to not in TARGETS:
        raise WrapperError(f"unknown target {to!r}; choose one of: {', '.join(TARGETS)}")
    strip = _normalise_prefix(strip_prefix)
    add = _normalise_prefix(add_prefix)
    on_top = TARGETS[to]

    def transform(key: str) -> str:
        k = remove_prefix(key, strip) if strip is not None else key
        if on_top is not None:
            k = strip_wrappers(k)
        if add is not None:
            k = f"{add}.{k}" if k else add
        if on_top:
            k = ".".join((*on_top, k)) if k else ".".join(on_top)
        return k

    return transform


def rename_state_dict(
    state_dict: Mapping[str, Any],
    fn: Callable[[str], str],
    source: str = "checkpoint",
) -> OrderedDict:
    """Apply ``fn`` to every key; ``_metadata`` follows. Two keys meeting is a KeyCollisionError.

    Module paths in ``_metadata`` collide by design when a wrapper goes (the DDP wrapper's ``''``
    and its inner module's ``'module'`` both become ``''``): the inner module's entry wins.
    """
    out: OrderedDict = OrderedDict()
    origin: dict[str, str] = {}
    for key, value in state_dict.items():
        new = fn(key)
        if new in origin:
            raise KeyCollisionError(
                f"{source}: keys {origin[new]!r} and {key!r} would both become {new!r}; "
                f"{NOTHING_WRITTEN}. Rename one of them first (e.g. --strip-prefix / --add-prefix), "
                "or keep the wrappers with --to keep."
            )
        origin[new] = key
        out[new] = value
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = rename_metadata(meta, fn, _module_moves(origin))  # type: ignore[attr-defined]
    return out


def _module_moves(new_to_old: Mapping[str, str]) -> dict[str, str]:
    """Module-path renames implied by key renames: ``layer4.0.conv.weight → stage4.0.conv.weight``
    moves ``layer4.0.conv → stage4.0.conv``, and its parents while their tails agree."""
    moves: dict[str, str] = {}
    for new, old in new_to_old.items():
        o, n = _segments(old)[:-1], _segments(new)[:-1]
        while o and n:
            moves.setdefault(".".join(o), ".".join(n))
            if o[-1] != n[-1]:
                break
            o, n = o[:-1], n[:-1]
    return moves


def rename_metadata(meta: Mapping[str, Any], fn: Callable[[str], str], moves: Mapping[str, str] | None = None) -> OrderedDict:
    """Rename module paths in ``_metadata``; on a clash the deeper (longer) original path wins.

    A path whose keys were renamed follows them (``moves``); others go through ``fn`` as a key
    would (``path + '.x'``, the ``'.x'`` taken off again).
    """
    chosen: dict[str, tuple[int, Any]] = {}
    order: list[str] = []
    moves = moves or {}
    for path, value in meta.items():
        if path in moves:
            new = moves[path]
        else:
            probe = fn(f"{path}.x" if path else "x")
            new = probe[:-2] if probe.endswith(".x") else ""
        depth = len(_segments(path))
        if new not in chosen:
            order.append(new)
            chosen[new] = (depth, value)
        elif depth > chosen[new][0]:
            chosen[new] = (depth, value)
    # A wrapper added on top needs its own entry, as a real wrapped module's state_dict has.
    for new in list(order):
        segs = _segments(new)
        for i in range(len(segs)):
            parent = ".".join(segs[:i])
            if segs[i] in WRAPPER_SEGMENTS and parent not in chosen:
                chosen[parent] = (-1, {"version": 1})
                order.insert(0, parent)
    return OrderedDict((k, chosen[k][1]) for k in order)


def match_to_target(keys: Iterable[str], target_keys: Iterable[str]) -> Callable[[str], str]:
    """A key function that adapts wrapper segments to ``target_keys`` (a model's own keys).

    Both sides are compared in their single form, so any wrapping on either side (leading or
    mid-key, in any order) maps onto the model's own. Keys with no counterpart are left as they are.
    """
    by_single: dict[str, str] = {}
    for t in target_keys:
        by_single.setdefault(strip_wrappers(t), t)
    wrapped_on_top = tuple(detect_wrappers(by_single.values())) if by_single else ()

    def transform(key: str) -> str:
        single = strip_wrappers(key)
        if single in by_single:
            return by_single[single]
        return ".".join((*wrapped_on_top, single)) if wrapped_on_top else single

    return transform
