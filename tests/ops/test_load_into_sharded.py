"""load_into on DTensor-sharded models, in real gloo process groups on CPU with 2 and 4 ranks.

The models: FSDP2 ``fully_shard`` (built on CPU, or on meta then ``to_empty``), tensor parallel
(``parallelize_module``: ColwiseParallel, RowwiseParallel), and ``distribute_tensor`` placements (Shard(0),
Shard(1), Replicate, on a 1-D and a 2-D mesh), with fp32, bf16, fp16 and integer tensors, uneven dim-0
shards and shards left empty (fewer rows than ranks). The checkpoints: torch zip, safetensors, a Hugging
Face sharded directory and DCP directories (ckptfix's and torch's own writers), plus the real DDP and
FSDP2 fixtures (``module.`` keys; ``{"model", "optim"}`` saved by two FSDP2 ranks).

Every rank checks, bit for bit, that its local shard equals its slice of the full tensor
(``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()``); a failing load raises
ckptfix's error on every rank and leaves every rank's tensors as they were; each rank reads about
1/world of the file (``/proc/self/io`` read_bytes, page cache dropped, and ``LoadReport.bytes_read``).

The byte counts use two 64 MiB weights, one copy of the files per rank, each rank opening the same
relative path in its own directory: like ranks on separate hosts, no rank's reads can warm another's page
cache, so each rank's count is its own. The bound allows the kernel's read-ahead (8 MiB on some virtual
disks): read()/pread() of a range add at most about two windows past it. Slicing through a default mmap
reads around every fault and can read most of the file on such a disk: read each range into the local
shard (``readinto``), or advise MADV_RANDOM / POSIX_FADV_RANDOM.

Each world size is one run of the ranks (tests/dist_harness.py), every case in turn, and one more for the
byte counts; the tests read their outcomes. ``LOADERS`` names the loaders under test: ckptfix's, and
``reference_load``, the naive loader (every rank reads the whole file, repairs the keys by hand and keeps
its slice), which passes every check here except the byte bound:
``test_the_byte_bound_catches_a_loader_reading_everything`` proves that bound can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import CkptfixError, LoadError
from tests import dist_harness, sharded_ranks
from tests.sharded_ranks import BIG, MODELS, full_state_dict

WORLDS = (2, 4)
FORMATS = ("torch", "safetensors", "hf-sharded", "dcp", "dcp-torch")
BYTE_FORMATS = ("torch", "safetensors", "hf-sharded", "dcp")
CONTROL_FORMATS = ("torch", "safetensors")  # reference_load's reads: a read() stream, and an mmap
#: the failures of issue 18 item 5, each in every format: what breaks, and the key its message must name
FAILURES = {"shape": "c.weight", "missing": "c.bias", "nan": "b.weight", "truncated": None}
MiB = 1 << 20
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks forked from a forkserver; /proc/self/io")


def ckptfix_load(model: Any, path: Any, **kwargs: Any) -> Any:
    """The API under test, called on every rank of the default process group."""
    return ckptfix.load_into(model, path, **kwargs)


@dataclass
class ReferenceReport:
    """The fields of ckptfix's LoadReport that the checks read."""

    fix: str | None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0


def read_whole(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with torch's and safetensors' own readers."""
    from safetensors.torch import load_file

    if (path / ".metadata").exists():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(str(path))
        sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
              for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        dcp.load(sd, storage_reader=reader, no_dist=True)
        return sd
    if (path / "model.safetensors.index.json").exists():
        shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(path / shard)).items()}
    if path.is_dir():
        return load_file(str(path / "model.safetensors"))
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def reference_load(model: Any, path: Any, strict: bool = True, strict_values: bool = False) -> ReferenceReport:
    """The naive sharded load: the whole file on every rank, keys repaired by hand, each rank's slice copied.

    Every check runs before the first copy and sees every tensor, so every rank decides alike."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.tensor import DTensor, distribute_tensor

    try:
        sd = read_whole(Path(path))
    except (Exception, CheckpointException) as e:
        raise LoadError(f"{path}: can't be read ({type(e).__name__}: {e})") from e
    own = model.state_dict()
    fix = None
    if not all(k.startswith("model.") for k in own) and any(k.startswith("model.") for k in sd):
        sd, fix = {k[6:]: v for k, v in sd.items() if k.startswith("model.")}, "select model"
    if not any(k.startswith("module.") for k in own) and sd and all(k.startswith("module.") for k in sd):
        sd, fix = {k[7:]: v for k, v in sd.items()}, "strip module."
    missing, unexpected = sorted(own.keys() - sd.keys()), sorted(sd.keys() - own.keys())
    if strict and (missing or unexpected):
        raise LoadError(f"{path}: does not load into the model; missing: {missing}; unexpected: {unexpected}")
    shapes = [k for k in own.keys() & sd.keys() if own[k].shape != sd[k].shape]
    if shapes:
        raise LoadError(f"{path}: shape mismatch: {sorted(shapes)}")
    on_meta = [k for k, t in own.items() if t.device.type == "meta"]
    if on_meta:
        raise LoadError(f"{path}: the model's tensors are on the meta device: {on_meta}; call model.to_empty first")
    bad = sorted(k for k in own.keys() & sd.keys() if sd[k].is_floating_point() and not bool(sd[k].isfinite().all()))
    if bad and strict_values:
        raise LoadError(f"{path}: {bad} hold NaN/Inf values; nothing was loaded")
    with torch.no_grad():
        for k in own.keys() & sd.keys():
            t, full = own[k], sd[k].to(own[k].dtype)
            t.copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None) if isinstance(t, DTensor)
                    else full)
    return ReferenceReport(fix, missing, unexpected, sum(v.nbytes for v in sd.values()))


