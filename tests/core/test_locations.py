"""ckptfix/core/locations.py and positional.py: header-only reads of local files, and the block cache's ranges."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.core import locations
from ckptfix.core import positional
from ckptfix.core.positional import BLOCK, ByteSource
from ckptfix.errors import FormatError
from tests.page_cache import drop_from_page_cache, resident_bytes


@pytest.fixture(scope="module")
def big_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 260 MiB torch zip of 100 tensors, written by torch.save."""
    path = tmp_path_factory.mktemp("big") / "big.pth"
    torch.save({f"layer{i}.weight": torch.full((680_000,), float(i)) for i in range(100)}, path)
    return path


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop the file's pages")
@pytest.mark.parametrize("verb", ["describe", "scan"])
def test_cold_local_inspect_reads_headers_only(big_zip: Path, verb: str) -> None:
    """A cold inspect (and scan) of a 260 MiB zip pulls at most 2 MiB into the page cache (the mmap-based reading
    before pulled the whole file: 260 MiB)."""
    drop_from_page_cache(big_zip)
    if resident_bytes(big_zip) > 64 * 1024:
        pytest.skip("this file system keeps the file's pages (DONTNEED ignored)")
    if verb == "describe":
        info = ckptfix.describe(big_zip)
        assert info.num_tensors == 100 and info.nbytes == 100 * 680_000 * 4
    else:
        from ckptfix.safety.scanner import scan

        report = scan(big_zip, check_crc=False)  # (with the CRCs, a scan reads everything on purpose)
        assert report.ok
    assert resident_bytes(big_zip) <= 2 * 2**20


class _Counting(ByteSource):
    """A source over bytes that records each fetch (offset, n)."""

    def __init__(self, data: bytes):
        super().__init__()
        self.name, self.size, self.data, self.fetches = "mem", len(data), data, []

    def _fetch(self, offset: int, n: int) -> bytes:
        self.fetches.append((offset, n))
        return self.data[offset : offset + n]


def test_range_buffer_slices_like_bytes_and_fetches_each_block_once() -> None:
    data = bytes(range(256)) * (BLOCK // 64)  # 4 blocks
    source = _Counting(data)
    buf = locations.RangeBuffer(source)
    assert len(buf) == len(data)
    for a, b in [(0, 10), (BLOCK - 3, BLOCK + 5), (3 * BLOCK - 1, 4 * BLOCK + 99), (-20, None), (5, 5)]:
        assert buf[a:b] == data[a:b]
    assert buf[BLOCK + 7] == data[BLOCK + 7] and buf[-1] == data[-1]
    assert source.bytes_fetched == len(data)  # every block once, however often sliced
    window = locations.window(buf, BLOCK + 10, 100)
    assert len(window) == 100 and window[0:100] == data[BLOCK + 10 : BLOCK + 110] and window[99] == data[BLOCK + 109]


def test_prefetch_fetches_runs_of_missing_blocks_once() -> None:
    data = os.urandom(10 * BLOCK)
    source = _Counting(data)
    locations.prefetch(locations.RangeBuffer(source), [(0, 10), (BLOCK + 5, 10), (5 * BLOCK, 2 * BLOCK), (9 * BLOCK, 1)])
    assert sorted(source.fetches) == [(0, 2 * BLOCK), (5 * BLOCK, 2 * BLOCK), (9 * BLOCK, BLOCK)]
    source.fetches.clear()
    assert source.read(BLOCK, 10) == data[BLOCK : BLOCK + 10] and source.fetches == []


PART = 4 * BLOCK


@pytest.mark.parametrize("offset,n", [(0, 0), (3, 10), (0, 3 * PART + 5), (PART - 1, PART + 2)])
def test_read_into_fills_the_buffer_in_parts_around_the_cache(offset: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(positional, "PART", PART)
    data = os.urandom(4 * PART)
    source = _Counting(data)
    out = bytearray(n)
    source.read_into(offset, memoryview(out))
    assert bytes(out) == data[offset : offset + n]
    assert source.bytes_fetched == n and not source._blocks  # each byte fetched once, nothing cached
    assert all(size <= positional.PART for _o, size in source.fetches)


def test_read_into_past_the_end_is_refused_before_fetching() -> None:
    source = _Counting(os.urandom(100))
    with pytest.raises(FormatError, match="truncated"):
        source.read_into(50, memoryview(bytearray(51)))
    assert source.fetches == []
