"""DCP chunk records that don't hold what ``.metadata`` says they make up: chunks that overlap and leave a
gap, a stride-0 record standing for a large tensor. Every path (the torch-free description, the streamed
copy, the torch read) refuses them; a conversion writes nothing.

The directories are real ``torch.distributed.checkpoint.save`` output (the fsdp2 fixture: two gloo ranks,
``fully_shard``), with ``.metadata`` or one record edited afterwards.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp

from ckptfix.cli import cli
from ckptfix.core import limits
from ckptfix.core.devices import DevicePlan
from ckptfix.errors import FormatError, LimitError
from ckptfix.formats import DCP, describe, read as formats_read
from ckptfix.formats.dcp.chunks import tiling_problem


def rewrite_metadata(path: Path, fn: Any) -> None:
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own file: trusted here
    fn(meta)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def move_chunk(fqn: str, old: list[int], new: list[int]) -> Any:
    """Declare ``fqn``'s chunk at ``old`` to lie at ``new`` (its record and the metadata both)."""

    def edit(meta: Any) -> None:
        chunk = next(c for c in meta.state_dict_metadata[fqn].chunks if list(c.offsets) == old)
        chunk.offsets = torch.Size(new)
        index = next(k for k in meta.storage_data if k.fqn == fqn and list(k.offset) == old)
        meta.storage_data[dataclasses.replace(index, offset=torch.Size(new))] = meta.storage_data.pop(index)

    return edit


def refused_everywhere(path: Path, tmp_path: Path, cli_runner: Any, error: type, message: str) -> None:
    """The torch-free description, the meta (streamed) and cpu reads, and convert to .safetensors and .pth."""
    with pytest.raises(error, match=message):
        describe(str(path), DCP)
    for plan in ("meta", "cpu"):
        with pytest.raises(error, match=message):
            formats_read(str(path), DCP, DevicePlan(plan), trust=False)
    for ext in (".safetensors", ".pth"):
        out = tmp_path / "out"
        out.mkdir()
        res = cli_runner.invoke(cli, ["convert", str(path), str(out / f"model{ext}"), "--select", "model"])
        assert res.exit_code == 1 and res.stdout == "", res.output
        assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("Error: "), res.stderr
        assert re.search(message, res.stderr), res.stderr
        assert list(out.iterdir()) == []
        out.rmdir()


@pytest.fixture
def fsdp2_copy(fixtures_dir: Path, tmp_path: Path) -> Path:
    """A scratch copy of the fsdp2 fixture directory (``model.0.weight`` [16, 13]: rows 0–7 on rank 0,
    8–15 on rank 1), to break."""
    return Path(shutil.copytree(fixtures_dir / "mlp_fsdp2", tmp_path / "ckpt"))


# --- chunks must tile each tensor exactly: no gap, no overlap ---

@pytest.mark.parametrize(("fqn", "old", "new", "message"), [
    ("model.0.weight", [8, 0], [4, 0],
     r"'model\.0\.weight'.* chunks \[0, 0\]\+\[8, 13\] and \[4, 0\]\+\[8, 13\] overlap"),
    ("model.0.bias", [8], [6], r"'model\.0\.bias'.* chunks \[0\]\+\[8\] and \[6\]\+\[8\] overlap"),
    ("model.2.weight", [16, 0], [16, 1], r"'model\.2\.weight' chunk \[16, 1\]\+\[16, 16\] falls outside its size"),
], ids=["rows-overlap-leaving-a-gap", "1d-overlap-leaving-a-gap", "outside"])
def test_chunks_that_overlap_and_leave_a_gap_are_refused(fsdp2_copy: Path, fixtures_dir: Path, tmp_path: Path,
                                                         cli_runner: Any, fqn: str, old: list[int], new: list[int],
                                                         message: str) -> None:
    rewrite_metadata(fsdp2_copy, move_chunk(fqn, old, new))
    # what torch's own loader does with it: the overlap read twice, the gap left as the target held it
    full = torch.load(fixtures_dir / "mlp_fsdp2_full.pth", weights_only=True)
    target = {"model": {k: torch.zeros(v.shape) for k, v in full.items()}}
    if fqn != "model.2.weight":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            tdcp.load(target, checkpoint_id=str(fsdp2_copy), no_dist=True)
        rows = target["model"][fqn.removeprefix("model.")]
        assert not rows[12:].any() if rows.ndim == 2 else not rows[14:].any()
    refused_everywhere(fsdp2_copy, tmp_path, cli_runner, FormatError, message)


def test_empty_chunks_still_tile(fsdp2_copy: Path) -> None:
    """FSDP2's empty shard of a 1-row tensor (``[1, 0]+[0, 32]``) is no gap, no overlap."""
    raw = formats_read(str(fsdp2_copy), DCP, DevicePlan("cpu"), trust=False)
    assert raw.obj["model"]["4.weight"].shape == (1, 32)
    assert describe(str(fsdp2_copy), DCP).obj["model"]["4.weight"].shape == (1, 32)


