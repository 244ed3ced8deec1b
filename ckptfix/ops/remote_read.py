"""A remote checkpoint (``https://``, ``s3://``, ``hf://``) read without ``torch.load`` and without a download.

The structure is read on ``meta`` exactly as for a local file (the same format readers, over a buffer or file
object of the remote source: only the headers, the zip directory and ``data.pkl`` are fetched), so every storage's
byte range is known. Reading the values then fetches each storage once into fresh CPU memory (concurrent
ranged requests, each checked against the file's validator), hands it to the ``map_location`` as ``torch.load``
would, and puts tensors with the saved layout (dtype, offset, shape, strides, ``Parameter``, ``requires_grad``)
where the meta tensors were: tied tensors stay views of one storage, as ``torch.load`` gives them.

>>> with locations.session():                                   # doctest: +SKIP
...     raw = read("https://host/model.pth", TORCH_ZIP, DevicePlan("cpu"), trust=False, select="auto")
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .. import formats
from ..formats.base import RawRead
from ..core import locations
from ..core.devices import DevicePlan, storage_id
from ..core.positional import PositionalReader
from ..errors import NeedsLocalCopy
from .sources import Sources


def read(path: str, fmt: str, plan: DevicePlan, trust: bool, select: str | None) -> RawRead:
    """``path`` (a URL, inside a :func:`~ckptfix.core.locations.session`) read as ``formats.read`` reads a local
    file with ``plan``: on meta its structure and refs, else its tensors with their values on ``plan``'s devices."""
    raw = formats.read(path, fmt, DevicePlan("meta", source=path), trust, select)
    if plan.is_meta:
        return raw
    tags: dict[int, str] = {}
    with PositionalReader(locations.open_source) as reader:
        sources = Sources(raw.refs, reader)
        sources.check_bounds()
        sources.fetch_ahead()  # (every storage is read: all at once, not one round trip after another)
        raw.obj = _replace_meta(raw.obj, _Materialise(path, sources, plan.torch_map_location(tags)))
    raw.tags = {**raw.tags, **tags}
    raw.refs = {}
    return raw


class _Materialise:
    """A meta tensor → the same tensor with its values: its storage fetched once and mapped once."""

    def __init__(self, path: str, sources: Sources, restore: Any):
        self.path, self.sources, self.restore = path, sources, restore
        self.storages: dict[int, Any] = {}  # meta storage id -> the mapped storage with the values

    def __call__(self, t: Any) -> Any:
        import torch

        sid = storage_id(t)
        if sid not in self.storages:
            ref = self.sources.refs.get(sid)
            if ref is None or not self.sources.has_bytes(t):
                raise NeedsLocalCopy(self.path, "reading a tensor with no byte range torch-free reading finds (one "
                                     "inside a DCP entry's plain value?)", "torch.load reads it")
            self.storages[sid] = self.restore(self.sources.storage(t), ref.location)
        storage = self.storages[sid]
        out = torch.empty(0, dtype=t.dtype, device=storage.device)  # as torch's _rebuild_tensor
        out.set_(storage, t.storage_offset(), t.shape, t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad:
            out.requires_grad_(True)
        if getattr(t, "__dict__", None):  # python attributes torch.load sets on a tensor (its pickled state)
            out.__dict__.update(t.__dict__)
        return out


def _replace_meta(obj: Any, swap: Any) -> Any:
    """``obj`` with every meta tensor ``t`` inside it replaced by ``swap(t)``: containers changed in place
    (a state dict keeps its type and ``_metadata``), tuples rebuilt; an object met twice is replaced once."""
    import torch

    memo: dict[int, Any] = {}

    def walk(o: Any) -> Any:
        if id(o) in memo:
            return memo[id(o)]
        if isinstance(o, torch.Tensor):
            memo[id(o)] = swap(o) if o.is_meta else o
            return memo[id(o)]
        if o is None or isinstance(o, (str, bytes, int, float, complex, bool, type)):
            return o
        memo[id(o)] = o  # (in place: a cycle through it ends here)
        if isinstance(o, dict):
            for k, v in list(o.items()):
                if (new := walk(v)) is not v:
                    o[k] = new
        elif isinstance(o, (list, deque)):
            for i, v in enumerate(o):
                if (new := walk(v)) is not v:
                    o[i] = new
        elif isinstance(o, tuple):
            items = [walk(v) for v in o]
            if any(a is not b for a, b in zip(items, o)):
                cls: Any = type(o)  # (a named tuple: its _make)
                memo[id(o)] = tuple(items) if cls is tuple else cls._make(items) if hasattr(cls, "_make") else cls(*items)
        if hasattr(o, "__dict__") and not isinstance(o, torch.Tensor):
            for k, v in list(vars(o).items()):
                if (new := walk(v)) is not v:
                    setattr(o, k, new)
        return memo[id(o)]

    return walk(obj)
