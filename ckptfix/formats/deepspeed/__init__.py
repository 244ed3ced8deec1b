"""DeepSpeed ZeRO checkpoints (stages 1–3): where each fp32 master weight sits (``partitions``,
zero_to_fp32.py's rules as data) and the consolidation itself (``consolidate``). This module is the family's
interface: the verbs :mod:`ckptfix.formats` dispatches to.

May import: the layers below :mod:`ckptfix.formats` and the ``formats`` package itself.
"""

from __future__ import annotations

from typing import Any

from .. import RawRead, Reader
from . import consolidate


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """The consolidated fp32 master weights, or rank 0's model_states file as it is (:func:`.consolidate.read`)."""
    return consolidate.read(path, plan, trust, select)
