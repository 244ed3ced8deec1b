"""The files ``torch.save`` writes: the zip format (torch >= 1.6) and the legacy pickle stream. Read through
torch's own loader with ckptfix's restricted unpickler (``torch_io``), or record by record without loading
tensor data (``records``), or described without torch (``zip_describer``); written by ``torch.save``, by copying
records (``records``, ``zipwriter``; ``data.pkl`` for tensors on meta by ``meta_pickle``), or without torch
(``planner``, torch's globals stood in by ``torch_globals``); every output with ckptfix's digest and lineage
records (``digest_records``). This module is the family's interface: the verbs :mod:`ckptfix.formats` dispatches
to.

May import: the layers below :mod:`ckptfix.formats`, its shared types (:mod:`ckptfix.formats.base`) and sibling families.
"""

from __future__ import annotations

from typing import Any

from ...core import locations
from ...core.bytecopy import Recorded
from ...core.devices import NeedsValues
from ...core.torch_free import NeedsTorch
from ...parse.format_registry import get
from ...parse.zipdir import zip_directory
from ...safety.scanner import ensure_safe
from ..base import RawRead, Reader, WritePlan
from . import digest_records, planner, records, torch_io, zip_describer


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """The file as it is (:func:`read_file`)."""
    return read_file(path, fmt, plan, trust)


def read_file(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    """A torch zip or legacy file as it is (:func:`_read_file`), with a note where its zip records no CRC-32s."""
    raw = _read_file(path, fmt, plan, trust)
    raw.notes = raw.notes + crc_notes(path, fmt)
    return raw


def crc_notes(path: str, fmt: str) -> list[str]:
    """The line saying a torch zip's records carry no CRC-32 to check (torch's CRC-less saves), if so: every read
    says it, whichever reader ran, so a convert's report does."""
    if not get(fmt).zip:
        return []
    try:
        note = zip_directory(path).crc_note(path)
    except (OSError, ValueError):  # (the read itself reports an unreadable zip)
        return []
    return [note] if note else []


def _read_file(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    """On meta, a zip's structure record by record (tensors on meta,
    ``refs`` saying where each storage's bytes are); a local zip with storages bound for a GPU, those read through
    staging windows (:func:`.records.read_onto`); else through ``torch.load``. A structure read of tensors torch
    can't build on meta (quantized, nested: :class:`NeedsValues`) reads them on the CPU, mapped; a staged read of
    them goes through ``torch.load``."""
    if get(fmt).zip and not trust and (plan.is_meta or plan.reaches_gpu() and not locations.is_remote(path)):
        ensure_safe(path, fmt, unpickled_by_caller="data.pkl", placeholders=True)  # read_structure checks data.pkl itself
        try:
            raw = records.read_structure(path) if plan.is_meta else records.read_onto(path, plan)
            if raw is not None:  # (None: no storage bound for a GPU)
                return raw
        except NeedsTorch:
            pass
        except NeedsValues:
            plan = plan.values_instead()
    try:
        return torch_io.read(path, fmt, plan, trust)
    except NeedsValues:
        return torch_io.read(path, fmt, plan.values_instead(), trust)


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Recorded]:
    """Every ``data/KEY`` record of a torch zip with its recorded CRC-32 (:func:`.records.data_members`); none
    for a legacy file (no CRC-32s)."""
    return records.data_members(path) if get(fmt).zip else []


def describe(path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead:
    """A torch zip as TensorInfo, without torch (:func:`.zip_describer.read_torch_zip`)."""
    raw = zip_describer.read_torch_zip(path)
    raw.notes = raw.notes + crc_notes(path, fmt)
    return raw


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          force: bool = False) -> list[str]:
    """A torch zip: records copied from their source file when ``refs`` (a structure read) says where,
    else ``torch.save``."""
    if refs:
        records.write_structure(obj, refs, path, location=lambda _tag: "cpu", archive=archive)
        return []
    notes = torch_io.write(obj, path)
    digest_records.add(path)  # (the tensors' storage keys read back from the file: torch.save chose them)
    return notes


def plan_write(obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan:
    """A torch zip of TensorInfo values, planned without torch (:func:`.planner.plan_write`)."""
    return planner.plan_write(obj, archive, keep_keys)
