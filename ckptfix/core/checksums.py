"""CRC-32 (the zip polynomial) at memory speed: zlib-ng's, else ISA-L's, else the standard library's.

All three compute the same value (zip records, per-tensor digests); zlib-ng's and isal's run at ~17–20 GiB/s
here against zlib's ~4 GiB/s, and every record ckptfix reads or writes is checked with this one function.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

Crc32 = Callable[..., int]


def _fastest() -> tuple[str, Crc32]:
    """The first CRC-32 implementation that imports, in order of speed."""
    try:
        from zlib_ng import zlib_ng

        return "zlib-ng", zlib_ng.crc32
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        return "isal", isal_zlib.crc32
    except ImportError:
        import zlib

        return "zlib", zlib.crc32


CRC32_IMPLEMENTATION, crc32 = _fastest()


def crc32_combine_portable(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine`` where the module lacks it: the CRC-32 of ``len2`` zero bytes from ``crc1`` is affine
    in ``crc1``, so its linear part applied to ``crc1``, XOR ``crc2``, is the CRC-32 of the two runs joined."""
    zeros = bytes(len2)
    return crc32(zeros, crc1) ^ crc32(zeros) ^ crc2


def _combiner() -> Callable[[int, int, int], int]:
    """The fastest module's ``crc32_combine`` (C), else :func:`crc32_combine_portable`."""
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32_combine
    except (ImportError, AttributeError):
        pass
    try:
        from isal import isal_zlib

        return isal_zlib.crc32_combine
    except (ImportError, AttributeError):
        return crc32_combine_portable


#: ``crc32_combine(crc1, crc2, len2)``: the CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``
crc32_combine = _combiner()


class Tally:
    """CRC-32s of chunks of files, taken by a pass that reads every byte anyway (a load's NaN/Inf check), while
    each chunk is in cache; :meth:`crc` joins those inside a range (``crc32_combine``), reading only its gaps.
    Threads may :meth:`add` at once (one dict store each, under the GIL)."""

    def __init__(self) -> None:
        self.chunks: dict[str, dict[int, tuple[int, int]]] = {}  # file -> offset -> (CRC-32, length)
        self._order: dict[str, list[int]] = {}  # file -> its chunks' offsets, sorted

    def add(self, name: str, offset: int, data: Any) -> None:
        """Record the CRC-32 of ``data`` (bytes-like), the bytes of file ``name`` from ``offset``."""
        size = memoryview(data).nbytes
        if size:
            self.chunks.setdefault(name, {})[offset] = (crc32(data), size)

    def crc(self, name: str, offset: int, size: int, read: Callable[[int, int], int]) -> int:
        """CRC-32 of ``name[offset : offset + size]``: the chunks recorded inside it that tile it from its start,
        in order; each gap's CRC-32 from ``read(offset, length)`` (a second read of those bytes only)."""
        chunks = self.chunks.get(name, {})
        if name not in self._order or len(self._order[name]) != len(chunks):  # (sorted once per file, not per range)
            self._order[name] = sorted(chunks)
        order = self._order[name]
        end, at, value = offset + size, offset, 0
        for start in order[bisect.bisect_left(order, offset) : bisect.bisect_left(order, end)]:
            crc, length = chunks[start]
            if start < at or start + length > end:
                continue  # overlaps what is joined already, or runs past the range: its bytes are read instead
            if start > at:
                value = crc32_combine(value, read(at, start - at), start - at)
            value, at = crc32_combine(value, crc, length), start + length
        if at < end:
            value = crc32_combine(value, read(at, end - at), end - at)
        return value
