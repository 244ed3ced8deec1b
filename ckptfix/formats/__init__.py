"""On-disk formats: sniff by content (never by extension), then read, describe or write through one registry.

Each format is declared once in :mod:`ckptfix.parse.format_registry` (its name, abilities and family);
this module dispatches to the family that implements it, imported by name only when a verb needs it:
``torchsave/`` (torch zip and legacy files), ``safetensors``, ``sharded`` (Hugging Face index + shards),
``dcp/`` (torch.distributed.checkpoint, Lightning sharded dirs), ``deepspeed/`` (ZeRO), ``torchscript``.
Every family exposes the same verbs (the :class:`~.base.Family` protocol, the only way they are called):
``read(path, fmt, plan, trust, select, read_part)`` and ``recorded_members(path, fmt, select, part_members)``
(the zip records a torch read goes through, to CRC-check; none for most), and where the registry says so
``describe(path, fmt, select, describe_part)`` (torch-free), ``write(obj, path, fmt, refs, archive, force)``,
``plan_write(obj, fmt, archive, keep_keys)`` (torch-free), ``dir_output(fmt)`` and, for a sharded format,
``write_shards``; ``read_part``/``describe_part``/``part_members`` read a member file (a shard, Lightning's
``meta.pt``) through this registry, so no family calls back up into it. A family knows bytes, not wrappers: it
returns the unpickled object with the saved device tag of every storage, or writes a state dict it is handed.
The types every family shares (:class:`~.base.RawRead`, :class:`~.base.StorageRef`, the protocol …) live
in :mod:`ckptfix.formats.base`.

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.safety`, :mod:`ckptfix.statedict`,
:mod:`ckptfix.errors`; a format module may import :mod:`.base` and its sibling families.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, cast

from ..core.atomic import DirOutput
from ..core.bytecopy import Recorded
from ..core.torch_free import NeedsTorch
from ..errors import ConversionError, FormatError
from ..parse import format_registry as registry
from ..parse.checkpoint_dirs import deepspeed_beside
from ..parse.format_registry import (DCP, DEEPSPEED, SAFETENSORS, SHARDED, SHARDED_PTH, SHARDED_SAFETENSORS,
                                     TORCH_LEGACY, TORCH_ZIP, TORCHSCRIPT)
from ..parse.sniff import resolve, sniff
from .base import Family, RawRead, WritePlan

__all__ = ["DCP", "DEEPSPEED", "SAFETENSORS", "SHARDED", "SHARDED_PTH", "SHARDED_SAFETENSORS", "TORCH_LEGACY",
           "TORCH_ZIP", "TORCHSCRIPT", "describe", "dir_output", "format_for_destination", "plan_write",
           "read", "recorded_members", "resolve", "sniff", "write", "write_sharded"]


def family(fmt: str) -> Family:
    """The module implementing ``fmt``, imported now (a conversion imports only the families it touches)."""
    return cast(Family, importlib.import_module(f"{__name__}.{registry.get(fmt).family}"))


def _as_read(path: str, fmt: str, select: str | None) -> str:
    """The format a read takes: a torch zip named as a DeepSpeed model_states file, optim_states files
    beside it, is read as DeepSpeed (its fp32 master weights) unless ``select`` names another entry."""
    if fmt == TORCH_ZIP and select in ("auto", None) and deepspeed_beside(path):
        return DEEPSPEED
    return fmt


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None = "auto") -> RawRead:
    """Read ``path`` (already sniffed as ``fmt``) with the device plan.

    With ``plan.is_meta`` nothing but structure is read, and ``refs`` says where each storage's
    bytes are, so a writer can copy them straight from the file. ``select`` matters to DeepSpeed
    checkpoints only: ``auto`` consolidates their fp32 master weights (also for a model_states file
    with its optim_states beside it), anything else reads the model_states file as it is.
    """
    fmt = _as_read(path, fmt, select)

    def read_part(part: str, part_fmt: str) -> RawRead:
        return read(part, part_fmt, plan, trust)

    return family(fmt).read(path, fmt, plan, trust, select, read_part)


def describe(path: str, fmt: str, select: str | None = "auto") -> RawRead:
    """The torch-free counterpart of ``read(path, fmt, DevicePlan('meta'), trust=False, select)``: tensors as
    :class:`~ckptfix.core.tensorinfo.TensorInfo`, torch never imported. Raises
    :class:`~ckptfix.core.torch_free.NeedsTorch` for a format or a file only torch describes exactly (the
    caller reads it with torch, whose answer, or refusal, is then the one given)."""
    fmt = _as_read(path, fmt, select)
    if not registry.get(fmt).describe:
        raise NeedsTorch(f"format {fmt}")
    return family(fmt).describe(path, fmt, select, describe)


def format_for_destination(dst: str, format: str | None, sharded: bool = False) -> str:
    """The output format: ``format`` (a ``--format`` name: pth/safetensors/dcp) if given, else by dst's
    extension (a sharded output, a directory, defaults to safetensors)."""
    if format is not None:
        spec = registry.by_write_name(format.lower().lstrip("."))
        if spec is None:
            raise FormatError(f"unknown output format {format!r}; choose {_names(registry.WRITE_NAMES, 'or')}")
        return spec.name
    if sharded:
        return SAFETENSORS
    ext = os.path.splitext(dst)[1].lower()
    spec = registry.by_extension(ext)
    if spec is None:
        files = [f for f in registry.FORMATS.values() if f.extensions]
        dirs = [f.write_names[0] for f in registry.FORMATS.values() if f.directory_output and f.write_names]
        raise FormatError(
            f"{dst}: can't tell the output format from the extension {ext or '(none)'!r}; for one file use "
            f"{' or '.join('/'.join(f.extensions) for f in files)} (or pass --format "
            f"{'|'.join(f.write_names[0] for f in files)}); for a directory pass --max-shard-size SIZE (e.g. 5GB: "
            f"Hugging Face shards)" + "".join(f" or --format {name}" for name in dirs)
        )
    return spec.name


def _names(names: tuple[str, ...], last: str) -> str:
    return ", ".join(names[:-1]) + f" {last} {names[-1]}"


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          force: bool = False) -> list[str]:
    """Write ``obj`` to ``path`` in ``fmt`` with torch; returns notes for the report.

    With ``refs`` (from a structure read) tensor bytes are copied from the source file in the kernel
    instead of being loaded; without, tensors are written from memory. A file format writes ``path``
    (the caller's atomic temp file); a directory format (DCP) writes the directory atomically itself,
    ``force`` replacing an existing one's files.
    """
    return family(fmt).write(obj, path, fmt, refs, archive, force)


def plan_write(obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan:
    """Plan writing TensorInfo values ``obj`` as ``fmt`` without torch; the caller writes the plan. Raises
    NeedsTorch (nothing written) for a format or a value only torch's writers reproduce. ``keep_keys``: the
    source's records are named by key (a torch zip), which the output keeps as the torch path does."""
    if not registry.get(fmt).write_without_torch:
        raise NeedsTorch(f"output format {fmt}")
    return family(fmt).plan_write(obj, fmt, archive, keep_keys)


def write_sharded(obj: Any, dst_dir: str, fmt: str, max_shard_size: int, force: bool = False,
                  refs: dict | None = None, torch_free: bool = False, keep_keys: bool = True) -> list[str]:
    """``obj`` as a Hugging Face sharded directory of ``fmt`` files (safetensors or torch zip shards): each
    shard planned by :func:`plan_write` (``torch_free``: TensorInfo values; NeedsTorch before the directory
    is touched) or written by :func:`write` with ``refs``."""
    sharded = _sharded_as(fmt)

    def plan_shard(part: Any, archive: str) -> WritePlan:
        if torch_free:
            return plan_write(part, fmt, archive, keep_keys)
        return WritePlan(lambda path: write(part, path, fmt, refs or None, archive))

    return family(sharded).write_shards(obj, dst_dir, sharded, max_shard_size, plan_shard, force, refs)


def recorded_members(path: str, fmt: str, select: str | None = "auto") -> list[Recorded]:
    """The zip records a torch read of ``path`` (with ``select``) goes through, each with the CRC-32 its zip
    records, so the caller can check them while torch reads (torch doesn't): a torch zip's, every torch zip
    shard's, a DeepSpeed checkpoint's files'; none for a family that names none (it has no CRC-32s, or reads
    them its own way)."""
    return family(fmt).recorded_members(path, fmt, select, recorded_members)


def dir_output(fmt: str, sharded: bool = False) -> DirOutput:
    """The files a directory output of ``fmt`` consists of (``sharded``: shards of ``fmt`` files and their
    index), all that ``force`` replaces; ConversionError for a format that is written as a file."""
    if sharded:
        fmt = _sharded_as(fmt)
    return family(fmt).dir_output(fmt)


def _sharded_as(fmt: str) -> str:
    try:
        return registry.sharded_as(fmt).name
    except KeyError:
        raise ConversionError(f"sharded output is safetensors or pth, not {fmt}") from None
