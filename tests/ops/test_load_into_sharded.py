"""load_into on DTensor-sharded models, in real gloo process groups on CPU with 2 and 4 ranks.

The models: FSDP2 ``fully_shard`` (built on CPU, or on meta then ``to_empty``), tensor parallel
(``parallelize_module``: ColwiseParallel, RowwiseParallel), and ``distribute_tensor`` placements (Shard(0),
Shard(1), Replicate, on a 1-D and a 2-D mesh), with fp32, bf16, fp16 and integer tensors, uneven dim-0
shards and shards left empty (fewer rows than ranks). The checkpoints: torch zip, safetensors, a Hugging
Face sharded directory and DCP directories (ckptfix's and torch's own writers), plus the real DDP and
FSDP2 fixtures (``module.`` keys; ``{"model", "optim"}`` saved by two FSDP2 ranks).

Every rank checks, bit for bit, that its local shard equals its slice of the full tensor
(``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()``); a failing load raises
ckptfix's error on every rank and leaves every rank's tensors as they were. What each rank reads of the file:
tests/ops/test_load_into_shard_reads.py.

Each world size is one run of the ranks (tests/sharded_loads.py), every case in turn; the tests read their
outcomes. ``LOADERS`` names the loaders under test: ckptfix's, and the naive ``reference_load``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.errors import CkptfixError, LoadError
from tests.sharded_loads import (FORMATS, LOADERS, Run, case_id, ok_on_every_rank, once_per_world, read_whole, run_ranks,
                                 write_formats)
from tests.sharded_ranks import MODELS, full_state_dict

WORLDS = (2, 4)
#: the failures of issue 18 item 5, each in every format: what breaks, and the key its message must name
FAILURES = {"shape": "c.weight", "missing": "c.bias", "nan": "b.weight", "truncated": None}
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks forked from a forkserver")


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


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Callable[[int], Run]:
    """world → the outcome of every case on every rank (not the byte counts); one run of the ranks per world size."""
    files = write_checkpoints(tmp_path_factory.mktemp("checkpoints"), fixtures_dir)
    return once_per_world(lambda world: Run(run_ranks(make_cases(files, world), world, tmp_path_factory.mktemp(f"w{world}"))))


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
