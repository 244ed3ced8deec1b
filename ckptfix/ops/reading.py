"""A checkpoint file read into a :class:`~ckptfix.reports.Checkpoint`: sniff → read → find the state dict.

Shared by the verbs in :mod:`ckptfix.ops.api` and the conversion steps in :mod:`ckptfix.ops.convert`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from .. import formats
from ..formats.base import RawRead
from ..statedict import locate, placeholders, wrappers
from ..core import locations
from ..core.devices import DevicePlan
from ..errors import RemoteError
from ..parse.format_registry import get
from ..reports import Checkpoint, tensor_stats
from . import remote_read


def read_checkpoint(path: str, map_location: Any, trust: bool, select: str, refuse: bool,
                    fmt: str | None = None, allow: Iterable[str] = ()) -> Checkpoint:
    """``path`` read with ``map_location`` (``'meta'``: structure only); ``fmt`` when already sniffed;
    ``allow``: globals taken as inert data inside the state dict too (:mod:`ckptfix.statedict.placeholders`).

    A URL is read by the same format readers from the byte ranges they ask for, its values fetched once each
    (:mod:`ckptfix.ops.remote_read`); what only ``torch.load`` of the whole file reads raises RemoteError."""
    if not locations.is_remote(path):
        fmt = fmt or formats.sniff(path)
        plan = DevicePlan(map_location, source=path)
        return summarise(path, fmt, formats.read(path, fmt, plan, trust, select), select, refuse, allow)
    if trust:  # (the trusted path is torch.load's, of the whole file)
        raise RemoteError(f"{path}: reading it with trust (--trust) takes torch.load of the whole file, which needs a "
                          "local copy; download it first, or read it without trust")
    with locations.session() as s, s.reporting():
        fmt = fmt or formats.sniff(path)
        plan = DevicePlan(map_location, source=path)
        ckpt = summarise(path, fmt, remote_read.read(path, fmt, plan, trust, select), select, refuse, allow)
        ckpt.bytes_fetched = s.bytes_fetched
    return ckpt


def refuse_remote(path: str, what: str) -> None:
    """A verb that doesn't read URLs yet (``what``) refuses one before fetching anything."""
    if locations.is_remote(path):
        raise RemoteError(f"{path}: {what} needs a local copy for now (a URL is inspected, scanned, read, loaded, "
                          "verified and diffed in place); download it first")


def summarise(path: str, fmt: str, raw: RawRead, select: str, refuse: bool,
              allow: Iterable[str] = ()) -> Checkpoint:
    """The Checkpoint for what a reader returned: the state dict found, wrappers detected, stats."""
    raw.obj, config_notes = placeholders.take_configs(raw.obj)
    sel, inert_notes = placeholders.select(raw.obj, lambda obj: locate.find_state_dict(obj, select, source=path),
                                           allow, path)
    sd = sel.state_dict
    keys = list(sd.keys())
    default_tag = get(fmt).default_device
    notes = list(raw.notes) + config_notes + inert_notes + locate.check_deepspeed(raw.obj, select, path, refuse=refuse)
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
    )
