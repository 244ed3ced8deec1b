"""The library's verbs: read, load, inspect, convert, load_into.

Data flows one way: path → sniff → read (safe, mapped) → select the state dict → rename keys
(wrappers, prefixes; ``_metadata`` in step) → write atomically, or load into a model.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import formats, layout, wrappers
from .atomic import atomic_path, check_destination
from .devices import DevicePlan
from .errors import ConversionError, LoadError, WrapperError
from .reports import Checkpoint, ConvertReport, LoadReport, tensor_stats


def _fspath(path: Any) -> str:
    return os.fspath(path)


def read(path: Any, map_location: Any = "cpu", trust: bool = False, select: str = "auto") -> Checkpoint:
    """The whole checkpoint: state dict (as saved, wrappers and all), the rest, and its summary.

    >>> ckpt = ckptfix.read("ddp.pth")   # doctest: +SKIP
    >>> ckpt.wrappers, ckpt.devices      # (['module'], {'cuda:0': 62})
    """
    path = _fspath(path)
    fmt = formats.sniff(path)
    plan = DevicePlan(map_location, source=path)
    raw = formats.read(path, fmt, plan, trust)
    sel = layout.find_state_dict(raw.obj, select, source=path)
    sd = sel.state_dict
    keys = list(sd.keys())
    default_tag = "cpu" if fmt == formats.SAFETENSORS else None
    notes = list(raw.notes)
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
        stats=tensor_stats(sd, raw.tags, default_tag),
        notes=notes,
        raw=raw.obj,
    )


def inspect(path: Any, trust: bool = False, select: str = "auto") -> Checkpoint:
    """Summary of a checkpoint without reading tensor data (tensors come back on ``meta``)."""
    return read(path, map_location="meta", trust=trust, select=select)


def _normalise(ckpt: Checkpoint, to: str, strip_prefix: str | None, add_prefix: str | None) -> Any:
    wrappers.check_no_flat_params(ckpt.state_dict.keys(), ckpt.path)
    if strip_prefix is not None:
        p = strip_prefix.strip().strip(".")
        if not any(k == p or k.startswith(p + ".") for k in ckpt.state_dict):
            raise WrapperError(
                f"{ckpt.path}: no key starts with {p + '.'!r} (first key: {next(iter(ckpt.state_dict), '')!r}); "
                "nothing was changed"
            )
    fn = wrappers.key_transform(to, strip_prefix=strip_prefix, add_prefix=add_prefix)
    return wrappers.rename_state_dict(ckpt.state_dict, fn, source=ckpt.path)


def load(
    path: Any,
    map_location: Any = "cpu",
    to: str = "single",
    select: str = "auto",
    trust: bool = False,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
) -> Any:
    """The model's state dict with wrapper segments normalised to ``to`` (default: none).

    >>> model.load_state_dict(ckptfix.load("ddp_compiled.pth"))   # doctest: +SKIP
    """
    ckpt = read(path, map_location=map_location, trust=trust, select=select)
    return _normalise(ckpt, to, strip_prefix, add_prefix)


def convert(
    src: Any,
    dst: Any,
    to: str = "single",
    map_location: Any = "cpu",
    select: str = "auto",
    keep_extra: bool = False,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    format: str | None = None,
    force: bool = False,
    trust: bool = False,
) -> ConvertReport:
    """Read ``src``, normalise its keys and write ``dst`` atomically (format by extension or ``format``)."""
    start = time.perf_counter()
    src, dst = _fspath(src), _fspath(dst)
    formats.sniff(src)
    check_destination(src, dst, force)
    fmt_out = formats.format_for_destination(dst, format)
    if keep_extra and fmt_out != formats.TORCH_ZIP:
        raise ConversionError(
            f"{dst}: --keep-extra keeps optimizer state and other Python objects, which only a .pth "
            "file can hold; write .pth, or drop --keep-extra to write the weights alone"
        )
    ckpt = read(src, map_location=map_location, trust=trust, select=select)
    if ckpt.stats.devices.get("meta") and map_location == "meta":
        raise ConversionError("map_location='meta' reads no tensor data; convert needs real tensors")
    sd = _normalise(ckpt, to, strip_prefix, add_prefix)
    keep = keep_extra and ckpt.state_dict_key not in (None, "<nn.Module>")
    out_obj = layout.put_back(ckpt.raw, ckpt.state_dict_key, sd) if keep else sd
    with atomic_path(dst) as tmp:
        notes = formats.write(out_obj, tmp, fmt_out)
    renamed = sum(1 for a, b in zip(ckpt.state_dict.keys(), sd.keys()) if a != b)
    extra_kept = list(ckpt.extra) if keep else []
    dropped = [] if keep else list(ckpt.extra)
    report_notes = ckpt.notes + notes
    if dropped:
        report_notes.append(f"not written (state dict only): {', '.join(dropped)}; pass --keep-extra to keep them")
    return ConvertReport(
        src=src,
        dst=dst,
        format_in=ckpt.format,
        format_out=fmt_out,
        to=to,
        state_dict_key=ckpt.state_dict_key,
        ema_keys=ckpt.ema_keys,
        wrappers_before=ckpt.wrappers,
        wrappers_after=wrappers.detect_wrappers(sd.keys()),
        renamed=renamed,
        num_tensors=ckpt.stats.num_tensors,
        nbytes=ckpt.stats.nbytes,
        kept_extra=extra_kept,
        seconds=round(time.perf_counter() - start, 3),
        notes=report_notes,
    )


def load_into(
    model: Any,
    path: Any,
    map_location: Any = "auto",
    strict: bool = True,
    select: str = "auto",
    trust: bool = False,
) -> LoadReport:
    """Load a checkpoint into ``model`` whatever the wrapping of either (plain, DP/DDP, compiled).

    The checkpoint's wrapper segments are adapted to the model's own keys; a checkpoint that
    still doesn't fit raises LoadError with a short report instead of torch's wall of keys.
    """
    ckpt = read(path, map_location=map_location, trust=trust, select=select)
    wrappers.check_no_flat_params(ckpt.state_dict.keys(), ckpt.path)
    target = model.state_dict()
    fn = wrappers.match_to_target(ckpt.state_dict.keys(), target.keys())
    sd = wrappers.rename_state_dict(ckpt.state_dict, fn, source=ckpt.path)
    meta = getattr(ckpt.state_dict, "_metadata", None)
    if meta is not None:
        sd._metadata = _adapt_metadata(meta, model)
    missing = [k for k in target if k not in sd]
    unexpected = [k for k in sd if k not in target]
    mismatched = [
        (k, tuple(sd[k].shape), tuple(target[k].shape))
        for k in sd
        if k in target and hasattr(sd[k], "shape") and tuple(sd[k].shape) != tuple(target[k].shape)
    ]
    changed = sum(1 for a, b in zip(ckpt.state_dict.keys(), sd.keys()) if a != b)
    model_wrappers = wrappers.detect_wrappers(target.keys())
    fix = None
    if changed:
        fix = f"{_describe(ckpt.wrappers)} -> {_describe(model_wrappers)}: {changed} keys renamed"
    if mismatched or (strict and (missing or unexpected)):
        raise LoadError(_short_report(ckpt.path, missing, unexpected, mismatched, fix))
    model.load_state_dict(sd, strict=strict)
    return LoadReport(
        path=ckpt.path,
        state_dict_key=ckpt.state_dict_key,
        checkpoint_wrappers=ckpt.wrappers,
        model_wrappers=model_wrappers,
        fix=fix,
        matched=len(sd) - len(unexpected),
        missing=missing,
        unexpected=unexpected,
        notes=ckpt.notes,
    )


def _describe(stack: list[str]) -> str:
    return ".".join(stack) + "." if stack else "(no wrapper)"


def _adapt_metadata(meta: Any, model: Any) -> Any:
    by_single = {}
    for name, _ in model.named_modules():
        by_single.setdefault(wrappers.strip_wrappers(name), name)

    def fn(key: str) -> str:
        path = key[:-2] if key.endswith(".x") else ""
        return by_single.get(wrappers.strip_wrappers(path), wrappers.strip_wrappers(path)) + ".x"

    return wrappers.rename_metadata(meta, fn)


def _short_report(path: str, missing: list[str], unexpected: list[str], mismatched: list[tuple], fix: str | None) -> str:
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f" … (+{len(keys) - 5} more)" if len(keys) > 5 else "")

    parts = [f"{path}: does not load into the model"]
    if fix:
        parts.append(f"after adapting wrappers ({fix})")
    if missing:
        parts.append(f"{len(missing)} missing: {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {few(unexpected)}")
    if mismatched:
        parts.append(
            f"{len(mismatched)} shape mismatch: "
            + ", ".join(f"{k} {list(a)} vs model {list(b)}" for k, a, b in mismatched[:5])
        )
    if missing and unexpected:
        parts.append("the names differ: a different architecture, or a renamed layer")
    return "; ".join(parts)
