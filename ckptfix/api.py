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
from .progress import Progress, peak_rss_bytes
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
        refs=raw.refs,
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
    progress: bool = False,
) -> ConvertReport:
    """Read ``src``, normalise its keys and write ``dst`` atomically (format by extension or ``format``).

    From a torch zip or safetensors file to CPU (the default), tensor bytes are never loaded:
    the structure is read on ``meta`` and each tensor's bytes are copied from ``src`` into ``dst``
    in the kernel, so time and memory stay close to ``cp``'s. ``progress`` draws a progress line
    on stderr when it is a terminal.
    """
    start = time.perf_counter()
    src, dst = _fspath(src), _fspath(dst)
    fmt_in = formats.sniff(src)
    check_destination(src, dst, force)
    fmt_out = formats.format_for_destination(dst, format)
    if keep_extra and fmt_out != formats.TORCH_ZIP:
        raise ConversionError(
            f"{dst}: --keep-extra keeps optimizer state and other Python objects, which only a .pth "
            "file can hold; write .pth, or drop --keep-extra to write the weights alone"
        )
    plan = DevicePlan(map_location, source=src)
    if plan.is_meta:
        raise ConversionError("map_location='meta' reads no tensor data; convert needs real tensors")
    ckpt = None
    if not trust and fmt_in in (formats.TORCH_ZIP, formats.SAFETENSORS) and plan.user_fn is None:
        ckpt = read(src, map_location="meta", select=select)
        if not ckpt.refs or any(plan.target(ref.location) != "cpu" for ref in ckpt.refs.values()):
            ckpt = None  # a device other than the CPU asked for: load the tensors for real
    streamed = ckpt is not None
    if ckpt is None:
        ckpt = read(src, map_location=map_location, trust=trust, select=select)
    sd = _normalise(ckpt, to, strip_prefix, add_prefix)
    keep = keep_extra and ckpt.state_dict_key not in (None, "<nn.Module>")
    out_obj = layout.put_back(ckpt.raw, ckpt.state_dict_key, sd) if keep else sd
    archive = os.path.splitext(os.path.basename(dst))[0]
    with atomic_path(dst) as tmp, Progress(ckpt.stats.nbytes, ckpt.stats.num_tensors, enabled=progress):
        notes = formats.write(out_obj, tmp, fmt_out, refs=ckpt.refs if streamed else None, archive=archive)
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
        streamed=streamed,
        bytes_read=ckpt.stats.nbytes,
        bytes_written=os.path.getsize(dst),
        seconds=round(time.perf_counter() - start, 3),
        peak_rss=peak_rss_bytes(),
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

    The keys get the repair ``verify`` would choose (wrapper segments matched to the model's,
    a framework's leading prefix such as Lightning's ``model.`` removed); a checkpoint that still
    doesn't fit raises LoadError with a short report instead of torch's wall of keys.
    """
    from . import repair

    ckpt = read(path, map_location=map_location, trust=trust, select=select)
    target = repair.describe_target(model)
    chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=ckpt.path)
    if fit.shape_mismatch or fit.non_tensor or (strict and (fit.missing or fit.unexpected)):
        raise LoadError(_short_report(ckpt.path, fit, chosen))
    model.load_state_dict(fit.state_dict, strict=strict)
    notes = list(ckpt.notes)
    if fit.dtype_mismatch:
        kinds = sorted({f"{r['checkpoint']} -> {r['model']}" for r in fit.dtype_mismatch})
        notes.append(f"{len(fit.dtype_mismatch)} tensors cast to the model's dtype ({', '.join(kinds)})")
    return LoadReport(
        path=ckpt.path,
        state_dict_key=ckpt.state_dict_key,
        checkpoint_wrappers=ckpt.wrappers,
        model_wrappers=target.wrappers,
        fix=chosen.description,
        matched=chosen.matched,
        missing=fit.missing,
        unexpected=fit.unexpected,
        notes=notes,
        tolerated=[t["key"] for t in fit.tolerated],
    )


def _short_report(path: str, fit: Any, chosen: Any) -> str:
    """One paragraph: what is missing / unexpected / mismatched after the repair, and the likely cause."""
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f" … (+{len(keys) - 5} more)" if len(keys) > 5 else "")

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
