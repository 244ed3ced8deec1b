"""The library's verbs: read, load, inspect, convert, load_into.

Data flows one way: path → sniff → read (safe, mapped) → select the state dict → rename keys
(wrappers, prefixes; ``_metadata`` in step) → write atomically, or load into a model.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import formats, layout, wrappers
from .atomic import atomic_path, check_destination, hashed_name, sha256_file
from .devices import DevicePlan
from .errors import ConversionError, LoadError, WrapperError
from .progress import Progress, peak_rss_bytes
from .reports import Checkpoint, ConvertReport, LoadReport, tensor_stats


def _fspath(path: Any) -> str:
    return os.fspath(path)


def read(path: Any, map_location: Any = "cpu", trust: bool = False, select: str = "auto") -> Checkpoint:
    """The whole checkpoint: state dict (as saved, wrappers and all), the rest, and its summary.

    A DeepSpeed ZeRO checkpoint (its directory, a tag directory, or a model_states file with its
    optim_states beside it) gives the fp32 master weights, consolidated as zero_to_fp32.py does;
    ``select='module'`` the training-dtype copy. A file that can't give them raises DeepSpeedZeroError.

    >>> ckpt = ckptfix.read("ddp.pth")   # doctest: +SKIP
    >>> ckpt.wrappers, ckpt.devices      # (['module'], {'cuda:0': 62})
    """
    return _read(_fspath(path), map_location, trust, select, refuse=True)


def _read(path: str, map_location: Any, trust: bool, select: str, refuse: bool) -> Checkpoint:
    fmt = formats.sniff(path)
    plan = DevicePlan(map_location, source=path)
    return _summarise(path, fmt, formats.read(path, fmt, plan, trust, select), select, refuse)


def _summarise(path: str, fmt: str, raw: formats.RawRead, select: str, refuse: bool) -> Checkpoint:
    sel = layout.find_state_dict(raw.obj, select, source=path)
    sd = sel.state_dict
    keys = list(sd.keys())
    default_tag = "cpu" if fmt in (formats.SAFETENSORS, formats.SHARDED_SAFETENSORS, formats.DCP) else None
    notes = list(raw.notes) + layout.check_deepspeed(raw.obj, select, path, refuse=refuse)
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
    return _read(_fspath(path), "meta", trust, select, refuse=False)


def describe(path: Any, select: str = "auto") -> Checkpoint:
    """``inspect`` without importing torch where the file allows it: tensors come back as
    :class:`~ckptfix.tensorinfo.TensorInfo` (plain data: dtype, shape, stride, byte range); a file only
    torch can describe exactly (legacy, TorchScript, DCP, DeepSpeed, tensor subclasses …) goes through
    ``inspect``, so the summary, and any refusal, is the same either way."""
    from .formats import structure

    path = _fspath(path)
    fmt = formats.sniff(path)
    if structure.enabled():
        try:
            raw = structure.read(path, fmt, select)
        except structure.NotDescribable:
            pass
        else:
            return _summarise(path, fmt, raw, select, refuse=False)
    return inspect(path, select=select)


def _normalise(
    ckpt: Checkpoint,
    to: str,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    rename: tuple[str, ...] | list[str] = (),
    by_order: Any = None,
) -> tuple[Any, list[str]]:
    """Keys: strip_prefix → wrappers off → regex renames → by-order names → add_prefix → ``to``'s wrappers.

    Renames and by-order work on the single form (what ``inspect`` of a converted file shows).
    Returns the new state dict and notes.
    """
    from . import transforms

    wrappers.check_no_flat_params(ckpt.state_dict.keys(), ckpt.path)
    if strip_prefix is not None:
        p = strip_prefix.strip().strip(".")
        if not any(wrappers.has_prefix(k, p) for k in ckpt.state_dict):
            raise WrapperError(
                f"{ckpt.path}: no key starts with {p + '.'!r} (first key: {next(iter(ckpt.state_dict), '')!r}); "
                "nothing was changed"
            )
    notes: list[str] = []
    inner = "keep" if to == "keep" else "single"
    sd = wrappers.rename_state_dict(ckpt.state_dict, wrappers.key_transform(inner, strip_prefix=strip_prefix),
                                    source=ckpt.path)
    if rename:
        sd, changed = transforms.rename_keys(sd, rename, source=ckpt.path)
        notes.append(f"--rename changed {changed} key(s)")
    if by_order is not None:
        sd, mapping = transforms.map_by_order(sd, by_order.state_dict(), source=ckpt.path)
        moved = [(a, b) for a, b in mapping if a != b]
        notes.append(f"--by-order renamed {len(moved)} of {len(mapping)} tensors by position"
                     + (": " + ", ".join(f"{a} -> {b}" for a, b in moved[:20]) if moved else ""))
    sd = wrappers.rename_state_dict(sd, wrappers.key_transform(to, add_prefix=add_prefix), source=ckpt.path)
    return sd, notes


def load(
    path: Any,
    map_location: Any = "cpu",
    to: str = "single",
    select: str = "auto",
    trust: bool = False,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    rename: tuple[str, ...] | list[str] = (),
    dtype: str | None = None,
    allow_overflow: bool = False,
) -> Any:
    """The model's state dict with wrapper segments normalised to ``to`` (default: none).

    ``rename`` takes ``'REGEX=REPLACEMENT'`` rules (full match, in order); ``dtype`` casts
    floating-point tensors (fp32/fp16/bf16), never integer or bool buffers.

    >>> model.load_state_dict(ckptfix.load("ddp_compiled.pth"))   # doctest: +SKIP
    """
    ckpt = read(path, map_location=map_location, trust=trust, select=select)
    sd, _notes = _normalise(ckpt, to, strip_prefix, add_prefix, rename)
    if dtype is not None:
        from .transforms import cast_floating

        sd, _report = cast_floating(sd, dtype, allow_overflow)
    return sd


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
    rename: tuple[str, ...] | list[str] = (),
    by_order: Any = None,
    dtype: str | None = None,
    allow_overflow: bool = False,
    hash: bool = False,
    checksums: bool = False,
    max_shard_size: int | str | None = None,
) -> ConvertReport:
    """Read ``src``, normalise its keys and write ``dst`` atomically (format by extension or ``format``).

    From a torch zip or safetensors file to CPU (the default), tensor bytes are never loaded:
    the structure is read on ``meta`` and each tensor's bytes are copied from ``src`` into ``dst``
    in the kernel, so time and memory stay close to ``cp``'s. ``progress`` draws a progress line
    on stderr when it is a terminal.

    ``rename`` (``'REGEX=REPLACEMENT'`` rules), ``by_order`` (an ``nn.Module`` whose key names are
    given to the checkpoint's tensors by position) and ``dtype`` (fp32/fp16/bf16, floating-point
    tensors only) transform the state dict; ``hash`` appends the first 8 hex digits of the output's
    SHA-256 to its name (torch.hub's convention); ``checksums`` reports both files' SHA-256.

    ``max_shard_size`` (bytes, or ``"5GB"``) writes a Hugging Face sharded directory at ``dst``;
    ``format="dcp"`` a torch.distributed.checkpoint directory. Into an existing directory (``force``)
    only the output's own files are replaced; the report's notes list what was kept and removed.
    """
    start = time.perf_counter()
    src, dst = _fspath(src), _fspath(dst)
    fmt_in = formats.sniff(src)
    shard_size, fmt_out = _plan_output(src, dst, format, max_shard_size, keep_extra, hash, force)
    plan = DevicePlan(map_location, source=src)
    if plan.is_meta:
        raise ConversionError("map_location='meta' reads no tensor data; convert needs real tensors")
    if dtype is not None:
        from .transforms import parse_dtype

        parse_dtype(dtype)
    ckpt = None
    if not trust and fmt_in in formats.STREAMABLE and fmt_out != formats.DCP and plan.user_fn is None:
        ckpt = read(src, map_location="meta", select=select)
        if not ckpt.refs or any(plan.target(ref.location) != "cpu" for ref in ckpt.refs.values()):
            ckpt = None  # a device other than the CPU asked for: load the tensors for real
    streamed = ckpt is not None
    if ckpt is None:
        ckpt = read(src, map_location=map_location, trust=trust, select=select)
    if keep_extra and strip_prefix is not None:
        layout.check_resumable(ckpt.raw, ckpt.state_dict_key, ckpt.state_dict, strip_prefix, src)
    sd, notes = _normalise(ckpt, to, strip_prefix, add_prefix, rename, by_order)
    cast = None
    if dtype is not None:
        from .transforms import cast_floating

        sd, cast = cast_floating(sd, dtype, allow_overflow)
        notes.append(f"cast to {cast.dtype}: " + (", ".join(f"{k} ×{v}" for k, v in cast.cast.items()) or "nothing to cast")
                     + ("; kept " + ", ".join(f"{k} ×{v}" for k, v in cast.kept.items()) if cast.kept else ""))
    keep = keep_extra and ckpt.state_dict_key not in (None, "<nn.Module>")
    out_obj = layout.put_back(ckpt.raw, ckpt.state_dict_key, sd) if keep else sd
    refs = _with_casts(ckpt.refs, cast) if streamed else None
    final = {"dst": dst, "sha256": None}

    def finalize(tmp: str) -> str:
        if hash or checksums:
            final["sha256"] = sha256_file(tmp)
        if hash:
            final["dst"] = hashed_name(dst, final["sha256"])
            check_destination(src, final["dst"], force)
        return final["dst"]

    nbytes_out = tensor_stats(sd, {}).nbytes if cast is not None else ckpt.stats.nbytes  # what is written
    with Progress(nbytes_out, ckpt.stats.num_tensors, enabled=progress):
        notes += _write_output(out_obj, src, dst, fmt_out, shard_size, refs, force, finalize)
    dst = final["dst"]
    if cast is not None and cast.infs_produced:
        notes.append(f"overflow: {cast.infs_produced} value(s) became inf in {', '.join(cast.overflow_keys)}")
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
        nbytes=nbytes_out,
        nbytes_in=ckpt.stats.nbytes,
        kept_extra=extra_kept,
        streamed=streamed,
        bytes_read=ckpt.stats.nbytes,
        bytes_written=_size_on_disk(dst),
        seconds=round(time.perf_counter() - start, 3),
        peak_rss=peak_rss_bytes(),
        sha256_in=sha256_file(src) if checksums and os.path.isfile(src) else None,
        sha256_out=final["sha256"] if checksums else None,
        dtype_cast=cast.cast if cast is not None else None,
        notes=report_notes,
    )


def _plan_output(src: str, dst: str, format: str | None, max_shard_size: int | str | None, keep_extra: bool,
                 hash: bool, force: bool) -> tuple[int | None, str]:
    """Check the destination before anything is read; returns (shard size or None, output format)."""
    shard_size = None
    if max_shard_size is not None:
        from .formats.sharded import parse_size

        shard_size = parse_size(max_shard_size)
    fmt_out = formats.format_for_destination(dst, format, sharded=shard_size is not None)
    if shard_size is not None or fmt_out == formats.DCP:
        from .atomic import check_destination_dir

        if hash:
            raise ConversionError("--hash names one output file; it does not apply to a sharded or DCP directory")
        if shard_size is not None:
            from .formats.sharded import dir_output

            output = dir_output(fmt_out)
        else:
            from .formats.dcp import DIR_OUTPUT as output
        check_destination_dir(src, dst, force, output)  # before reading: a refusal costs nothing
    else:
        check_destination(src, dst, force or hash)  # with hash the name is known only once written
    if keep_extra and (fmt_out not in (formats.TORCH_ZIP, formats.DCP) or shard_size is not None):
        raise ConversionError(
            f"{dst}: --keep-extra keeps optimizer state and other Python objects, which only a single .pth "
            "file or a DCP directory can hold; write .pth, or drop --keep-extra to write the weights alone"
        )
    return shard_size, fmt_out


def _with_casts(refs: dict, cast: Any) -> dict:
    """Source refs plus a CastRef for every tensor cast on meta: the writers compute each cast
    tensor as they reach it, so memory stays bounded by the largest tensor."""
    if cast is None or not cast.deferred:
        return refs
    from .devices import storage_id

    out = dict(refs)
    for key, before, after in cast.deferred:
        out[storage_id(after)] = formats.CastRef(refs[storage_id(before)], key, before, after, cast.check_values)
    return out


def _write_output(obj: Any, src: str, dst: str, fmt: str, shard_size: int | None, refs: dict | None, force: bool,
                  finalize: Any) -> list[str]:
    """Write one file atomically (``finalize`` may rename it), or a sharded / DCP directory."""
    if shard_size is not None:
        from .formats import sharded

        return sharded.write(obj, dst, fmt, shard_size, force=force, refs=refs)
    if fmt == formats.DCP:
        from .formats import dcp
        from .standins import contains_stand_ins

        if contains_stand_ins(obj):
            raise ConversionError(
                f"{src}: holds mmengine objects (message_hub) that a DCP directory can't store under "
                "their own names; write .pth with --keep-extra, or drop --keep-extra for DCP"
            )
        return dcp.write(obj, dst, force=force)
    notes: list[str] = []
    with atomic_path(dst, finalize=finalize, notes=notes) as tmp:
        return notes + formats.write(obj, tmp, fmt, refs=refs, archive=os.path.splitext(os.path.basename(dst))[0])


def _size_on_disk(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def load_into(
    model: Any,
    path: Any,
    map_location: Any = "auto",
    strict: bool = True,
    select: str = "auto",
    trust: bool = False,
    strict_values: bool = False,
) -> LoadReport:
    """Load a checkpoint into ``model`` whatever the wrapping of either (plain, DP/DDP, compiled).

    The keys get the repair ``verify`` would choose (wrapper segments matched to the model's,
    a framework's leading prefix such as Lightning's ``model.`` removed); a checkpoint that still
    doesn't fit raises LoadError with a short report instead of torch's wall of keys.

    NaN/Inf values are loaded with a UserWarning naming the keys (and listed in the report's
    ``nonfinite``); with ``strict_values=True`` they raise LoadError and nothing is loaded.
    """
    import warnings

    from . import repair

    ckpt = read(path, map_location=map_location, trust=trust, select=select)
    target = repair.describe_target(model)
    chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=ckpt.path)
    if fit.shape_mismatch or fit.non_tensor or (strict and (fit.missing or fit.unexpected)):
        raise LoadError(_short_report(ckpt.path, fit, chosen))
    nonfinite = repair.nonfinite_keys(fit.state_dict, target.shapes)
    values = f"{len(nonfinite)} tensor(s) hold NaN/Inf values: {_few(nonfinite)}"
    if nonfinite and strict_values:
        raise LoadError(f"{ckpt.path}: {values}; nothing was loaded (a diverged run, or a damaged file?); "
                        "pass strict_values=False to load it anyway")
    model.load_state_dict(fit.state_dict, strict=strict)
    notes = list(ckpt.notes)
    if nonfinite:
        warnings.warn(f"{ckpt.path}: {values} (loaded; strict_values=True refuses them)", UserWarning, stacklevel=2)
        notes.append(f"{values} (a diverged run, or a damaged file?)")
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
        nonfinite=nonfinite,
    )


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" … (+{len(keys) - 5} more)" if len(keys) > 5 else "")


def _short_report(path: str, fit: Any, chosen: Any) -> str:
    """One paragraph: what is missing / unexpected / mismatched after the repair, and the likely cause."""
    parts = [f"{path}: does not load into the model"]
    if chosen.description:
        parts.append(f"after the repair ({chosen.summary})")
    if fit.missing:
        parts.append(f"{len(fit.missing)} missing: {_few(fit.missing)}")
    if fit.unexpected:
        parts.append(f"{len(fit.unexpected)} unexpected: {_few(fit.unexpected)}")
    if fit.shape_mismatch:
        parts.append(
            f"{len(fit.shape_mismatch)} shape mismatch: "
            + ", ".join(f"{r['key']} {r['checkpoint']} vs model {r['model']}" for r in fit.shape_mismatch[:5])
        )
    if fit.non_tensor:
        parts.append(f"{len(fit.non_tensor)} not tensors: {_few(fit.non_tensor)}")
    if fit.missing and fit.unexpected:
        parts.append("the names differ: a renamed layer, or a different architecture (`ckptfix verify` suggests renames)")
    elif fit.missing or fit.shape_mismatch:
        parts.append("likely a different architecture or configuration (e.g. num_classes)")
    return "; ".join(parts)
