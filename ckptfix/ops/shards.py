"""DTensor-sharded models (FSDP2 ``fully_shard``, tensor parallel, any mesh): each rank fills its own shards.

The distributed engine is torch.distributed: the mesh and placements of each DTensor say which box of the
global tensor this rank holds (``compute_local_shape_and_global_offset``), and the structure read says
where that box's bytes are in the file. Each rank reads exactly those byte runs — one run per tensor for
a dim-0 shard — straight into its local shard. No rank reads the others' bytes or builds the full state dict.

Every rank plans the load and checks it before any rank writes: an error on one rank (a file missing on its
node) is raised on all of them (:class:`Agreement`), so no rank is left half-loaded or waiting.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ..core import tensorcopy
from ..errors import LoadError
from .sources import Sources, byte_view


def is_dtensor(t: Any) -> bool:
    """A DTensor; no DTensor can exist before torch.distributed.tensor is imported (importing it costs ~1 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_fsdp_hook(hook: Any) -> bool:
    """FSDP2's own load hooks (reshard before, re-pad after): this loader reshards and fills in place."""
    fn = getattr(hook, "hook", hook)  # torch wraps pre-hooks in _WrappedHook
    return str(getattr(fn, "__module__", "")).startswith("torch.distributed.fsdp")


def reshard(model: Any) -> None:
    """FSDP2 modules back in their sharded state (as their load pre-hook would put them)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):
        return  # no FSDP module can exist
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def local_box(dt: Any) -> tuple[list[int], list[int]]:
    """``(offsets, sizes)`` of the global tensor that this rank's local shard of ``dt`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return list(offsets), list(sizes)


def check_placements(key: str, dt: Any, src: Any) -> None:
    """Placements this loader fills exactly: Shard and Replicate (partial sums and strided shards are refused)."""
    from torch.distributed.tensor import Replicate, Shard

    odd = [p for p in dt.placements if type(p) not in (Shard, Replicate)]
    if odd:
        raise LoadError(f"{key}: DTensor placement {odd[0]} is not one ckptfix fills (Shard and Replicate are); "
                        "load a consolidated state dict with torch.distributed.checkpoint instead")
    if dt.to_local().is_meta:
        raise LoadError(f"{key}: the DTensor's local shard is on the meta device; call model.to_empty(device=...) "
                        "after fully_shard, then load; nothing was loaded")
    if tuple(dt.shape) != tuple(src.shape):
        raise LoadError(f"{key}: the model's global shape {list(dt.shape)} differs from the checkpoint's {list(src.shape)}")


def _read_box(src: Any, sources: Sources, offsets: list[int], sizes: list[int], out: Any) -> None:
    """The box of ``src`` into the contiguous CPU tensor ``out`` (of ``src``'s dtype): byte runs where the file
    stores ``src`` contiguously, else a slice of the mapped view."""
    runs = sources.box_runs(src, offsets, sizes) if src.is_meta else None
    if runs is not None:
        sources.read_runs(runs, byte_view(out))
        return
    view = sources.view(src)
    out.copy_(view[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])


def fill_local(dt: Any, src: Any, sources: Sources, check: bool) -> bool:
    """This rank's shard of ``dt`` from ``src``; whether its values are finite (when ``check``)."""
    import torch

    offsets, sizes = local_box(dt)
    with torch.no_grad():
        local = dt.to_local()
        if local.numel() == 0:
            return True
        if local.is_contiguous() and local.device.type == "cpu" and local.dtype == src.dtype:
            _read_box(src, sources, offsets, sizes, local)
            return tensorcopy.all_finite(local) if check else True
        staged = torch.empty(sizes, dtype=src.dtype, pin_memory=local.device.type == "cuda")
        _read_box(src, sources, offsets, sizes, staged)
        return tensorcopy.copy_checked(local, staged, check)


def local_source_finite(dt: Any, src: Any, sources: Sources) -> bool:
    """strict_values: this rank's box of the file is finite (read into a temporary the size of the shard)."""
    import torch

    offsets, sizes = local_box(dt)
    staged = torch.empty(sizes, dtype=src.dtype)
    _read_box(src, sources, offsets, sizes, staged)
    return tensorcopy.all_finite(staged)


class Agreement:
    """Ranks agreeing before anything is written: a no-op unless the model holds DTensors and a process
    group is up; then ``step()`` raises on every rank what any rank raised, and ``gather_keys`` unions
    per-rank findings (NaN/Inf keys) so every rank reports the same."""

    def __init__(self, model: Any):
        import torch.distributed as dist

        self.active = (dist.is_available() and dist.is_initialized()
                       and any(is_dtensor(p) for p in (*model.parameters(), *model.buffers())))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        import torch.distributed as dist

        error: BaseException | None = None
        try:
            yield
        except Exception as e:  # raised here after the others have heard of it, so none waits forever
            error = e
        messages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else (type(error).__name__, str(error)))
        if error is not None:
            raise error
        failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
        if failed:
            rank, (_kind, text) = failed[0]
            raise LoadError(f"rank {rank} could not load: {text}; nothing was loaded on any rank")

    def rank_and_world(self) -> tuple[int, int]:
        if not self.active:
            return 0, 1
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def gather_keys(self, keys: list[str]) -> list[str]:
        if not self.active:
            return keys
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, keys)
        return list(dict.fromkeys(k for part in parts for k in part))
