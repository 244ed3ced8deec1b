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
from collections.abc import Callable, Iterator
from typing import Any

from ...core import tensorcopy
from ...core.devices import DevicePlan, storage_id
from ...errors import LoadError
from ...formats.base import PiecedRef, StorageRef
from ..sources import Segment, Sources, byte_view


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
    if tuple(dt.shape) != tuple(src.shape):
        raise LoadError(f"{key}: the model's global shape {list(dt.shape)} differs from the checkpoint's {list(src.shape)}")
    kind = "quantized" if getattr(src, "is_quantized", False) else "sparse" if tensorcopy.is_sparse(src) else None
    if kind is not None:  # (its values need its scale, or its indices: not a box of bytes)
        raise LoadError(f"{key}: the checkpoint's tensor is {kind} and the model's is a DTensor, whose shards ckptfix "
                        "fills from plain tensors only; load it into an unsharded model (then shard), or dequantize / "
                        "densify it first; nothing was loaded")


def local_device(key: str, dt: Any, devices: DevicePlan, tag: str) -> str:
    """Where a DTensor's local shard still on meta is allocated: the mesh's device (``map_location="auto"``:
    ``cpu`` for gloo, this process's current GPU for a CUDA mesh), or the one ``map_location`` names for the
    saved ``tag`` if it is of the mesh's kind."""
    import torch

    kind = dt.device_mesh.device_type
    if devices.auto:
        return "cpu" if kind == "cpu" else f"{kind}:{torch.get_device_module(kind).current_device()}"
    device = devices.target(tag)
    if torch.device(device).type != kind:
        raise LoadError(f"{key}: the DTensor's mesh is on {kind} but map_location puts its shard on {device}; "
                        f"pass map_location='auto' (or a {kind} device); nothing was loaded")
    return device


