"""ckptfix's digests and lineage in a torch zip it wrote: two stored records under the archive's folder,
``.ckptfix/digests.json`` (each ``data/KEY`` record's CRC-32, as the zip records it, and which storage each tensor
views) and ``.ckptfix/lineage.json`` (:mod:`ckptfix.safety.digests`), which ``torch.load`` never asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.tensorinfo import TensorInfo
from ...core.torch_free import NeedsTorch
from ...errors import CkptfixError
from ...safety import digests
from . import zip_describer, zipwriter


def records(archive: str, crcs: dict[str, int], names: dict[str, str]) -> list[tuple[str, bytes]]:
    """The digest record (from the zip's own CRC-32s, ``{record name: CRC-32}``, and each tensor's storage key)
    and the lineage record of the current write, for the zip whose folder is ``archive``."""
    prefix = f"{archive}/data/"
    storages = {name[len(prefix):]: crc for name, crc in crcs.items() if name.startswith(prefix)}
    out = [(f"{archive}/{digests.DIGESTS_RECORD}", digests.storages_entry(storages, names))]
    lineage = digests.lineage()
    if lineage is not None:
        out.append((f"{archive}/{digests.LINEAGE_RECORD}", lineage.encode("utf-8")))
    return out


def add(path: str) -> None:
    """Append :func:`records` to the finished ``torch.save`` file ``path``, the tensors' storage keys read back from
    its ``data.pkl`` (torch chose them)."""
    names = _described_keys(path)
    zipwriter.append(path, lambda crcs: records(next(iter(crcs)).split("/", 1)[0], crcs, names))


def _described_keys(path: str) -> dict[str, str]:
    """:func:`tensor_keys` of the file as ckptfix's describer reads it; {} where it can't (the digests then name
    storages only)."""
    try:
        obj = zip_describer.read_torch_zip(path).obj
    except (NeedsTorch, CkptfixError):
        return {}
    return tensor_keys(obj, lambda x: x.storage.key if type(x) is TensorInfo else None)


def tensor_keys(obj: Any, key_of: Callable[[Any], str | None]) -> dict[str, str]:
    """Each tensor's name (its keys from the top of ``obj``, dotted) → its storage's record key, ``key_of(value)``
    (None: not a tensor)."""
    found: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack:
        name, x = stack.pop()
        key = key_of(x)
        if key is not None:
            found.setdefault(name, key)
        elif isinstance(x, (dict, list, tuple)) and id(x) not in seen:
            seen.add(id(x))
            items = x.items() if isinstance(x, dict) else enumerate(x)
            stack.extend(reversed([(f"{name}.{k}" if name else str(k), v) for k, v in items]))
    return found
