"""What the ranks of tests/ops/test_load_into_sharded*.py run: the DTensor-sharded models, the state dicts their
checkpoints hold, and each case (build, load, record).

``build_model(kind, meshes)`` runs on every rank of a gloo group; the model starts from seed 0 (integer
tensors zero), its checkpoint from seed 1 (integers from 100): every tensor a load must change. The full
tensors are deterministic, so a rank rebuilds those its shards are compared with. :func:`run_cases`
records, per case, what the loader did to this rank's shards; the test module makes the checks.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptfix.errors import CkptfixError, LoadError
from ckptfix.formats.dcp.chunks import TensorRef
from tests.page_cache import drop_from_page_cache

#: model kind → the family of state dict its checkpoint holds (the kinds the load matrix runs)
MODELS = {"fsdp2": "mixed", "fsdp2-meta": "mixed", "tp": "tp", "dtensor-1d": "placed", "dtensor-2d": "placed"}
#: the byte-count model's family: two 64 MiB float32 weights
BIG = "big"


class Mixed(nn.Module):
    """fp32, bf16 and fp16 Linears (7, 5 and 1 rows: uneven shards, and empty ones), a BatchNorm (an int64
    buffer) and an int32 buffer; FSDP2 shards the parameters, the buffers stay whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 7)
        self.norm = nn.BatchNorm1d(7)
        self.b = nn.Linear(7, 5).to(torch.bfloat16)
        self.c = nn.Linear(5, 1).to(torch.float16)
        self.register_buffer("codes", torch.zeros(6, dtype=torch.int32))


class TPNet(nn.Module):
    """Colwise ``up`` (5 rows), rowwise ``down`` (5 columns), colwise ``gate`` (1 row)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 5)
        self.down = nn.Linear(5, 4)
        self.gate = nn.Linear(4, 1)


#: name → (shape, dtype, buffer?) of Placed's tensors
PLACED = {"rows": ((7, 5), torch.float32, False), "cols": ((3, 9), torch.bfloat16, False),
          "rep": ((4, 4), torch.float16, False), "tiny": ((1, 3), torch.float32, False),
          "index": ((3,), torch.int64, True), "count": ((), torch.int32, True)}


def placements(mesh_dims: int) -> dict[str, tuple[Any, ...]]:
    from torch.distributed.tensor import Replicate, Shard

    if mesh_dims == 1:
        return {"rows": (Shard(0),), "cols": (Shard(1),), "rep": (Replicate(),), "tiny": (Shard(0),),
                "index": (Shard(0),), "count": (Replicate(),)}
    return {"rows": (Shard(0), Shard(1)), "cols": (Replicate(), Shard(0)), "rep": (Shard(1), Replicate()),
            "tiny": (Shard(0), Shard(0)), "index": (Shard(0), Replicate()), "count": (Replicate(), Replicate())}


class Placed(nn.Module):
    """Parameters and buffers that are DTensors placed by hand (``distribute_tensor``, as distribute_module does)."""

    def __init__(self, mesh: Any = None, seed: int = 0) -> None:
        super().__init__()
        from torch.distributed.tensor import distribute_tensor

        where = placements(mesh.ndim) if mesh is not None else {}
        g = torch.Generator().manual_seed(seed)
        for name, (shape, dtype, buffer) in PLACED.items():
            t = (torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point
                 else torch.arange(int(torch.Size(shape).numel()), dtype=dtype).reshape(shape) + 100 * seed)
            if mesh is not None:
                t = distribute_tensor(t, mesh, where[name], src_data_rank=None)
            if buffer:
                self.register_buffer(name, t)
            else:
                self.register_parameter(name, nn.Parameter(t))


class Bits(nn.Module):
    """A complex64 weight (Shard(0)) and a float32 one (Shard(1)): their checkpoint stores them as a conjugate and a
    negative view (torch.save keeps the bits; the values are the bits applied to the stored bytes)."""

    def __init__(self, mesh: Any = None, seed: int = 0) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        g = torch.Generator().manual_seed(seed)
        z, w = torch.randn(6, 4, dtype=torch.complex64, generator=g), torch.randn(5, 3, generator=g)
        if mesh is not None:
            z = distribute_tensor(z, mesh, (Shard(0),), src_data_rank=None)
            w = distribute_tensor(w, mesh, (Shard(1),), src_data_rank=None)
        self.z, self.w = nn.Parameter(z), nn.Parameter(w)


def mlp() -> nn.Sequential:
    """fixtures/train.py's MLP (the real DDP and FSDP2 fixtures were trained on it)."""
    return nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def big() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2048, 8192, bias=False), nn.Linear(8192, 2048, bias=False))


