"""torch.distributed.checkpoint directories (``.metadata`` plus ``__R_S.distcp`` files): the directory
(``directory``), its chunks located, checked and copied (``chunks``), Lightning's sharded directories,
DCP files plus ``meta.pt`` (``lightning``), and the torch-free description (``dir_describer``). This module is
the family's interface: the verbs :mod:`ckptfix.formats` dispatches to.

May import: the layers below :mod:`ckptfix.formats`, its shared types (:mod:`ckptfix.formats.base`) and sibling families.
"""

from __future__ import annotations

from typing import Any

from ...core.atomic import DirOutput
from ..base import RawRead, Reader
from . import dir_describer, directory


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """The directory consolidated (:func:`.directory.read`); ``read_part`` reads a Lightning ``meta.pt``."""
    return directory.read(path, plan, trust, read_part)


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Any]:
    """None: a DCP read's records (inside the ``.distcp`` files) are not CRC-checked."""
    return []


def describe(path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead:
    """The directory described without torch (:func:`.dir_describer.describe`)."""
    return dir_describer.describe(path, describe_part)


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          force: bool = False) -> list[str]:
    """The directory ``path`` written by torch's own DCP writer (:func:`.directory.write`), atomically."""
    return directory.write(obj, path, force=force)


def dir_output(fmt: str) -> DirOutput:
    """The files a DCP output consists of: all that ``force`` replaces."""
    return directory.DIR_OUTPUT
