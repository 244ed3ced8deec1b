"""DeepSpeed ZeRO checkpoints (stages 1–3): where each fp32 master weight sits (``partitions``,
zero_to_fp32.py's rules as data) and the consolidation itself (``consolidate``). This module is the family's
interface: the verbs :mod:`ckptfix.formats` dispatches to.

May import: the layers below :mod:`ckptfix.formats`, its shared types (:mod:`ckptfix.formats.base`) and sibling families.
"""

from __future__ import annotations

from typing import Any

from ..base import RawRead, Reader
from ...parse.format_registry import TORCH_ZIP
from . import consolidate


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Any]:
    """The zip records of every file the read of ``path`` with ``select`` opens (:func:`.consolidate.files_read`),
    with their CRC-32s, for the torch read to be checked against."""
    return [m for file in consolidate.files_read(path, select) for m in part_members(file, TORCH_ZIP, None)]


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """The consolidated fp32 master weights, or rank 0's model_states file as it is (:func:`.consolidate.read`)."""
    return consolidate.read(path, plan, trust, select)