def fully_shard_each(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2 as its docs apply it: every module holding parameters, then the root."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if m is not model and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_model(kind: str, meshes: dict[str, Any]) -> nn.Module:
    """A model of ``kind`` sharded over ``meshes["1d"]`` (or ``["2d"]``), seed 0."""
    torch.manual_seed(0)
    mesh = meshes["1d"]
    if kind in ("fsdp2", "fsdp2-mlp"):
        return fully_shard_each(Mixed() if kind == "fsdp2" else mlp(), mesh)
    if kind in ("fsdp2-meta", "fsdp2-meta-bare", "fsdp2-meta-mlp-bare", "big"):
        with torch.device("meta"):  # as torchtitan builds: on meta, fully_shard, then (not "-bare") to_empty
            model = fully_shard_each(big() if kind == "big" else mlp() if kind == "fsdp2-meta-mlp-bare" else Mixed(), mesh)
        return model if kind.endswith("-bare") else model.to_empty(device="cpu")
    if kind == "fsdp2-dcp-net":  # tests/fsdp2_dirs.py's Net, FSDP2's dim-0 shards (its "cols" DCP: Shard(1) chunks)
        from tests import fsdp2_dirs

        return fully_shard_each(fsdp2_dirs.net(), mesh)
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "gate": ColwiseParallel()}
        return parallelize_module(TPNet(), mesh, plan)
    if kind in ("dtensor-1d", "dtensor-2d"):
        return Placed(meshes["2d"] if kind == "dtensor-2d" else mesh)
    if kind == "dtensor-bits":
        return Bits(mesh)
    raise ValueError(kind)


@functools.lru_cache(maxsize=2)
def full_state_dict(family: str | Path) -> dict[str, torch.Tensor]:
    """The full tensors a family's checkpoints hold (seed 1), or those of a reference file (a path)."""
    if isinstance(family, Path):
        return torch.load(family, map_location="cpu", weights_only=True)
    torch.manual_seed(1)
    if family == "mixed":
        model: nn.Module = Mixed()
        model.norm.running_mean.normal_()
        model.norm.running_var.uniform_(0.5, 2)
        model.norm.num_batches_tracked.fill_(123)
        model.codes.copy_(torch.arange(100, 106, dtype=torch.int32))
    elif family == "tp":
        model = TPNet()
    elif family == "placed":
        model = Placed(seed=1)
    elif family == "bits":
        model = Bits(seed=1)
    elif family == BIG:
        g = torch.Generator().manual_seed(1)
        return {"0.weight": torch.rand(8192, 2048, generator=g), "1.weight": torch.rand(2048, 8192, generator=g)}
    else:
        raise ValueError(family)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- what each rank runs ------------------------------------------------------------------------------------


def read_bytes() -> int:
    """Bytes this process has had read from storage (page-cache hits don't count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def bits(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's identity bit for bit (NaN equal to itself): shape, dtype and raw bytes."""
    t = t.detach()
    return tuple(t.shape), t.dtype, t.contiguous().reshape(-1).view(torch.uint8).clone() if t.numel() else None


def same_bits(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:2] == b[:2] and (a[2] is None if b[2] is None else a[2] is not None and torch.equal(a[2], b[2]))