def empty_root(key: str, by_name: dict[str, Any]) -> str:
    """The path of the module whose ``to_empty`` materialises the DTensor of model key ``key``: the FSDP2
    module nearest above it (whose ``_apply`` resets the shards it manages), else the tensor's own module."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    parts = key.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        if fsdp is not None and isinstance(by_name.get(path), getattr(fsdp, "FSDPModule", ())):
            return path
    return ".".join(parts)


def outermost(paths: dict[str, str]) -> dict[str, str]:
    """Of module ``path → device``, those not inside another (its ``to_empty`` reaches them)."""
    def inside(path: str, other: str) -> bool:
        return other != path and (other == "" or path.startswith(other + "."))

    return {p: d for p, d in paths.items() if not any(inside(p, q) for q in paths)}


def materialise(modules: list[tuple[Any, str]]) -> Callable[[], None]:
    """Each module's tensors still on meta allocated on its device, as ``module.to_empty(device=...)`` does it
    (``_apply``, so FSDP2's own ``_apply`` re-registers the sharded parameters it manages), values unset until
    the fill; tensors already off meta are left as they are. If one fails (out of memory), those allocated are
    put back on meta and the error raised: the model as it was. Returns what puts them back (a failed fill's)."""
    import torch

    places = [(d, name) for module, _ in modules for m in module.modules() for d in (m._parameters, m._buffers)
              for name, t in d.items() if t is not None and on_meta(t)]

    def back() -> None:  # what is off meta now at a place that was on meta (the objects alive: their ids theirs)
        allocated = {id(d[name]) for d, name in places if d.get(name) is not None and not on_meta(d[name])}
        for module, _ in modules:
            module._apply(lambda t: torch.empty_like(t, device="meta") if id(t) in allocated else t)

    try:
        for module, device in modules:
            module._apply(lambda t, device=device: torch.empty_like(t, device=device) if on_meta(t) else t)
    except BaseException:
        back()
        raise
    return back


def on_meta(t: Any) -> bool:
    """A tensor with no storage yet: on meta, or a DTensor whose local shard is."""
    return bool(t.is_meta or (is_dtensor(t) and t.to_local().is_meta))


def _read_box(src: Any, sources: Sources, offsets: list[int], sizes: list[int], out: Any) -> None:
    """The box of ``src`` into the contiguous CPU tensor ``out`` (of ``src``'s dtype): byte runs where the file
    stores ``src`` contiguously, else a slice of the mapped view."""
    runs = sources.box_runs(src, offsets, sizes) if src.is_meta else None
    if runs is not None:
        sources.read_runs(runs, byte_view(out))
        _apply_bits(src, out)
        return
    pieces = source_pieces(src, sources)
    if pieces is not None:
        _read_pieces(pieces, src, sources, offsets, sizes, out)
        _apply_bits(src, out)
        return
    view = sources.view(src)
    out.copy_(view[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])


def _apply_bits(src: Any, out: Any) -> None:
    """``out`` holds stored bytes of ``src``: the values torch's rebuild gives them (a conjugate or negative view's
    bit applied; the mapped view's copy above applies them itself)."""
    if src.is_conj():
        out.conj_physical_()
    if src.is_neg():
        out.neg_()


def source_pieces(src: Any, sources: Sources) -> list[tuple[list[int], list[int], Segment]] | None:
    """The boxes of ``src`` each stored row-major in one byte range (DCP chunks that don't tile it row-major
    but are plain bytes), or None. Asked in the plan: a damaged chunk record is refused before anything loads."""
    ref = sources.refs.get(storage_id(src)) if src.is_meta else None
    if not isinstance(ref, PiecedRef) or not src.is_contiguous() or src.storage_offset() != 0:
        return None
    return ref.pieces()


def _read_pieces(pieces: list[tuple[list[int], list[int], Segment]], src: Any, sources: Sources,
                 offsets: list[int], sizes: list[int], out: Any) -> None:
    """The box ``offsets + sizes`` of ``src`` into ``out``: from each piece, only the rows it shares with the box."""
    import torch

    for at, size, (path, start, nbytes) in pieces:
        lo = [max(a, b) for a, b in zip(offsets, at)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, at, size)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        piece = torch.empty(size, dtype=src.dtype, device="meta")  # the piece as a tensor of its own bytes
        own = Sources({storage_id(piece): StorageRef(path, start, nbytes, "cpu")}, sources.reader)
        runs = own.box_runs(piece, [low - b for low, b in zip(lo, at)], [h - low for low, h in zip(lo, hi)])
        assert runs is not None  # a contiguous tensor in one byte range
        dst = out[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))]
        staged = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype)
        sources.read_runs(runs, byte_view(staged))
        if staged is not dst:
            dst.copy_(staged)


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
    """Ranks agreeing before anything is written, and again after: a no-op unless the model holds DTensors and a
    process group of more than one rank is up. ``step()`` raises on every rank what any rank raised (the plan);
    :meth:`settle` tells every rank whether any rank's commit failed and which ranks loaded what nothing can undo, and
    unions per-rank findings (NaN/Inf keys) so every rank reports the same. Every rank reaches each collective whatever
    it raised, so none waits forever."""

    def __init__(self, model: Any):
        import torch.distributed as dist

        self.active = (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1  # (alone: no one
                       and any(is_dtensor(p) for p in (*model.parameters(), *model.buffers())))  # to agree with)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        error: BaseException | None = None
        try:
            yield
        except BaseException as e:  # (a KeyboardInterrupt too) raised here after the others have heard of it
            error = e
        failed, _loaded, _keys = self.settle(error, [], undone=True)
        if error is not None:
            raise error
        if failed is not None:
            raise LoadError(failed_on(*failed))

    def settle(self, error: BaseException | None, keys: list[str],
               undone: bool) -> tuple[tuple[int, str] | None, list[int], list[str]]:
        """One collective: the first rank that failed (its rank and error; this one's too) or None; the ranks that
        did not fail and could not undo their fill (``undone`` False: leased, no log kept); every rank's ``keys``,
        unioned."""
        if not self.active:
            return (None if error is None else (0, _said(error))), [], keys
        import torch.distributed as dist

        messages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, (None if error is None else _said(error), undone, keys))
        failed = next(((rank, text) for rank, (text, _u, _k) in enumerate(messages) if text is not None), None)
        loaded = [rank for rank, (text, can, _k) in enumerate(messages) if text is None and not can]
        return failed, loaded, list(dict.fromkeys(k for _t, _u, part in messages for k in part))

    def rank_and_world(self) -> tuple[int, int]:
        if not self.active:
            return 0, 1
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def gather_keys(self, keys: list[str]) -> list[str]:
        return self.settle(None, keys, undone=True)[2]


def _said(error: BaseException) -> str:
    text = str(error).removesuffix("; nothing was loaded")
    return text or ("interrupted" if isinstance(error, KeyboardInterrupt) else type(error).__name__)


def failed_on(rank: int, text: str, loaded: list[int] | None = None) -> str:
    """What every other rank raises when ``rank`` could not load (``loaded``: the ranks whose fill stands)."""
    return f"rank {rank} could not load: {text}; {partly(loaded) if loaded else 'nothing was loaded on any rank'}"


def partly(loaded: list[int]) -> str:
    """The ranks whose fill stands (their files leased: no log of what it replaced was kept, the load's own cost)."""
    ranks = ", ".join(map(str, loaded))
    return (f"rank{'s' if len(loaded) > 1 else ''} {ranks} had loaded {'their' if len(loaded) > 1 else 'its'} shards, "
            "which nothing could undo (leased files: no log kept), the others' are as they were: the model is partly "
            "loaded across ranks; load it again")
