"""What a file's bytes are besides a checkpoint format: compressed (gzip, xz, bz2), or a pickle too.

torch.load reads no compressed file, yet a compressed pickle is one ``gunzip`` away from running; and a file
whose safetensors header length is also the start of a pickle (the header and the tensor bytes skipped by its
opcodes) reads as tensors to safetensors and runs under ``pickle.loads``. :mod:`ckptfix.parse.recognise` refuses
the second, :mod:`ckptfix.parse.sniff` names the first, and ``scan`` looks inside both.
"""

from __future__ import annotations

import io

from ..core import locations
from .pickle_walk import Walk, walk

#: the first bytes of a compressed file, and its compression
COMPRESSIONS = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"BZh": "bz2"}
#: how far into a remote file a pickle is followed (a local one: to its end)
_REMOTE_PICKLE_BYTES = 16 * 2**20


def compression(head: bytes) -> str | None:
    """The compression a file's first bytes name (gzip, xz, bz2), or None."""
    return next((kind for magic, kind in COMPRESSIONS.items() if head.startswith(magic)), None)


def pickle_prefix(path: str, remote: bool, head: bytes, size: int) -> Walk | None:
    """The pickle a safetensors file's bytes also are (pickle.loads reads from byte 0), when it runs past the
    8-byte header length: no header length spells one by chance ('{' at byte 8 is no opcode); else None."""
    stream = io.BytesIO(head)
    w = walk(stream, 0, "the file read as a pickle")
    if w.end is None and stream.tell() >= len(head) and size > len(head):  # still walking: follow it
        if remote:
            w = walk(locations.read_head(path, min(size, _REMOTE_PICKLE_BYTES))[0], 0, w.where)
        else:
            with locations.open_buffer(path) as buf:
                w = walk(buf, 0, w.where)
    return w if w.end is not None and w.end > 8 else None
