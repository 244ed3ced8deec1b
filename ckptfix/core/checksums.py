"""CRC-32 (the zip polynomial) at memory speed: zlib-ng's, else ISA-L's, else the standard library's.

All three compute the same value (zip records, per-tensor digests); zlib-ng's and isal's run at ~17–20 GiB/s
here against zlib's ~4 GiB/s, and every record ckptfix reads or writes is checked with this one function.
"""

from __future__ import annotations

from collections.abc import Callable

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
