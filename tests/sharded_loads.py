"""The sharded loads' side of tests/ops/test_load_into_sharded*.py: the loaders under test, every case run on real
gloo ranks (tests/dist_harness.py, one run per world size), and what the tests read of their outcomes.

``LOADERS`` names the loaders: ckptfix's, and ``reference_load``, the naive loader (every rank reads the whole file,
repairs the keys by hand and keeps its slice), which passes every check of the tests except the byte bound.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.errors import LoadError
from tests import dist_harness, sharded_ranks

FORMATS = ("torch", "safetensors", "hf-sharded", "dcp", "dcp-torch")


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
    """What each rank runs (dist_harness's target, :func:`run_ranks`): every case, with these LOADERS."""
    return sharded_ranks.run_cases(payload["cases"], world, LOADERS)



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


@dataclass
class Run:
    """Each case's outcome on every rank (``run("load", loader, model, fmt)``); for the byte counts, each
    format's size and the disk's read-ahead."""

    cases: dict[str, list[dict[str, Any]]]
    sizes: dict[str, int] = field(default_factory=dict)
    readahead: int | None = None

    def __call__(self, *parts: Any) -> list[dict[str, Any]]:
        return self.cases[case_id(*parts)]


def case_id(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def run_ranks(cases: list[dict[str, Any]], world: int, root: Path, cwd: list[Path] | None = None) -> dict[str, list[dict]]:
    per_rank = dist_harness.run("tests.sharded_loads:run_cases", world, root / "run", {"cases": cases}, timeout=400, cwd=cwd)
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
