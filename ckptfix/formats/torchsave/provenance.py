"""ckptfix's digests and lineage in a torch zip it wrote: two stored records under the archive's folder,
``.ckptfix/digests.json`` (each ``data/KEY`` record's CRC-32, as the zip records it, and which storage each tensor
views) and ``.ckptfix/lineage.json`` (:mod:`ckptfix.safety.digests`), which ``torch.load`` never asks for."""

from __future__ import annotations

from typing import Any

from ...core.tensorinfo import TensorInfo
from ...core.torch_free import NeedsTorch
from ...errors import CkptfixError
from ...parse.zipdir import Directory
from ...safety import digests
from . import zip_describer, zipwriter


def add(path: str) -> None:
    """Append the digest record (and the lineage of the current write) to the finished torch zip ``path``. The
    CRC-32s are the ones its writer computed while copying (the zip's own); the tensor names come from its
    ``data.pkl``, read without torch."""
    names = _tensor_keys(path)

    def records(directory: Directory) -> list[tuple[str, bytes]]:
        root = directory.root
        prefix = f"{root}/data/"
        crcs = {e.name[len(prefix):]: e.crc for e in directory.entries if e.name.startswith(prefix)}
        out = [(f"{root}/{digests.DIGESTS_RECORD}", digests.storages_entry(crcs, names))]
        lineage = digests.lineage()
        if lineage is not None:
            out.append((f"{root}/{digests.LINEAGE_RECORD}", lineage.encode("utf-8")))
        return out

    zipwriter.append(path, records)


def _tensor_keys(path: str) -> dict[str, str]:
    """Each tensor's name (its keys from the top of the object, dotted) → its storage's record key; {} where
    ckptfix's describer can't read the pickle (the digests then name storages only)."""
    try:
        obj = zip_describer.read_torch_zip(path).obj
    except (NeedsTorch, CkptfixError):
        return {}
    found: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack:
        name, x = stack.pop()
        if type(x) is TensorInfo:
            found.setdefault(name, x.storage.key)
        elif isinstance(x, (dict, list, tuple)) and id(x) not in seen:
            seen.add(id(x))
            items = x.items() if isinstance(x, dict) else enumerate(x)
            stack.extend(reversed([(f"{name}.{k}" if name else str(k), v) for k, v in items]))
    return found