LOADERS: dict[str, Callable[..., Any]] = {"ckptfix": ckptfix_load, "reference": reference_load}


def run_cases(rank: int, world: int, payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each rank runs (dist_harness's target): every case, with these LOADERS."""
    return sharded_ranks.run_cases(payload["cases"], world, LOADERS)


# ---- in pytest: the files, one run of the ranks per world size, the checks ---------------------------------


def write_formats(sd: dict[str, torch.Tensor], root: Path, name: str, shard_size: int | str = 64,
                  formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """``sd`` in every format: torch.save, safetensors' save_file, ckptfix's HF shards and DCP, torch's DCP."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    paths = {"torch": root / f"{name}.pth", "safetensors": root / f"{name}.safetensors", "hf-sharded": root / f"{name}-hf",
             "dcp": root / f"{name}-dcp", "dcp-torch": root / f"{name}-dcp-torch"}
    torch.save(sd, paths["torch"])
    save_file(sd, str(paths["safetensors"]))
    ckptfix.convert(paths["torch"], paths["hf-sharded"], max_shard_size=shard_size)
    ckptfix.convert(paths["torch"], paths["dcp"], format="dcp")
    if "dcp-torch" in formats:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(sd, checkpoint_id=str(paths["dcp-torch"]), no_dist=True)
    return {fmt: paths[fmt] for fmt in formats}


def cut_short(path: Path) -> None:
    """Truncate a file, or a directory's last data file, to 60 %."""
    data = [f for f in sorted(path.iterdir()) if f.suffix in (".safetensors", ".distcp")] if path.is_dir() else [path]
    with open(data[-1], "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) * 6 // 10)


def write_checkpoints(root: Path, fixtures: Path) -> dict[str, Any]:
    """family or failure → format → path (and ``expected``: what the full tensors are)."""
    from safetensors.torch import save_file

    files: dict[str, Any] = {}
    for family in ("mixed", "tp", "placed"):
        files[family] = {**write_formats(full_state_dict(family), root, family), "expected": family}
    broken = {"shape": {"c.weight": torch.randn(2, 5, dtype=torch.float16)}, "missing": {}, "nan": {}, "truncated": {}}
    for failure, change in broken.items():
        sd = {**full_state_dict("mixed"), **change}
        if failure == "missing":
            del sd["c.bias"]
        if failure == "nan":
            sd["b.weight"] = sd["b.weight"].clone()
            sd["b.weight"][-1, 3] = float("nan")  # in the shard of the last rank holding rows only
        files[failure] = write_formats(sd, root, failure)
    for path in files["truncated"].values():
        cut_short(path)
    ddp = torch.load(fixtures / "mlp_ddp.pth", weights_only=True)
    save_file(ddp, str(root / "ddp.safetensors"))
    torch.save({k.removeprefix("module."): v for k, v in ddp.items()}, root / "ddp-expected.pt")
    from tests import fsdp2_dirs

    files["dcp-cols"] = fsdp2_dirs.make(root / "fsdp2", variants=("cols",), optim=False)["cols"]
    files["dcp-cols-expected"] = root / "dcp-cols-expected.pt"
    torch.save({k.removeprefix("model."): v for k, v in read_whole(files["dcp-cols"]).items()},
               files["dcp-cols-expected"])
    files["real"] = {"ddp-torch": fixtures / "mlp_ddp.pth", "ddp-safetensors": root / "ddp.safetensors",
                     "fsdp2-dcp": fixtures / "mlp_fsdp2"}
    files["real-expected"] = {"ddp-torch": root / "ddp-expected.pt", "ddp-safetensors": root / "ddp-expected.pt",
                              "fsdp2-dcp": fixtures / "mlp_fsdp2_full.pth"}
    return files


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


@dataclass
class Run:
    """Each case's outcome on every rank (``run("load", loader, model, fmt)``); for the byte counts, each
    format's size and the disk's read-ahead."""

    cases: dict[str, list[dict[str, Any]]]
    sizes: dict[str, int] = field(default_factory=dict)
    readahead: int | None = None

    def __call__(self, *parts: Any) -> list[dict[str, Any]]:
        return self.cases[case_id(*parts)]

    def bounds(self, fmt: str, world: int) -> Bounds:
        return Bounds(self.sizes[fmt], world, self.readahead)


def case_id(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def make_cases(files: dict[str, Any], world: int) -> list[dict[str, Any]]:
    cases = []
    for loader in LOADERS:
        for model, family in MODELS.items():
            if model != "dtensor-2d" or world == 4:
                cases += [{"id": case_id("load", loader, model, fmt), "loader": loader, "model": model,
                           "path": files[family][fmt], "expected": family} for fmt in FORMATS]
        cases += [{"id": case_id("real", loader, fmt), "loader": loader, "model": "fsdp2-mlp", "path": path,
                   "expected": files["real-expected"][fmt]} for fmt, path in files["real"].items()]
        cases += [{"id": case_id("fail", loader, failure, fmt), "loader": loader, "model": "fsdp2",
                   "path": files[failure][fmt], "kwargs": {"strict_values": True}} for failure in FAILURES for fmt in FORMATS]
        cases += [{"id": case_id("meta", loader, fmt), "loader": loader, "model": "fsdp2-meta-bare",
                   "path": files["mixed"][fmt], "expected": "mixed"} for fmt in FORMATS]
        cases += [{"id": case_id("meta-forward", loader, fmt), "loader": loader, "model": "fsdp2-meta-mlp-bare",
                   "path": files["real"][fmt], "expected": files["real-expected"][fmt], "forward": True}
                  for fmt in ("ddp-torch", "ddp-safetensors")]
        cases += [{"id": case_id("meta-cpu", loader), "loader": loader, "model": "fsdp2-meta-bare",
                   "path": files["mixed"]["safetensors"], "expected": "mixed", "kwargs": {"map_location": "cpu"}}]
        cases += [{"id": case_id("dcp-cols", loader), "loader": loader, "model": "fsdp2-dcp-net",
                   "path": files["dcp-cols"], "expected": files["dcp-cols-expected"]}]
        cases += [{"id": case_id("meta-fail", loader, failure, fmt), "loader": loader, "model": "fsdp2-meta-bare",
                   "path": files[failure][fmt]} for failure in ("shape", "missing") for fmt in ("torch", "safetensors")]
    return cases


def make_byte_cases(big: dict[str, Path]) -> list[dict[str, Any]]:
    return [{"id": case_id("bytes", loader, fmt), "loader": loader, "model": "big", "path": big[fmt], "expected": BIG,
             "cold": True} for loader in LOADERS for fmt in (BYTE_FORMATS if loader != "reference" else CONTROL_FORMATS)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Callable[[int], Run]:
    """world → the outcome of every case on every rank (not the byte counts); one run of the ranks per world size."""
    files = write_checkpoints(tmp_path_factory.mktemp("checkpoints"), fixtures_dir)
    return once_per_world(lambda world: Run(run_ranks(make_cases(files, world), world, tmp_path_factory.mktemp(f"w{world}"))))


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


def run_ranks(cases: list[dict[str, Any]], world: int, root: Path, cwd: list[Path] | None = None) -> dict[str, list[dict]]:
    per_rank = dist_harness.run("tests.ops.test_load_into_sharded:run_cases", world, root / "run", {"cases": cases}, timeout=400,
                                cwd=cwd)
    return {cid: [r[cid] for r in per_rank] for cid in per_rank[0]}


def once_per_world(make: Callable[[int], Run]) -> Callable[[int], Run]:
    """``make(world)`` run at most once per world size, when a test first asks; a failed run fails each test that asks."""
    runs: dict[int, Run | dist_harness.RankFailure] = {}

    def get(world: int) -> Run:
        if world not in runs:
            try:
                runs[world] = make(world)
            except dist_harness.RankFailure as e:
                runs[world] = e
        run = runs[world]
        if isinstance(run, dist_harness.RankFailure):
            pytest.fail(str(run), pytrace=False)
        return run

    return get


def ok_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert res["outcome"] == "ok", f"rank {rank}: {res.get('type', '')} {res['message']}\n{res['traceback']}"
        assert res["wrong"] == [], (f"rank {rank}: local shards differ from the full tensors' slices: {res['wrong']}"
                                    if res["wrong"] else f"rank {rank}: tensors left on meta: {res['on_meta']}")
        assert not res["report"]["missing"] and not res["report"]["unexpected"], f"rank {rank}: {res['report']}"


LOAD_CASES = [pytest.param(world, loader, model, fmt, id=f"w{world}-{loader}-{model}-{fmt}")
              for world in WORLDS for loader in LOADERS for model in MODELS for fmt in FORMATS
              if model != "dtensor-2d" or world == 4]


@pytest.mark.parametrize(("world", "loader", "model", "fmt"), LOAD_CASES)
def test_each_rank_holds_its_slice_of_the_full_tensor(outcomes: Callable[[int], Run], world: int, loader: str,
                                                      model: str, fmt: str) -> None:
    ranks = outcomes(world)("load", loader, model, fmt)
    ok_on_every_rank(ranks)
    assert all(r["sharded"] for r in ranks)  # the model really holds DTensors
    if model != "fsdp2-meta":  # to_empty's memory is whatever it was: it may already hold a shard's bytes
        assert all(r["changed"] for r in ranks)
    assert any(r["empty"] for r in ranks), "no rank was left an empty shard"


@pytest.mark.parametrize("fmt", ["ddp-torch", "ddp-safetensors", "fsdp2-dcp"])
@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("world", WORLDS)
def test_real_ddp_and_fsdp2_checkpoints_load_into_fsdp2(outcomes: Callable[[int], Run], world: int, loader: str,
                                                        fmt: str) -> None:
    """fixtures/mlp_ddp.pth (real DDP: ``module.`` keys, repaired as for a plain model) and fixtures/mlp_fsdp2 (real
    FSDP2 ranks' DCP of ``{"model", "optim"}``: the model's part)."""
    ranks = outcomes(world)("real", loader, fmt)
    ok_on_every_rank(ranks)
    if fmt.startswith("ddp"):
        assert {r["report"]["fix"] for r in ranks} == {"strip module."}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("world", WORLDS)
def test_a_failure_raises_on_every_rank_and_changes_nothing(outcomes: Callable[[int], Run], world: int, loader: str,
                                                            failure: str, fmt: str) -> None:
    """Each breaks a tensor after others that load fine: shape: c.weight [2, 5] for [1, 5]; missing: c.bias
    (strict); nan: one element of b.weight's last row (in one rank's shard only; strict_values); truncated: the
    file, or the directory's last data file, cut to 60 %."""
    ranks = outcomes(world)("fail", loader, failure, fmt)
    for rank, res in enumerate(ranks):
        assert res["outcome"] == "raised", f"rank {rank} loaded it: {res.get('report')}"
        wanted = LoadError if failure != "truncated" else CkptfixError
        assert res["load_error" if wanted is LoadError else "ckptfix_error"], (
            f"rank {rank}: {res['type']}, not a {wanted.__name__}:\n{res['traceback']}")
        assert (FAILURES[failure] or "") in res["message"], f"rank {rank}: the message names no key: {res['message']}"
        assert Path(res["path"]).name in res["message"], f"rank {rank}: the message names no file: {res['message']}"
        assert "Error(s) in loading state_dict" not in res["message"], res["message"]
        assert res["changed"] == [], f"rank {rank} left half-loaded: {res['changed']} changed"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", WORLDS)
def test_an_fsdp2_model_whose_shards_are_on_meta_is_materialised_and_filled(outcomes: Callable[[int], Run], world: int,
                                                                           fmt: str) -> None:
    """FSDP2 applied to a meta-built model, never ``to_empty``'d (how torchtitan builds): each rank's shards
    allocated on the mesh's device (``auto``: cpu for gloo) and filled, each its slice; nothing left on meta."""
    ranks = outcomes(world)("meta", "ckptfix", fmt)
    ok_on_every_rank(ranks)
    assert [r["on_meta"] for r in ranks] == [[]] * world
    assert all(r["sharded"] for r in ranks)
    ok_on_every_rank(outcomes(world)("meta-cpu", "ckptfix"))  # map_location="cpu": the mesh's kind, allowed


@pytest.mark.parametrize("fmt", ["ddp-torch", "ddp-safetensors"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_meta_built_fsdp2_model_loaded_runs_the_unsharded_models_forward(outcomes: Callable[[int], Run], world: int,
                                                                          fmt: str) -> None:
    """The real DDP fixture (``module.`` keys) into the MLP built on meta and sharded: the forward (FSDP2 gathering
    the shards) equals, bit for bit, the unsharded MLP's holding the full tensors."""
    ranks = outcomes(world)("meta-forward", "ckptfix", fmt)
    ok_on_every_rank(ranks)
    assert [r["forward"] for r in ranks] == [None] * world, [r["forward"] for r in ranks]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("failure", ["shape", "missing"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_meta_fsdp2_model_that_doesnt_fit_is_refused_on_every_rank_and_stays_on_meta(
        outcomes: Callable[[int], Run], world: int, failure: str, fmt: str) -> None:
    """A checkpoint that doesn't fit: LoadError on every rank naming the key, nothing materialised."""
    ranks = outcomes(world)("meta-fail", "ckptfix", failure, fmt)
    for rank, res in enumerate(ranks):
        assert res["outcome"] == "raised" and res["load_error"], f"rank {rank}: {res.get('type')}\n{res['traceback']}"
        assert FAILURES[failure] in res["message"], res["message"]
        assert res["on_meta"] == res["keys"], f"rank {rank}: materialised {sorted(set(res['keys']) - set(res['on_meta']))}"


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_chunks_that_dont_tile_row_major_are_read_by_the_part_each_rank_needs(outcomes: Callable[[int], Run],
                                                                                   world: int) -> None:
    """A real FSDP2 DCP whose weights were saved as Shard(1) (column chunks: no single row-major run) into an
    FSDP2 model sharded by rows: each rank reads from each chunk only its rows, no tensor assembled whole, and
    counts about its share of the tensor bytes."""
    ranks = outcomes(world)("dcp-cols", "ckptfix")
    ok_on_every_rank(ranks)
    whole = [[k for k in r["materialized"] if k.removeprefix("model.") in r["sharded"]] for r in ranks]
    assert whole == [[]] * world, f"sharded tensors read whole: {whole}"  # (buffers are whole on every rank)
    assert all(0 < r["report"]["bytes_read"] <= r["local_bytes"] for r in ranks), [
        (r["report"]["bytes_read"], r["local_bytes"]) for r in ranks]


@pytest.mark.parametrize("world", WORLDS)
def test_the_reference_loader_refuses_a_meta_model(outcomes: Callable[[int], Run], world: int) -> None:
    """The control: the naive loader can't fill shards on meta (what the tests above hold ckptfix to)."""
    for res in outcomes(world)("meta", "reference", "torch"):
        assert res["outcome"] == "raised" and "a.weight" in res["on_meta"], res


@pytest.mark.slow
@pytest.mark.parametrize("fmt", BYTE_FORMATS)
@pytest.mark.parametrize("loader", [name for name in LOADERS if name != "reference"])
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_reads_about_its_share_of_the_file(byte_counts: Callable[[int], Run], world: int, loader: str,
                                                     fmt: str) -> None:
    """Two 64 MiB weights under FSDP2: each rank's reads from disk (page cache dropped) stay within 1/world of
    the file plus read-ahead's slack, and so does what LoadReport.bytes_read counts."""
    run = byte_counts(world)
    ranks, bound = run("bytes", loader, fmt), run.bounds(fmt, world)
    ok_on_every_rank(ranks)
    counted = [r["report"]["bytes_read"] for r in ranks]
    assert all(r["local_bytes"] <= c <= bound.counted for r, c in zip(ranks, counted)), (counted, bound.counted)
    bound.os_level()
    reads = [r["read_bytes"] for r in ranks]
    assert max(reads) <= bound.per_rank and sum(reads) <= bound.total, (
        f"read {[f'{b / MiB:.1f}' for b in reads]} MiB of a {bound.size / MiB:.0f} MiB file; bounds "
        f"{bound.per_rank / MiB:.1f} per rank, {bound.total / MiB:.1f} in all")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CONTROL_FORMATS)
@pytest.mark.parametrize("world", WORLDS)
def test_the_byte_bound_catches_a_loader_reading_everything(byte_counts: Callable[[int], Run], world: int, fmt: str) -> None:
    """The control: reference_load reads the whole file on every rank. It loads correctly, and every bound of
    the test above fails for it (so those bounds can fail)."""
    run = byte_counts(world)
    ranks, bound = run("bytes", "reference", fmt), run.bounds(fmt, world)
    ok_on_every_rank(ranks)
    assert all(r["report"]["bytes_read"] > bound.counted for r in ranks)
    bound.os_level()
    reads = [r["read_bytes"] for r in ranks]
    assert min(reads) > bound.per_rank and sum(reads) > bound.total, (reads, bound.per_rank, bound.total)
