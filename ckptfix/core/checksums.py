"""CRC-32 (the zip polynomial) at memory speed: zlib-ng's, else ISA-L's, else the standard library's.

All three compute the same value (zip records, per-tensor digests); zlib-ng's and isal's run at ~17–20 GiB/s
here against zlib's ~4 GiB/s, and every record ckptfix reads or writes is checked with this one function.
:func:`crc32_combine` joins two ranges' CRC-32s without their bytes (and, XOR being its own inverse, splits
one off another: :func:`crc32_between`), so one pass over a record gives the CRC-32 of every range in it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

Crc32 = Callable[..., int]
Combine = Callable[[int, int, int], int]

_POLY = 0xEDB88320  # the zip polynomial, bit-reversed


def _gf2_times(matrix: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def crc32_combine_gf2(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine`` in pure Python, the fallback (GF(2) matrices: ``crc1`` advanced over ``len2`` zero bytes, then
    XORed with ``crc2``), for the standard library's zlib, which doesn't expose it."""
    return _zero_shift(crc1 & 0xFFFFFFFF, max(len2, 0)) ^ (crc2 & 0xFFFFFFFF)


def _zero_shift(crc: int, nbytes: int) -> int:
    """``crc`` advanced over ``nbytes`` zero bytes (the linear part of the CRC: no pre/post conditioning)."""
    odd = [_POLY] + [1 << i for i in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while nbytes:
        even = _gf2_square(odd)  # the first pass: one zero byte
        if nbytes & 1:
            crc = _gf2_times(even, crc)
        nbytes >>= 1
        if not nbytes:
            break
        odd = _gf2_square(even)
        if nbytes & 1:
            crc = _gf2_times(odd, crc)
        nbytes >>= 1
    return crc


def _fastest() -> tuple[str, Crc32, Combine]:
    """The first CRC-32 implementation that imports, in order of speed, and its ``crc32_combine``."""
    try:
        from zlib_ng import zlib_ng

        return "zlib-ng", zlib_ng.crc32, zlib_ng.crc32_combine
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        return "isal", isal_zlib.crc32, isal_zlib.crc32_combine
    except ImportError:
        import zlib

        return "zlib", zlib.crc32, crc32_combine_gf2


CRC32_IMPLEMENTATION, crc32, crc32_combine = _fastest()


def crc32_between(crc_before: int, crc_through: int, nbytes: int) -> int:
    """The CRC-32 of the ``nbytes`` bytes between two CRC-32s chained from the same start: ``crc_before`` of the
    bytes up to them, ``crc_through`` of the same bytes and them (``crc32_combine`` is ``shift(c1) ^ c2``)."""
    return crc32_combine(crc_before, crc_through, nbytes)


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
