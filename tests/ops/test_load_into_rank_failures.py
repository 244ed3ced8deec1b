"""A load into an FSDP2 model that fails on one rank only, mid-commit or mid-plan, on 2 real gloo ranks.

Each rank reads its own copy of the checkpoint (the same relative path in its own directory, as on separate
hosts); rank 1's fails part way through its fills — its copy truncated by another writer, or a SIGINT or
SIGTERM — or while it plans. Every rank must hear of it (none left waiting in a collective: the harness kills
a rank still running seconds after another failed), and every rank's shards must be as they were, rank 0's
too, though its own fills all succeeded and its file was leased: "all of it or none" across ranks. A model
sharded on meta, whose shards the commit allocates, is on meta again.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import ckptfix
from ckptfix.core import rollback
from ckptfix.ops.load_into import commit, shards
from ckptfix.statedict import repair
from tests import dist_harness, sharded_ranks

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks forked from a forkserver")

WORLD = 2
PARTLY = "rank 0 had loaded its shards, which nothing could undo"


@dataclass(frozen=True)
class Case:
    """What goes wrong on rank 1 (``how``), which ranks lease their file (the others keep a log), and what each rank
    must raise (its type, its message's start) and hold after ("before": its shards as they were; "loaded")."""

    how: str | None
    leased: tuple[int, ...]
    one: tuple[str | None, str, str]
    zero: tuple[str | None, str, str]
    meta: bool = False


CASES = {
    "none": Case(None, (0, 1), (None, "", "loaded"), (None, "", "loaded")),
    "truncated_beside_a_leased_rank": Case(
        "truncate", (0,), ("LoadError", "rank 1 could not load: ", "before"), ("LoadError", "rank 1 could not load: ",
                                                                                "loaded")),
    "truncated": Case("truncate", (), ("FormatError", "", "before"),
                      ("LoadError", "rank 1 could not load: ", "before")),
    "truncated_meta": Case("truncate", (), ("FormatError", "", "before"),
                           ("LoadError", "rank 1 could not load: ", "before"), meta=True),
    "sigint_leased": Case("sigint", (0, 1), ("Interrupted", f"interrupted; {commit.LOADED_FIRST}", "loaded"),
                          (None, "", "loaded")),
    "sigterm": Case("sigterm", (), ("Interrupted", "terminated (SIGTERM); nothing was loaded", "before"),
                    ("LoadError", "rank 1 could not load: terminated (SIGTERM); nothing was loaded on any rank", "before")),
    "sigint_in_plan": Case("plan", (0, 1), ("KeyboardInterrupt", "", "before"),
                           ("LoadError", "rank 1 could not load: interrupted; nothing was loaded on any rank", "before")),
}


def run_cases(rank: int, world: int, payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every case on this rank in turn (a barrier after each); what each did to this rank's shards."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    full = sharded_ranks.full_state_dict("mixed")
    out = {}
    for case in CASES:
        save_file(full, "model.safetensors")  # this rank's own copy, afresh
        out[case] = _run_case(rank, case, meshes, full)
        dist.barrier()
    return out


def _run_case(rank: int, name: str, meshes: dict[str, Any], full: dict[str, torch.Tensor]) -> dict[str, Any]:
    case = CASES[name]
    meta = case.meta
    model = sharded_ranks.build_model("fsdp2-meta-bare" if meta else "fsdp2", meshes)
    before = {k: sharded_ranks.bits(v) for k, v in sharded_ranks.local_tensors(model).items() if not meta}
    real_fill, real_fit, real_lease = shards.fill_local, repair.fit_to_model, rollback.SETLEASE
    calls: list[int] = []

    def failing_fill(*args: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            if case.how == "truncate":
                os.truncate("model.safetensors", 8)
            else:
                os.kill(os.getpid(), signal.SIGTERM if case.how == "sigterm" else signal.SIGINT)
        return real_fill(*args)

    def failing_fit(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return real_fit(*args, **kwargs)

    if rank == 1 and case.how == "plan":
        repair.fit_to_model = failing_fit  # type: ignore[assignment]
    elif rank == 1 and case.how is not None:
        shards.fill_local = failing_fill  # type: ignore[assignment]
    if rank not in case.leased:
        rollback.SETLEASE = None  # (the log then; rank 1's own truncate would wait for its own lease)
    result: dict[str, Any] = {"type": None, "message": "", "traceback": ""}
    try:
        ckptfix.load_into(model, "model.safetensors")
    except BaseException as e:  # (KeyboardInterrupt: what the case sends)
        result.update(type=type(e).__name__, message=str(e), traceback=traceback.format_exc())
    finally:
        shards.fill_local, repair.fit_to_model, rollback.SETLEASE = real_fill, real_fit, real_lease  # type: ignore[assignment]
    after = sharded_ranks.local_tensors(model)
    result["fills"] = len(calls)
    result["on_meta"] = sorted(k for k, v in after.items() if v.is_meta)
    if meta:
        result.update(changed=[k for k in after if k not in result["on_meta"]], wrong=[])
        return result
    result["changed"] = sorted(k for k, v in after.items() if not sharded_ranks.same_bits(sharded_ranks.bits(v), before[k]))
    want = {k: sharded_ranks.bits(v) for k, v in sharded_ranks.expected_locals(model, full).items()}
    result["wrong"] = sorted(k for k, v in after.items() if not sharded_ranks.same_bits(sharded_ranks.bits(v), want[k]))
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("rank-failures")
    cwd = [root / f"rank{r}" for r in range(WORLD)]
    for d in cwd:
        d.mkdir()
    per_rank = dist_harness.run(f"{__name__}:run_cases", WORLD, root / "run", {}, timeout=300, cwd=cwd)
    return {name: [r[name] for r in per_rank] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_a_failure_on_one_rank_is_heard_by_every_rank_and_undone_where_it_can_be(
        ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    """Every rank hears of it; a rank that kept a log puts its fill back (a meta-sharded model's shards on meta
    again), so with no leased rank nothing is loaded on any rank; a leased rank's fill stands and every rank says so."""
    case = CASES[name]
    for rank, (res, (kind, start, held)) in enumerate(zip(ranks[name], (case.zero, case.one))):
        assert res["type"] == kind, f"rank {rank}: {res['traceback']}"
        assert res["message"].startswith(start), f"rank {rank}: {res['message']}"
        if kind == "LoadError":
            assert res["message"].endswith("; nothing was loaded on any rank") is (not case.leased or case.how == "plan")
            assert (PARTLY in res["message"]) is (case.leased == (0,)), res["message"]
        if held == "loaded":
            assert res["wrong"] == [] and res["on_meta"] == [], f"rank {rank}: {res['wrong']}"
        else:
            assert res["changed"] == [], f"rank {rank}'s shards changed: {res['changed']}"
    if case.how not in (None, "plan"):
        assert ranks[name][1]["fills"] >= 2  # (the failure came mid-commit, after the first shard was filled)


def run_alone(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    """A world of one rank: a load, then one whose file is cut mid-commit (no lease: the log); the collectives each
    made, and whether the second left the shards as they were."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    full = sharded_ranks.full_state_dict("mixed")
    gathers: list[int] = []
    real_gather, real_fill, real_lease = dist.all_gather_object, shards.fill_local, rollback.SETLEASE

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers.append(1)
        return real_gather(*args, **kwargs)

    def cutting_fill(*args: Any) -> bool:
        os.truncate("model.safetensors", 8)
        return real_fill(*args)

    out: dict[str, Any] = {}
    dist.all_gather_object = counted  # type: ignore[assignment]
    try:
        for how in ("plain", "cut"):
            save_file(full, "model.safetensors")
            model = sharded_ranks.build_model("fsdp2", meshes)
            before = {k: sharded_ranks.bits(v) for k, v in sharded_ranks.local_tensors(model).items()}
            gathers.clear()
            if how == "cut":
                shards.fill_local, rollback.SETLEASE = cutting_fill, None  # type: ignore[assignment]
            try:
                ckptfix.load_into(model, "model.safetensors")
                raised = ""
            except ckptfix.CkptfixError as e:
                raised = type(e).__name__
            finally:
                shards.fill_local, rollback.SETLEASE = real_fill, real_lease  # type: ignore[assignment]
            after = sharded_ranks.local_tensors(model)
            want = {k: sharded_ranks.bits(v) for k, v in sharded_ranks.expected_locals(model, full).items()}
            out[how] = {"gathers": len(gathers), "raised": raised,
                        "as_before": all(sharded_ranks.same_bits(sharded_ranks.bits(v), before[k]) for k, v in after.items()),
                        "loaded": all(sharded_ranks.same_bits(sharded_ranks.bits(v), want[k]) for k, v in after.items())}
    finally:
        dist.all_gather_object = real_gather  # type: ignore[assignment]
    return out


def test_a_world_of_one_rank_loads_without_a_collective(tmp_path: Any) -> None:
    """One rank has no one to agree with: its DTensor load makes no collective, and is all or nothing by its own log."""
    (tmp_path / "rank0").mkdir()
    [alone] = dist_harness.run(f"{__name__}:run_alone", 1, tmp_path / "run", {}, timeout=120, cwd=[tmp_path / "rank0"])
    assert alone["plain"] == {"gathers": 0, "raised": "", "as_before": False, "loaded": True}
    assert alone["cut"] == {"gathers": 0, "raised": "FormatError", "as_before": True, "loaded": False}
