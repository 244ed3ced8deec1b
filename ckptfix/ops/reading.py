"""A checkpoint file read into a :class:`~ckptfix.reports.Checkpoint`: sniff → read → find the state dict.

Shared by the verbs in :mod:`ckptfix.ops.api` and the conversion steps in :mod:`ckptfix.ops.convert.steps`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .. import formats
from ..formats.base import RawRead
from ..statedict import locate, metadata, placeholders, wrappers
from ..core import locations
from ..core.devices import DevicePlan
from ..core.limits import collector_paused
from ..errors import NeedsLocalCopy, SelectError
from ..parse.format_registry import get
from ..reports import Checkpoint, describe_value, tensor_stats
from . import quantized, remote_read

T = TypeVar("T")


def read_checkpoint(path: str, map_location: Any, trust: bool, select: str, refuse: bool,
                    fmt: str | None = None, allow: Iterable[str] = (), whole: bool = False, *,
                    judged: bool = False) -> Checkpoint:
    """``path`` read with ``map_location`` (``'meta'``: structure only); ``fmt`` when already sniffed;
    ``allow``: globals taken as inert data inside the state dict too (:mod:`ckptfix.statedict.placeholders`);
    ``whole``: a file holding no state dict (a bare tensor, a list) is read as it is (:func:`summarise`);
    ``judged`` (verify): a ``_metadata`` no model loads is dropped and recorded for the gate, not refused.

    A URL is read by the same format readers from the byte ranges they ask for, its values fetched once each
    (:mod:`ckptfix.ops.remote_read`); what only ``torch.load`` of the whole file reads raises NeedsLocalCopy."""
    if not locations.is_remote(path):
        with collector_paused():  # (tens of thousands of small objects, none in a cycle)
            path, fmt = (path, fmt) if fmt else formats.resolve(path)
            plan = DevicePlan(map_location, source=path)
            return summarise(path, fmt, formats.read(path, fmt, plan, trust, select), select, refuse, allow, whole,
                             judged=judged)
    if trust:  # (the trusted path is torch.load's, of the whole file)
        raise NeedsLocalCopy(path, "reading it with trust (--trust)",
                             "torch.load reads the whole file; without trust it is read in place")
    with locations.session() as s, s.reporting(), collector_paused():
        path, fmt = (path, fmt) if fmt else formats.resolve(path)
        if "read" not in get(fmt).from_url:
            raise NeedsLocalCopy(path, f"reading this {fmt} file", "torch reads the whole file")
        plan = DevicePlan(map_location, source=path)
        ckpt = summarise(path, fmt, remote_read.read(path, fmt, plan, trust, select), select, refuse, allow, whole,
                         judged=judged)
        ckpt.bytes_fetched = s.bytes_fetched
    return ckpt


def structure_first(path: str, select: str, serves: Callable[[Checkpoint], T | None], load: Callable[[], Checkpoint],
                    *, trust: bool = False, fmt: str | None = None, allow: Iterable[str] = ()) -> tuple[Checkpoint, T | None]:
    """The cheap path, else the fallback, for a verb that reads tensor bytes itself (convert's stream, load_into):
    the structure read on meta, no tensor byte read, kept where ``serves`` makes something of it (its refs place the
    bytes the verb reads by position); else ``load()``: torch reads the values (legacy files, DeepSpeed's gathered
    weights, DCP values, a device other than the CPU). Returns the checkpoint and what ``serves`` gave (None: loaded)."""
    ckpt = read_checkpoint(path, "meta", trust, select, refuse=True, fmt=fmt, allow=allow)
    served = serves(ckpt)
    return (ckpt, served) if served is not None else (load(), None)


def summarise(path: str, fmt: str, raw: RawRead, select: str, refuse: bool,
              allow: Iterable[str] = (), whole: bool = False, *, judged: bool = False) -> Checkpoint:
    """The Checkpoint for what a reader returned: the state dict found (its ``_metadata`` as torch's loaders take
    it: :mod:`ckptfix.statedict.metadata`), wrappers detected, stats. ``whole`` (read, inspect, describe): a file
    holding no state dict gives an empty one, its value in ``raw``, and ``no_state_dict`` the line ``load`` and
    ``convert`` refuse it with; else that line is raised."""
    raw.obj, config_notes = placeholders.take_configs(raw.obj)
    missing: str | None = None
    try:
        sel, inert_notes = placeholders.select(raw.obj, lambda obj: locate.find_state_dict(obj, select, source=path),
                                               allow, path)
    except SelectError:
        missing = locate.missing_state_dict(raw.obj, path) if whole and select in ("auto", None) else None
        if missing is None:
            raise
        holds = "no entry holds tensors" if isinstance(raw.obj, Mapping) else f"the file holds {describe_value(raw.obj)}"
        sel, inert_notes = locate.Selection({}, None, dict(raw.obj) if isinstance(raw.obj, Mapping) else {}), \
            [f"no state dict: {holds}"]
    sd = sel.state_dict
    dropped = metadata.apply(sd, path, refuse=refuse and not judged)
    keys = list(sd.keys())
    default_tag = get(fmt).default_device
    notes = list(raw.notes) + config_notes + inert_notes + [metadata.note(line) for line in dropped]
    notes += locate.check_deepspeed(raw.obj, select, path, refuse=refuse)
    if sel.ema_keys:
        notes.append(f"EMA weights also present at {', '.join(sel.ema_keys)} (take them with select=KEY)")
    return Checkpoint(
        path=path,
        format=fmt,
        state_dict=sd,
        state_dict_key=sel.key,
        extra=sel.extra,
        wrappers=wrappers.detect_wrappers(keys),
        inner_wrappers=wrappers.inner_wrappers(keys),
        ema_keys=sel.ema_keys,
        stats_of=functools.partial(tensor_stats, dict(sd), raw.tags, default_tag),  # the tensors as read
        notes=notes,
        raw=raw.obj,
        refs=raw.refs,
        metadata_dropped=dropped,
        no_state_dict=missing,
        quant_config=quantized.read_configs(path).for_schemes(),
    )


