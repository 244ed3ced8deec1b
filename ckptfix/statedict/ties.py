"""Tied tensors: keys holding the same view of one storage, and giving each key a storage of its own.

``convert --untie`` uses it: safetensors stores a tied tensor once (the other keys as aliases only ckptfix's
reader restores), so ``safetensors.torch.load_file`` returns one key of the tie; an untied state dict is
written once per key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..core.devices import storage_id
from ..core.tensorinfo import TensorInfo, is_tensor, math_bits


def untie_aliases(state_dict: Mapping[str, Any], refs: dict | None = None) -> tuple[OrderedDict, list[str]]:
    """Every key holding the same view of a storage as an earlier key (tied weights) gets a storage of its
    own, so a writer that stores tied tensors once (safetensors) writes it again under its own key.

    The new storage copies the old one; for a structure read (on meta) it shares the old one's byte range:
    ``refs`` (storage id → byte range) gains the new storage's id. Returns the state dict and the untied keys.
    """
    out: OrderedDict = OrderedDict()
    seen: set[tuple] = set()
    untied: list[str] = []
    for key, t in state_dict.items():
        view = _view(t)
        if view is not None and view in seen and t.numel() > 0:
            untied.append(key)
            t = replace(t, storage=replace(t.storage)) if isinstance(t, TensorInfo) else _own_storage(t, refs)
        elif view is not None:
            seen.add(view)
        out[key] = t
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        out._metadata = meta  # type: ignore[attr-defined]  # torch's own attribute
    return out, untied


def _view(t: Any) -> tuple | None:
    """What makes two entries one tensor: the same storage, offset, shape, stride, dtype and conjugate/negative
    bits (None: not a tensor)."""
    if isinstance(t, TensorInfo):
        return id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype, (False, False)
    if not is_tensor(t):
        return None
    import torch

    if t.layout != torch.strided:
        return None
    return storage_id(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, math_bits(t)


def _own_storage(t: Any, refs: dict | None) -> Any:
    """``t``'s view of a copy of its storage (on meta: a new storage that ``refs`` maps to the old one's bytes)."""
    import torch

    old = t.untyped_storage()
    new = torch.UntypedStorage(old.nbytes(), device="meta") if t.device.type == "meta" else old.clone()
    out = torch.empty(0, dtype=t.dtype, device=t.device).set_(new, t.storage_offset(), t.shape, t.stride())
    bits = torch._utils.get_tensor_metadata(t)  # a conjugate or negative view stays one
    if bits:
        torch._utils.set_tensor_metadata(out, bits)
    if refs is not None and storage_id(t) in refs:
        refs[storage_id(out)] = refs[storage_id(t)]
    return out
