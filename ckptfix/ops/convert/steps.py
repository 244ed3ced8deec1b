"""The steps of :func:`ckptfix.convert`: validate the request, plan the read, normalise, write, report.

The read is one of three, chosen before any tensor byte is touched:

- ``torch-free``: the file is describable without torch (torch zip, safetensors, HF sharded) and
  the request needs no tensor computation (no dtype cast, no by-order, no ``trust``, every storage
  bound for the CPU, output .pth or .safetensors, one file or HF shards): the structure is read as
  :class:`~ckptfix.core.tensorinfo.TensorInfo` and written by the format's torch-free writer
  (:func:`ckptfix.formats.plan_write`); torch is never imported. Whatever that writer can't reproduce
  exactly falls back to ``streamed``.
- ``streamed``: the structure on torch's ``meta`` device; tensor bytes copied in the kernel.
- ``loaded``: the tensors read for real (another device, ``trust``, legacy files, DCP output …).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from ... import formats
from ...formats.base import CastRef, source_record
from ...statedict import locate, ties, transforms, weights_only, wrappers
from ...core import locations, outputs
from ...core.bytecopy import CrcCheck
from ...core.atomic import hashed_name
from ...core.upload import check_destination, check_destination_dir, check_scheme, output_path
from ...core.devices import DevicePlan, normalise_device, storage_id
from ...core.torch_free import NeedsTorch
from ...errors import ConversionError, DeviceError, WrapperError
from ...core.limits import collector_paused
from ...core.progress import Progress, peak_rss_bytes
from ...core.units import few, parse_size
from . import lineage, quant, remote_convert
from ..convert_options import ConvertOptions
from ..quantized import Configs, read_configs
from ..reading import read_checkpoint, structure_first, summarise
from ...parse import format_registry as registry, inert
from ...reports import Checkpoint, ConvertReport, tensor_stats
from ...safety import digests, signing
from ...safety.standins import contains_stand_ins
from ...core.tensorinfo import TensorInfo

TORCH_FREE, STREAMED, LOADED = "torch-free", "streamed", "loaded"


@dataclass(frozen=True, kw_only=True)
class Request(ConvertOptions):
    """A validated convert call: its options, and what checking them resolved (formats, shard size, devices)."""

    src: str
    dst: str
    fmt_in: str
    fmt_out: str
    shard_size: int | None
    plan: DevicePlan
    #: the JSON configs beside the source, read where a cast or a dequantization asks which groups are quantized
    configs: Configs = Configs()


def validate(src: str, dst: str, options: ConvertOptions) -> Request:
    """Check the request before anything is read: source format, destination, device, dtype."""
    if options.sign is not None:
        _check_signing(dst, options.sign)
    check_scheme(dst)  # s3:// is uploaded; https:// and hf:// are refused
    src, fmt_in = formats.resolve(src)  # a save_pretrained directory: its one file
    shard_size, fmt_out = _plan_output(src, dst, options.format, options.max_shard_size, options.keep_extra,
                                       options.hash, options.force)
    plan = DevicePlan(options.map_location, source=src)
    if plan.is_meta:
        raise ConversionError("map_location='meta' reads no tensor data; convert needs real tensors")
    if options.dtype is not None:
        transforms.parse_dtype(options.dtype)
    ties.check_request(dst, fmt_out, _stores_aliases(fmt_out), options.untie, options.compact_ties)
    configs = read_configs(src) if options.dtype is not None or options.dequantize else Configs()
    return Request(src=src, dst=dst, fmt_in=fmt_in, fmt_out=fmt_out, shard_size=shard_size, plan=plan,
                   configs=configs, **vars(options))


def _check_signing(dst: str, key: str) -> None:
    """``--sign KEY``: model-signing installed, a key it takes, a local output to sign beside; before any write."""
    if locations.is_remote(dst):
        raise ConversionError(f"{dst}: --sign writes the signature beside a local output; convert to a local path, "
                              "sign it (ckptfix sign), then upload both")
    signing.require()
    signing.load_key(key)


def _stores_aliases(fmt: str) -> bool:
    """Does ``fmt`` (or its shards' format) store tied tensors once, as aliases only ckptfix's reader restores?"""
    spec = registry.get(fmt)
    return spec.stores_aliases or (spec.shard_format is not None and registry.get(spec.shard_format).stores_aliases)


def _plan_output(src: str, dst: str, fmt_requested: str | None, max_shard_size: int | str | None, keep_extra: bool,
                 hashed: bool, force: bool) -> tuple[int | None, str]:
    """Check the destination before anything is read; returns (shard size or None, output format)."""
    shard_size = None
    if max_shard_size is not None:
        shard_size = parse_size(max_shard_size)
    fmt_out = formats.format_for_destination(dst, fmt_requested, sharded=shard_size is not None)
    out = registry.get(fmt_out)
    if shard_size is not None or out.directory_output:
        _check_directory_name(dst, "--max-shard-size" if shard_size is not None else f"--format {fmt_requested}")
        if hashed:
            raise ConversionError("--hash names one output file; it does not apply to a sharded or DCP directory")
        output = formats.dir_output(fmt_out, sharded=shard_size is not None)
        check_destination_dir(src, dst, force, output)  # before reading: a refusal costs nothing
    else:
        check_destination(src, dst, force or hashed)  # with hash the name is known only once written
    if keep_extra and (not out.keeps_objects or shard_size is not None):
        raise ConversionError(
            f"{dst}: --keep-extra keeps optimizer state and other Python objects, which only a single .pth "
            "file or a DCP directory can hold; write .pth, or drop --keep-extra to write the weights alone"
        )
    return shard_size, fmt_out


def _check_directory_name(dst: str, flag: str) -> None:
    """A directory output under a one-file name (``model.safetensors``) would be a directory called that:
    refused, unless that directory already exists (Lightning's ``.ckpt`` directories are not one-file names)."""
    stem, ext = os.path.splitext(dst.rstrip(os.sep))
    spec = registry.by_extension(ext.lower())
    if spec is not None and ext.lower() in spec.extensions and not os.path.isdir(dst):
        raise ConversionError(
            f"{dst}: {flag} writes a directory, not one {ext} file; name a directory instead (e.g. {stem}/), "
            f"or drop {flag.split()[0]} to write one file; nothing was written"
        )


# -- planning the read --------------------------------------------------------------------------------

def plan_read(req: Request, torch_free: bool = True) -> tuple[Checkpoint, str]:
    """The source read the cheapest way the request allows, and which way that was."""
    if req.trust or req.dequantize or not registry.get(req.fmt_in).stream or not registry.get(req.fmt_out).writes_from_refs \
            or req.plan.user_fn is not None:
        remote_convert.refuse_torch(req)
        return _load(req), LOADED
    if torch_free and remote_convert.needs_torch(req) is None:
        ckpt = _describe(req)
        if ckpt is not None:
            return ckpt, TORCH_FREE
    remote_convert.refuse_torch(req)  # (a URL: the torch-free path or nothing, for now)
    if req.plan.fixed is not None and req.plan.fixed != "cpu":  # every storage goes there: load once
        return _load(req), LOADED
    ckpt, refs = structure_first(req.src, req.select, lambda c: _cpu_refs(req, c), lambda: _load(req), fmt=req.fmt_in,
                                 allow=req.allow)
    if refs is None:
        return ckpt, LOADED
    _check_unrecorded(req, refs)
    return ckpt, STREAMED


def _cpu_refs(req: Request, ckpt: Checkpoint) -> dict | None:
    """The structure's refs, where every storage is bound for the CPU (else torch loads the tensors for real)."""
    if not ckpt.refs or any(req.plan.target(ref.location) != "cpu" for ref in ckpt.refs.values()):
        return None
    return ckpt.refs


def _load(req: Request) -> Checkpoint:
    """torch reads the file; a torch zip's records are checked against their CRC-32s meanwhile (torch doesn't)."""
    members = formats.recorded_members(req.src, req.fmt_in, req.select)
    with CrcCheck(members) as check:
        ckpt = read_checkpoint(req.src, req.map_location, req.trust, req.select, refuse=True, fmt=req.fmt_in,
                               allow=req.allow)
        check.verify()
    return ckpt


def _check_unrecorded(req: Request, refs: dict) -> None:
    """The zip records of source files whose streamed copy checks none (DeepSpeed's consolidated ranges and
    gathered weights carry no record), CRC-checked before anything is written; a file whose copied ranges
    name their records is checked while they are copied instead."""
    if all(source_record(ref) is not None for ref in refs.values()):
        return
    copied = {m.path for m in map(source_record, refs.values()) if m is not None}
    members = [m for m in formats.recorded_members(req.src, req.fmt_in, req.select) if m.path not in copied]
    with CrcCheck(members) as check:
        check.verify()


def _describe(req: Request) -> Checkpoint | None:
    """The source as TensorInfo when it is describable and all its storages map to the CPU, else None."""
    try:
        raw = formats.describe(req.src, req.fmt_in, req.select)
    except NeedsTorch:
        return None
    if not raw.tags or not all(_to_cpu(req.plan, tag) for tag in raw.tags.values()):
        return None  # no tensors, or one bound elsewhere (or nowhere): torch's path decides
    return summarise(req.src, req.fmt_in, raw, req.select, refuse=True, allow=req.allow)


def _to_cpu(plan: DevicePlan, tag: str) -> bool:
    if plan.fixed is not None:
        return plan.fixed == "cpu"
    try:
        return plan.mapping is not None and normalise_device(plan.mapping.get(tag, tag)) == "cpu"
    except DeviceError:  # an odd tag: torch's path gives its own error
        return False


# -- normalising ---------------------------------------------------------------------------------------

def normalise_keys(
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
    wrappers.check_no_flat_params(ckpt.state_dict.keys(), ckpt.path)
    notes: list[str] = []
    if strip_prefix is not None:
        p = strip_prefix.strip().strip(".")
        if not any(wrappers.has_prefix(k, p) for k in ckpt.state_dict):
            raise WrapperError(
                f"{ckpt.path}: no key starts with {p + '.'!r} (first key: {next(iter(ckpt.state_dict), '')!r}); "
                "nothing was changed"
            )
        left = [k for k in ckpt.state_dict if not wrappers.has_prefix(k, p)]
        if left:
            notes.append(f"--strip-prefix {p}. left {len(left)} key(s) without that prefix unchanged: {few(left)}")
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


@dataclass
class Output:
    """What is about to be written: the renamed state dict, the object written (it, or the whole
    checkpoint with it put back), notes so far, the dtype cast report, whether quantized groups were dequantized and
    what was done to them (``ConvertReport.quantized``)."""

    state_dict: Any
    obj: Any
    notes: list[str]
    cast: Any
    kept: bool
    renamed: int  # keys the renames changed (before a dequantization drops any)
    dequantized: bool = False
    quantized: dict[str, Any] | None = None
    untied: bool = False  #: tied tensors stored under each key: more bytes written than read


def transform(req: Request, ckpt: Checkpoint) -> Output:
    """Keys renamed, dtype cast (on meta when streamed), the state dict put back for ``keep_extra``."""
    if req.keep_extra and req.strip_prefix is not None:
        locate.check_resumable(ckpt.raw, ckpt.state_dict_key, ckpt.state_dict, req.strip_prefix, req.src)
    sd, notes = normalise_keys(ckpt, req.to, req.strip_prefix, req.add_prefix, req.rename, req.by_order)
    untied: list[str] = []
    if _stores_aliases(req.fmt_out) and not req.compact_ties:  # every tied name stored: load_file returns each
        sd, untied = ties.untie_aliases(sd, ckpt.refs)
        notes += ties.untie_notes(untied, req.untie)
    cast, renamed = None, sum(1 for a, b in zip(ckpt.state_dict.keys(), sd.keys()) if a != b)
    groups = quant.apply(req, sd)  # quantized groups: kept as stored by a cast, or dequantized
    sd = groups.state_dict
    notes += groups.notes
    if req.dtype is not None:
        sd, cast = transforms.cast_floating(sd, req.dtype, req.allow_overflow, keep=groups.keep)
        notes.append(f"cast to {cast.dtype}: " + (", ".join(f"{k} ×{v}" for k, v in cast.cast.items()) or "nothing to cast")
                     + ("; kept " + ", ".join(f"{k} ×{v}" for k, v in cast.kept.items()) if cast.kept else ""))
    kept = req.keep_extra and ckpt.state_dict_key not in (None, "<nn.Module>")
    obj = locate.put_back(ckpt.raw, ckpt.state_dict_key, sd) if kept else sd
    held = inert.names(inert.find(obj))
    if held:
        raise ConversionError(
            f"{req.src}: holds {', '.join(held)}, read as inert placeholders (never imported), which can't be "
            "written back under their own names; " + ("drop --keep-extra to write the state dict alone" if kept else
                                                       "drop --allow for them, or remove them from the state dict"))
    if kept and not registry.get(req.fmt_out).directory_output:  # (a DCP directory's loader takes objects)
        weights_only.refuse_writing(req.src, req.dst, ckpt.extra, req.allow)
    return Output(sd, obj, notes, cast, kept, renamed, groups.dequantized, groups.summary, bool(untied))


# -- writing -------------------------------------------------------------------------------------------

class _Finalizer:
    """Called by ``output_path`` on the finished temp file: picks the hashed name; holds the output's SHA-256."""

    def __init__(self, req: Request):
        self.req, self.dst = req, req.dst
        self.sha256: str | None = None
        self.size = 0  # the output's bytes (uploaded, for an s3:// destination)
        self.pending: Any = None  # the SHA-256 being computed: ``result()`` gives it
        self.signature: str | None = None

    @contextlib.contextmanager
    def writing(self, tmp: str) -> Iterator[None]:
        """The write of the temp file: where its SHA-256 is wanted, hashed behind the writer as the bytes land
        (``outputs.hashing``), else — a writer that patched what it wrote, or torch's — on another thread (page
        cache) once it is written; either finishes while ``output_path`` fsyncs it."""
        if not (self.req.hash or self.req.checksums or self.req.sign):
            yield
            return
        with outputs.hashing(tmp) as hashed:
            yield
        self.pending = hashed.hasher or signing.hash_in_background(tmp)

    def digest(self) -> str | None:
        """The output's SHA-256 (waiting for its hash), where it was wanted."""
        if self.pending is not None:
            self.sha256, self.pending = self.pending.result(), None
        return self.sha256

    def __call__(self, tmp: str) -> str:
        self.size = os.path.getsize(tmp)
        if self.req.hash:
            self.dst = hashed_name(self.req.dst, cast(str, self.digest()))
            check_destination(self.req.src, self.dst, self.req.force)
        return self.dst


def write_torch_free(req: Request, ckpt: Checkpoint, out: Output, final: _Finalizer) -> list[str]:
    """Write TensorInfo values without torch, one file or a sharded directory; raises NeedsTorch
    before writing what it can't reproduce."""
    keep_keys = registry.get(req.fmt_in).record_keys
    if req.shard_size is not None:
        if not all(type(v) is TensorInfo for v in out.obj.values()):
            raise NeedsTorch("a value that is not a tensor")  # torch's path gives its error
        with Progress(_nbytes_out(ckpt, out), ckpt.stats.num_tensors, enabled=req.progress):
            return formats.write_sharded(out.obj, req.dst, req.fmt_out, req.shard_size, force=req.force,
                                         torch_free=True, keep_keys=keep_keys)
    plan = formats.plan_write(out.obj, req.fmt_out, archive=_archive_name(req.dst), keep_keys=keep_keys)
    notes: list[str] = []
    with Progress(_nbytes_out(ckpt, out), ckpt.stats.num_tensors, enabled=req.progress):
        with output_path(req.dst, finalize=final, notes=notes, force=req.force) as tmp, final.writing(tmp):
            written = plan.write(tmp)
    return notes + written


def write_with_torch(req: Request, ckpt: Checkpoint, out: Output, final: _Finalizer, streamed: bool) -> list[str]:
    """Write through torch: records copied from the source (streamed) or tensors from memory."""
    refs = _with_casts(ckpt.refs, out.cast) if streamed else None
    with Progress(_nbytes_out(ckpt, out), ckpt.stats.num_tensors, enabled=req.progress):
        return _write_output(req, out.obj, refs, final)


def _archive_name(dst: str) -> str:
    return os.path.splitext(os.path.basename(dst))[0]


def _nbytes_out(ckpt: Checkpoint, out: Output) -> int:
    changed = out.cast is not None or out.dequantized or out.untied
    return tensor_stats(out.state_dict, {}).nbytes if changed else ckpt.stats.nbytes


def _with_casts(refs: dict, cast: Any) -> dict:
    """Source refs plus a CastRef for every tensor cast on meta: the writers compute each cast
    tensor as they reach it, so memory stays bounded by the largest tensor."""
    if cast is None or not cast.deferred:
        return refs
    out = dict(refs)
    for key, before, after in cast.deferred:
        out[storage_id(after)] = CastRef(refs[storage_id(before)], key, before, after, cast.check_values)
    return out


def _write_output(req: Request, obj: Any, refs: dict | None, final: _Finalizer) -> list[str]:
    """Write one file atomically (``final`` may rename it), or a sharded / DCP directory."""
    if req.shard_size is not None:
        return formats.write_sharded(obj, req.dst, req.fmt_out, req.shard_size, force=req.force, refs=refs)
    out = registry.get(req.fmt_out)
    if out.refuses_stand_ins and contains_stand_ins(obj):
        raise ConversionError(
            f"{req.src}: holds mmengine objects (message_hub) that a DCP directory can't store under "
            "their own names; write .pth with --keep-extra, or drop --keep-extra for DCP"
        )
    if out.directory_output:
        return formats.write(obj, req.dst, req.fmt_out, force=req.force)
    notes: list[str] = []
    with output_path(req.dst, finalize=final, notes=notes, force=req.force) as tmp, final.writing(tmp):
        written = formats.write(obj, tmp, req.fmt_out, refs=refs, archive=_archive_name(req.dst))
    return notes + written


# -- the whole conversion ------------------------------------------------------------------------------

def run(req: Request, start: float) -> ConvertReport:
    """:func:`convert`, every output it writes recording the convert's lineage."""
    with digests.recording(lineage.of(req)):
        return convert(req, start)


def convert(req: Request, start: float) -> ConvertReport:
    """Read, normalise, write and report; the torch-free path first where the request allows it."""
    with collector_paused():
        ckpt, mode = plan_read(req)
        if mode == TORCH_FREE:
            final = _Finalizer(req)
            out = transform(req, ckpt)
            try:
                written = write_torch_free(req, ckpt, out, final)
            except NeedsTorch as e:
                remote_convert.refuse_torch(req, str(e))
                ckpt, mode = plan_read(req, torch_free=False)
            else:
                _sign(req, final)
                return report(req, ckpt, out, written, final, True, start)
    final = _Finalizer(req)
    out = transform(req, ckpt)
    written = write_with_torch(req, ckpt, out, final, streamed=mode == STREAMED)
    written += quant.write_configs(req, (out.quantized or {}).get("dtype"))
    _sign(req, final)
    return report(req, ckpt, out, written, final, mode == STREAMED, start)


def _sign(req: Request, final: _Finalizer) -> None:
    """``--sign``: the output signed with the file's SHA-256 as computed beside the write (a directory's files
    hashed in parallel now, from the page cache)."""
    if req.sign is None:
        return
    signing.library()  # (imported while the output's hash finishes: the import holds the GIL, the hash doesn't)
    sha256 = final.digest()
    digests = {signing.SINGLE: sha256} if sha256 is not None and os.path.isfile(final.dst) else None
    final.signature = signing.sign(final.dst, req.sign, digests=digests).signature


def report(req: Request, ckpt: Checkpoint, out: Output, written: list[str], final: _Finalizer, streamed: bool,
           start: float) -> ConvertReport:
    """The ConvertReport: what was read, renamed, cast, kept, dropped and written."""
    dst, cast, sd = final.dst, out.cast, out.state_dict
    notes = out.notes + written
    if cast is not None and cast.infs_produced:
        notes.append(f"overflow: {cast.infs_produced} value(s) became inf in {', '.join(cast.overflow_keys)}")
    dropped = [] if out.kept else list(ckpt.extra)
    report_notes = ckpt.notes + _moved(req.plan, ckpt.stats.devices) + notes
    if dropped:
        report_notes.append(f"not written (state dict only): {', '.join(dropped)}; pass --keep-extra to keep them")
    return ConvertReport(
        src=req.src,
        dst=dst,
        format_in=ckpt.format,
        format_out=req.fmt_out,
        to=req.to,
        state_dict_key=ckpt.state_dict_key,
        ema_keys=ckpt.ema_keys,
        wrappers_before=ckpt.wrappers,
        wrappers_after=wrappers.detect_wrappers(sd.keys()),
        renamed=out.renamed,
        num_tensors=tensor_stats(sd, {}).num_tensors if out.dequantized else ckpt.stats.num_tensors,
        nbytes=_nbytes_out(ckpt, out),
        nbytes_in=ckpt.stats.nbytes,
        kept_extra=list(ckpt.extra) if out.kept else [],
        streamed=streamed,
        bytes_read=ckpt.stats.nbytes,
        bytes_written=final.size if locations.is_remote(dst) else _size_on_disk(dst),
        seconds=round(time.perf_counter() - start, 3),
        peak_rss=peak_rss_bytes(),
        sha256_in=lineage.source_sha256(req.src) if req.checksums else None,
        sha256_out=final.digest() if req.checksums else None,
        dtype_cast=cast.cast if cast is not None else None,
        notes=report_notes,
        signature=final.signature,
        quantized=out.quantized,
    )


def _moved(plan: DevicePlan, devices: dict[str, int]) -> list[str]:
    """``moved to cpu: 2 tensor(s) saved on cuda:0, 4 tensor(s) saved on cuda:1``: storages written for a device
    other than the one they were saved on, by target (none for a ``map_location`` function: its choice is its own)."""
    if plan.user_fn is not None:
        return []
    moved: dict[str, list[str]] = {}
    for tag, count in sorted(devices.items()):
        try:
            saved, target = normalise_device(tag), plan.target(tag)
        except DeviceError:
            continue
        if target != saved:
            moved.setdefault(target, []).append(f"{count} tensor(s) saved on {tag}")
    return [f"moved to {target}: {', '.join(parts)}" for target, parts in moved.items()]


def _size_on_disk(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)
