"""ckptfix's digests and lineage beside a DCP directory it wrote: DCP's files hold no place for them, so a sidecar,
``ckptfix.json`` (:mod:`ckptfix.safety.digests`): the CRC-32 of each storage item's byte range as the metadata
records it, computed once torch's writer is done (the bytes still in the page cache)."""

from __future__ import annotations

import os

from ...core.positional import crc32_range
from ...safety import digests


def add(directory: str) -> None:
    """Write the sidecar of the finished DCP directory ``directory`` (its ``.metadata`` just written by torch)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(directory).read_metadata().storage_data
    fds: dict[str, int] = {}
    items = []
    try:
        for index, info in storage.items():
            if info.relative_path not in fds:
                fds[info.relative_path] = os.open(os.path.join(directory, info.relative_path), os.O_RDONLY)
            offset = tuple(index.offset or ())  # (None: a value that is not a tensor, stored whole)
            name = f"{index.fqn}@{','.join(map(str, offset))}" if any(offset) else index.fqn
            crc = crc32_range(fds[info.relative_path], info.offset, info.length)
            items.append((name, info.relative_path, info.offset, info.length, crc))
    finally:
        for fd in fds.values():
            os.close(fd)
    with open(os.path.join(directory, digests.SIDECAR), "wb") as f:
        f.write(digests.sidecar_entry(items, digests.lineage()))
        f.flush()
        os.fsync(f.fileno())
