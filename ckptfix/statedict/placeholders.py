"""Inert placeholders around the state dict: allowed beside it, refused inside it unless named by ``allow``.

A checkpoint read without ``trust`` gives every global outside the allow-list as an inert placeholder
(:mod:`ckptfix.parse.inert`: named, never imported or called). Beside the state dict (a project's
``RunConfig``, an enum in the hyper-parameters) a placeholder is data the caller may look at, and the
report names it; inside the selected state dict it is refused as before, unless ``allow`` names its
global (``--allow myproj.config.RunConfig``). OmegaConf's configs become plain data first
(:func:`ckptfix.safety.configs.plain_configs`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from ..core.units import SHOWN_ITEMS, few, shown
from ..errors import SelectError, UnsafeCheckpointError, trust_advice
from ..parse import inert
from ..parse.sniff import sniff
from ..safety.configs import plain_configs
from ..safety.scanner import ensure_safe


def take_configs(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with OmegaConf configs as plain data (a dict checkpoint: entry by entry, in place), and a note
    per entry that held one."""
    if not inert.any_made():
        return obj, []
    if type(obj) is not dict:
        plain, found = plain_configs(obj)
        return plain, [f"an OmegaConf {few(found, SHOWN_ITEMS)} read as plain data (keys and values; omegaconf not "
                       "imported)"] if found else []
    notes = []
    for key, value in obj.items():
        plain, found = plain_configs(value)
        if found:
            obj[key] = plain
            notes.append(f"{shown(key)}: an OmegaConf {' and '.join(n.rpartition('.')[2] for n in found)} read as plain "
                         "data (keys and values; omegaconf not imported, interpolations left as written)")
    return obj, notes


def select(obj: Any, find: Callable[[Any], Any], allow: Iterable[str], source: str) -> tuple[Any, list[str]]:
    """``find(obj)`` (the state dict's selection), refused where a placeholder sits inside the selected state
    dict (unless ``allow`` names its global) or where no state dict is found outside them; with notes naming
    the placeholders beside it."""
    allowed = frozenset(allow)
    try:
        sel = find(obj)
    except SelectError as e:
        around = inert.find(obj)
        if not around:
            raise
        if any(n.startswith("torch.nn.modules.") for n in inert.names(around)) and os.path.isfile(source):
            ensure_safe(source, sniff(source))  # a whole pickled model: the scanner's short refusal names it
        refusal = _refusal(source, inert.names(around), f"no state dict outside them ({e})")
        refusal.candidates = e.candidates  # (still a choice between them, by another rule)
        raise refusal from None
    inside = [(where, name) for where, name in inert.find(sel.state_dict) if name not in allowed]
    if inside:
        where = f" (at {shown(repr(inside[0][0]))})" if inside[0][0] else ""
        names = inert.names(inside)
        flags, library = few([f"--allow {n}" for n in names], SHOWN_ITEMS, " "), shown(repr(tuple(names)), 1000)
        raise _refusal(source, names, f"the selected state dict holds them{where}; to take them as inert data "
                       f"there, pass {flags} (library: allow={library})")
    notes = []
    beside = inert.find(sel.extra) if sel.key is not None else []
    by_entry: dict[str, list[str]] = {}
    for where, name in beside:
        by_entry.setdefault(where.split(".")[0] or "?", []).append(name)
    for entry, found in by_entry.items():
        notes.append(f"{shown(entry)}: inert {few(sorted(set(found)), SHOWN_ITEMS)} (not imported, never called; "
                     "outside the state dict)")
    allowed_inside = inert.names(inert.find(sel.state_dict)) if allowed else []
    if allowed_inside:
        notes.append(f"state dict: inert {few(allowed_inside, SHOWN_ITEMS)} (allowed: read as data, not imported)")
    return sel, notes


def _refusal(source: str, names: list[str], why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source}: refused: it references globals outside the safe allow-list: {few(names, SHOWN_ITEMS)}; read as inert "
        f"placeholders (never imported), {why}. {trust_advice()}; `ckptfix scan {source}` lists everything it "
        "references.", names)
