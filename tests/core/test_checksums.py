"""CRC-32s of ranges without their bytes (core/checksums: ``crc32_combine``, its pure-Python fallback,
``crc32_between``) and of many ranges of a file from one pass over it (core/bytecopy.RangeCrcs), each against
the standard library's CRC-32 of the bytes themselves."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from ckptfix.core.bytecopy import RangeCrcs
from ckptfix.core.checksums import crc32_between, crc32_combine, crc32_combine_gf2

DATA = os.urandom(3 * 2**20 + 123)  # (past bytecopy's 1 MiB: runs read by pread and by a mapping)


@pytest.mark.parametrize("combine", [crc32_combine, crc32_combine_gf2])
@pytest.mark.parametrize(("n1", "n2"), [(0, 0), (7, 0), (0, 7), (1, 1), (1000, 65537)])
def test_combine_and_between_match_the_bytes(combine: object, n1: int, n2: int) -> None:
    a, b = DATA[:n1], DATA[n1 : n1 + n2]
    assert callable(combine) and combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)
    assert crc32_between(zlib.crc32(a), zlib.crc32(a + b), n2) == zlib.crc32(b)


#: whole, nested, overlapping, touching, repeated, empty, one byte, a run of its own beyond 1 MiB, a tiny one apart
RANGES = [(0, 2**20 + 5), (10, 20), (15, 100), (100, 50), (150, 7), (10, 20), (42, 0), (2**20 + 4, 1),
          (2**20 + 100, 2**21), (len(DATA) - 10, 3)]


def test_range_crcs_give_every_range_from_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    try:
        worker = RangeCrcs({"f": fd}, [("f", o, n) for o, n in RANGES] + [("f", len(DATA) - 2, 5)])
        assert [worker.result("f", o, n) for o, n in RANGES] == [zlib.crc32(DATA[o : o + n]) for o, n in RANGES]
        with pytest.raises(OSError, match="short read"):  # past the end: that range fails, the others don't
            worker.result("f", len(DATA) - 2, 5)
        worker.close()
    finally:
        os.close(fd)