def local_tensors(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def expected_locals(model: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor's slice of the full one, as torch's own DTensor places it on this rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return {k: distribute_tensor(full[k], v.device_mesh, v.placements, src_data_rank=None).to_local()
            if isinstance(v, DTensor) else full[k] for k, v in model.state_dict().items()}


def run_case(case: dict[str, Any], meshes: dict[str, Any], loaders: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """One case on this rank: build the model, load, and record what happened (each check is the test's)."""
    from torch.distributed.tensor import DTensor

    model = build_model(case["model"], meshes)
    before = {k: bits(v) for k, v in local_tensors(model).items() if v.device.type != "meta"}
    path = Path(case["path"])
    if case.get("cold"):
        drop_from_page_cache(path)
        dist.barrier()
    start = read_bytes()
    out: dict[str, Any] = {"outcome": "ok", "message": "", "traceback": "", "path": str(path)}
    materialized: list[str] = []  # DCP tensors read whole (TensorRef.materialize) by the loader
    real_materialize = TensorRef.materialize
    TensorRef.materialize = lambda self: materialized.append(self.fqn) or real_materialize(self)  # type: ignore[method-assign]
    try:
        report = loaders[case["loader"]](model, path, **case.get("kwargs", {}))
        out["report"] = {f: getattr(report, f, None) for f in ("fix", "missing", "unexpected", "bytes_read")}
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        out.update(outcome="raised", type=type(e).__name__, load_error=isinstance(e, LoadError),
                   ckptfix_error=isinstance(e, CkptfixError), message=str(e), traceback=traceback.format_exc())
    finally:
        TensorRef.materialize = real_materialize  # type: ignore[method-assign]
    out["materialized"] = materialized
    out["read_bytes"] = read_bytes() - start
    state = model.state_dict()
    out["sharded"] = {k: str(v.placements) for k, v in state.items() if isinstance(v, DTensor)}
    out["on_meta"] = sorted(k for k, v in state.items() if v.device.type == "meta")
    after = {k: v for k, v in local_tensors(model).items() if v.device.type != "meta"}
    out["changed"] = sorted(k for k, v in after.items() if k in before and not same_bits(bits(v), before[k]))
    out["local_bytes"] = sum(v.nbytes for v in after.values())
    out["empty"] = sorted(k for k, v in after.items() if v.numel() == 0 and state[k].numel())
    out["keys"] = sorted(state)
    out["wrong"] = None  # not compared: the load failed, or left tensors on meta
    if out["outcome"] == "ok" and case.get("expected") and not out["on_meta"]:
        want = expected_locals(model, full_state_dict(case["expected"]))
        out["wrong"] = [f"{k}: local {list(v.shape)} {v.dtype}, its slice {list(want[k].shape)} {want[k].dtype}"
                        for k, v in after.items() if not same_bits(bits(v), bits(want[k]))]
    if case.get("forward") and out["wrong"] == []:
        out["forward"] = same_forward(model, full_state_dict(case["expected"]))
    return out


def same_forward(model: nn.Module, full: dict[str, torch.Tensor]) -> str | None:
    """The sharded model's forward (FSDP2 gathers its shards) equals, bit for bit, that of the unsharded MLP
    holding ``full``; what differs, or None."""
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(2))
    plain = mlp()
    plain.load_state_dict(full)
    with torch.no_grad():
        got, want = model(x), plain(x)
    return None if torch.equal(got, want) else f"forward differs by up to {float((got - want).abs().max())}"


def run_cases(cases: list[dict[str, Any]], world: int, loaders: dict[str, Callable[..., Any]]) -> dict[str, dict[str, Any]]:
    """Every case on this rank, a barrier after each; after a broken barrier the rest are not run."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results: dict[str, dict[str, Any]] = {}
    broken = ""
    for case in cases:
        if broken:
            results[case["id"]] = {"outcome": "not run", "message": "", "path": case["path"],
                                   "traceback": f"the process group broke after case {broken}"}
            continue
        results[case["id"]] = run_case(case, meshes, loaders)
        try:
            dist.barrier()
        except Exception:
            broken = case["id"]
            results[case["id"]]["traceback"] += "\nthe barrier after it failed:\n" + traceback.format_exc()
    return results
