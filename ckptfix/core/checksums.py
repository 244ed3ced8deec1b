"""CRC-32 (the zip polynomial) at memory speed: zlib-ng's, else ISA-L's, else the standard library's.

All three compute the same value (zip records, per-tensor digests); zlib-ng's and isal's run at ~17–20 GiB/s
here against zlib's ~4 GiB/s, and every record ckptfix reads or writes is checked with this one function.
:func:`crc32_combine` joins two ranges' CRC-32s without their bytes (and, XOR being its own inverse, splits
one off another: :func:`crc32_between`), so one pass over a record gives the CRC-32 of every range in it.
"""

from __future__ import annotations

from collections.abc import Callable

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
