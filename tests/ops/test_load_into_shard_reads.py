"""What each rank of a sharded load_into reads of the file: about 1/world of it, in real gloo process groups on CPU
with 2 and 4 ranks (``/proc/self/io`` read_bytes, page cache dropped, and ``LoadReport.bytes_read``).

The byte counts use two 64 MiB weights, one copy of the files per rank, each rank opening the same
relative path in its own directory: like ranks on separate hosts, no rank's reads can warm another's page
cache, so each rank's count is its own. The bound allows the kernel's read-ahead (8 MiB on some virtual
disks): read()/pread() of a range add at most about two windows past it. Slicing through a default mmap
reads around every fault and can read most of the file on such a disk: read each range into the local
shard (``readinto``), or advise MADV_RANDOM / POSIX_FADV_RANDOM.

Each world size is one run of the ranks (tests/sharded_loads.py). ``reference_load``, the naive loader (every rank
reads the whole file), passes every check of tests/ops/test_load_into_sharded.py but not the byte bound:
``test_the_byte_bound_catches_a_loader_reading_everything`` proves that bound can fail.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sharded_loads import LOADERS, Run, case_id, ok_on_every_rank, once_per_world, run_ranks, write_formats
from tests.sharded_ranks import BIG, full_state_dict

WORLDS = (2, 4)
BYTE_FORMATS = ("torch", "safetensors", "hf-sharded", "dcp")
CONTROL_FORMATS = ("torch", "safetensors")  # reference_load's reads: a read() stream, and an mmap
MiB = 1 << 20
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="ranks forked from a forkserver; /proc/self/io")]


def write_big_checkpoints(root: Path, world: int) -> tuple[dict[str, Path], dict[str, int]]:
    """The 128 MiB model in each byte-count format, one copy per rank (``rank{r}/``), and each format's size.

    Each rank opens the same relative path in its own directory: like ranks on separate hosts, each reads
    its own copy, so one rank's reads can't warm another's page cache and each rank's count is its own."""
    (root / "src").mkdir()
    made = write_formats(full_state_dict(BIG), root / "src", "big", shard_size="100MB", formats=BYTE_FORMATS)
    relative, sizes = {}, {}
    for fmt in BYTE_FORMATS:
        src = made[fmt]
        relative[fmt] = Path(src.name)
        sizes[fmt] = sum(f.stat().st_size for f in src.rglob("*") if f.is_file()) if src.is_dir() else src.stat().st_size
        for rank in range(world):
            (root / f"rank{rank}").mkdir(exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copyfile)(src, root / f"rank{rank}" / src.name)
    shutil.rmtree(root / "src")
    os.sync()  # dirty pages can't be dropped: the ranks' posix_fadvise(DONTNEED) needs them written
    return relative, sizes


def readahead_bytes(path: Path) -> int | None:
    """The kernel's read-ahead window for the disk holding ``path``; None where reads don't reach a disk."""
    dev = os.stat(path).st_dev
    if os.major(dev) == 0:  # tmpfs, overlay: no block device, so /proc's read_bytes stays 0
        return None
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):
        if (queue / "read_ahead_kb").exists():
            return int((queue / "read_ahead_kb").read_text()) * 1024
    return 128 * 1024


@dataclass
class Bounds:
    """What a rank may read of a ``size``-byte checkpoint of ``tensors`` tensors, sharded ``world`` ways."""

    size: int
    world: int
    readahead: int | None
    tensors: int = 2

    @property
    def slack(self) -> int:  # 8 MiB + 5 %, plus what read-ahead can add at both ends of each tensor's range
        return 8 * MiB + self.size // 20 + 2 * (self.readahead or 0) * self.tensors

    @property
    def per_rank(self) -> int:
        return self.size // self.world + self.slack

    @property
    def total(self) -> int:
        return self.size + self.world * self.slack

    @property
    def counted(self) -> int:  # LoadReport.bytes_read counts tensor bytes: no read-ahead, no header
        return self.size // self.world + self.size // 20

    def os_level(self) -> None:
        if self.readahead is None:
            pytest.skip("the checkpoints sit on a filesystem without a block device: /proc read_bytes can't see reads")
        if self.per_rank >= self.size:
            pytest.skip(f"read-ahead of {self.readahead // 1024} KiB: the per-rank bound can't tell 1/{self.world} "
                        "of the file from all of it")


def bounds(run: Run, fmt: str, world: int) -> Bounds:
    """The bounds for ``fmt``'s file in ``run`` (the byte counts' run), sharded ``world`` ways."""
    return Bounds(run.sizes[fmt], world, run.readahead)


def make_byte_cases(big: dict[str, Path]) -> list[dict[str, Any]]:
    return [{"id": case_id("bytes", loader, fmt), "loader": loader, "model": "big", "path": big[fmt], "expected": BIG,
             "cold": True} for loader in LOADERS for fmt in (BYTE_FORMATS if loader != "reference" else CONTROL_FORMATS)]


@pytest.fixture(scope="module")
def byte_counts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Run]:
    """world → the outcome of the byte-count cases: the 128 MiB checkpoints, one copy per rank."""

    def run(world: int) -> Run:
        root = tmp_path_factory.mktemp(f"bytes-w{world}")
        big, sizes = write_big_checkpoints(root, world)
        try:
            return Run(run_ranks(make_byte_cases(big), world, root, cwd=[root / f"rank{r}" for r in range(world)]), sizes,
                       readahead_bytes(root))
        finally:
            for r in range(world):  # world × 512 MiB of copies, not left for pytest's next three sessions
                shutil.rmtree(root / f"rank{r}", ignore_errors=True)

    return once_per_world(run)


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
@pytest.mark.parametrize("loader", [name for name in LOADERS if name != "reference"])
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_reads_about_its_share_of_the_file(byte_counts: Callable[[int], Run], world: int, loader: str,
                                                     fmt: str) -> None:
    """Two 64 MiB weights under FSDP2: each rank's reads from disk (page cache dropped) stay within 1/world of
    the file plus read-ahead's slack, and so does what LoadReport.bytes_read counts."""
    run = byte_counts(world)
    ranks, bound = run("bytes", loader, fmt), bounds(run, fmt, world)
    ok_on_every_rank(ranks)
    counted = [r["report"]["bytes_read"] for r in ranks]
    assert all(r["local_bytes"] <= c <= bound.counted for r, c in zip(ranks, counted)), (counted, bound.counted)
    bound.os_level()
    reads = [r["read_bytes"] for r in ranks]
    assert max(reads) <= bound.per_rank and sum(reads) <= bound.total, (
        f"read {[f'{b / MiB:.1f}' for b in reads]} MiB of a {bound.size / MiB:.0f} MiB file; bounds "
        f"{bound.per_rank / MiB:.1f} per rank, {bound.total / MiB:.1f} in all")


@pytest.mark.parametrize("fmt", CONTROL_FORMATS)
@pytest.mark.parametrize("world", WORLDS)
def test_the_byte_bound_catches_a_loader_reading_everything(byte_counts: Callable[[int], Run], world: int, fmt: str) -> None:
    """The control: reference_load reads the whole file on every rank. It loads correctly, and every bound of
    the test above fails for it (so those bounds can fail)."""
    run = byte_counts(world)
    ranks, bound = run("bytes", "reference", fmt), bounds(run, fmt, world)
    ok_on_every_rank(ranks)
    assert all(r["report"]["bytes_read"] > bound.counted for r in ranks)
    bound.os_level()
    reads = [r["read_bytes"] for r in ranks]
    assert min(reads) > bound.per_rank and sum(reads) > bound.total, (reads, bound.per_rank, bound.total)