@pytest.mark.parametrize(("size", "chunks", "problem"), [
    ([4, 6], [([0, 0], [2, 3]), ([0, 3], [2, 3]), ([2, 0], [2, 3]), ([2, 3], [2, 3])], None),  # FSDP × TP
    ([4, 6], [([0, 0], [2, 3]), ([0, 3], [2, 3]), ([2, 0], [2, 3]), ([1, 3], [2, 3])], "overlap"),
    ([4, 6], [([0, 0], [2, 6]), ([3, 0], [1, 6])], "leave 6 of its"),
    ([], [([], [])], None),
    ([], [([], []), ([], [])], "overlap"),
    ([0, 5], [([0, 0], [0, 5]), ([0, 0], [0, 5])], None),  # empty chunks cover nothing
    ([4096, 8], [([0, i], [4096, 1]) for i in range(8)], None),  # Shard(1): swept along dim 1
], ids=["grid", "grid-overlap", "gap", "0-d", "0-d-twice", "empty", "columns"])
def test_tiling(size: list[int], chunks: list, problem: str | None) -> None:
    got = tiling_problem("w", size, chunks)
    assert got is None if problem is None else problem in str(got)


def test_tiling_many_chunks_is_quick() -> None:
    """Thousands of ranks' chunks are checked in about n log n, not pairwise."""
    import time

    start = time.perf_counter()
    for dim in (0, 1):
        chunks = [([i, 0], [1, 4]) if dim == 0 else ([0, i], [4, 1]) for i in range(20_000)]
        assert tiling_problem("w", [20_000, 4] if dim == 0 else [4, 20_000], chunks) is None
    assert time.perf_counter() - start < 5


# --- a record holding fewer bytes than its chunk stands for (stride 0): max_expand_bytes, as in a .pth ---

def expanded_dcp(path: Path, chunks: int) -> Path:
    """A real single-process DCP save of ``w`` (``chunks`` × 4 floats), then each chunk's record replaced by
    ``torch.zeros(1).expand(2**27)`` (4 bytes standing for 512 MiB) and ``.metadata`` sized to match."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tdcp.save({"w": torch.zeros(4 * chunks)}, checkpoint_id=str(path), no_dist=True)
    n = 2**27

    def edit(meta: Any) -> None:
        md = meta.state_dict_metadata["w"]
        (index, info), = ((k, v) for k, v in meta.storage_data.items() if k.fqn == "w")
        del meta.storage_data[index]
        template = md.chunks[0]
        md.size, md.chunks = torch.Size([n * chunks]), []
        for i in range(chunks):
            record = path / info.relative_path
            offset = record.stat().st_size
            with open(record, "ab") as f:
                torch.save(torch.zeros(1).expand(n), f)
            md.chunks.append(dataclasses.replace(template, offsets=torch.Size([i * n]), sizes=torch.Size([n])))
            meta.storage_data[dataclasses.replace(index, offset=torch.Size([i * n]))] = dataclasses.replace(
                info, offset=offset, length=record.stat().st_size - offset)

    rewrite_metadata(path, edit)
    assert sum(p.stat().st_size for p in path.iterdir()) < 100_000
    return path


@pytest.mark.parametrize("chunks", [1, 2], ids=["whole", "sharded"])
def test_stride_0_records_are_refused_as_a_pth_is(tmp_path: Path, cli_runner: Any, chunks: int) -> None:
    src = expanded_dcp(tmp_path / "ckpt", chunks)
    # the same expansion in a .pth: refused by the same limit
    torch.save({"w": torch.zeros(1).expand(2**27)}, tmp_path / "expanded.pth")
    out = tmp_path / "out"
    out.mkdir()
    res = cli_runner.invoke(cli, ["convert", str(tmp_path / "expanded.pth"), str(out / "model.safetensors")])
    assert res.exit_code == 1 and "max_expand_bytes" in res.stderr and list(out.iterdir()) == [], res.output
    out.rmdir()
    # torch-free: nothing read from a record, so nothing to refuse yet; the torch reads refuse
    assert describe(str(src), DCP).obj["w"].shape == (2**27 * chunks,)
    with pytest.raises(LimitError, match="'w'.*max_expand_bytes"):
        formats_read(str(src), DCP, DevicePlan("cpu"), trust=False)
    for ext in (".safetensors", ".pth"):
        out.mkdir()
        res = cli_runner.invoke(cli, ["convert", str(src), str(out / f"model{ext}")])
        assert res.exit_code == 1 and res.stdout == "", res.output
        assert len(res.stderr.splitlines()) == 1 and re.match(r"Error: .*'w'.*max_expand_bytes", res.stderr), res.stderr
        assert list(out.iterdir()) == []
        out.rmdir()
    with limits.override(max_expand_bytes=2**31):  # raised, it reads: the limit is what stopped it
        raw = formats_read(str(src), DCP, DevicePlan("meta" if chunks > 1 else "cpu"), trust=False)
        assert raw.obj["w"].shape == (2**27 * chunks,)
