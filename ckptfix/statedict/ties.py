"""Tied tensors: keys holding the same view of one storage, and giving each key a storage of its own.

``convert`` to safetensors uses it by default (``--untie`` names the default): a state dict untied here is written
once per key, so ``safetensors.torch.load_file`` + a strict ``load_state_dict`` take the output. ``--compact-ties``
keeps the compact form instead: each tie stored once, the other keys as aliases only ckptfix's reader restores
(transformers' ``from_pretrained`` re-ties a ``tie_word_embeddings`` head itself; plain ``load_file`` returns one key).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..core.devices import storage_id
from ..core.tensorinfo import TensorInfo, is_tensor, math_bits
from ..core.units import few
from ..errors import ConversionError


def check_request(dst: str, fmt_out: str, stores_aliases: bool, untie: bool, compact: bool) -> None:
    """``--untie`` and ``--compact-ties`` name how a safetensors output stores ties: refused together, and for an
    output that keeps torch's shared storage (a ``.pth``: ``torch.load`` restores every key)."""
    if untie and compact:
        raise ConversionError(f"{dst}: --untie (every tied name stored, the default) and --compact-ties (each tie "
                              "stored once) contradict each other: pass one")
    flag = "--untie" if untie else "--compact-ties" if compact else None
    if flag is not None and not stores_aliases:
        raise ConversionError(f"{dst}: {flag} is for safetensors output, which would store a tied tensor once; a "
                              f"{fmt_out} output keeps tied tensors as torch.save does (torch.load restores each "
                              f"key): drop {flag}")


def untie_notes(untied: list[str], named: bool) -> list[str]:
    """The report's line about the tied keys stored under their own names (always with ``--untie`` named)."""
    if named:
        return [f"--untie: {len(untied)} tied tensor(s) stored under their own keys"
                + (": " + ", ".join(untied[:20]) if untied else "")]
    if not untied:
        return []
    return [f"tied: {len(untied)} tensor(s) stored under their own keys too, so safetensors.torch.load_file returns "
            f"every key: {few(untied)} (--compact-ties stores each tie once, as aliases only ckptfix's reader "
            "and transformers' re-tying restore)"]


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


def one_tensor(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are one tensor as saved (one view of one storage, :func:`_view`): tied in the file."""
    view = _view(a)
    return view is not None and view == _view(b)


def same_values(a: Any, b: Any) -> bool:
    """Two strided tensors hold the same values bit for bit (NaN payloads too), in the same shape and dtype: what a
    model's tie needs of two names a file stores apart (on meta: compare the views of the bytes)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = (t.resolve_conj().resolve_neg().reshape(-1) for t in (a, b))
    return a.numel() == 0 or equal_bytes(a.view(torch.uint8), b.view(torch.uint8))


def equal_bytes(a: Any, b: Any) -> bool:
    """Two contiguous uint8 tensors of one length hold the same bytes, compared 8 at a time where they can be (torch's
    uint8 comparison is a sixth of the speed of its int64 one)."""
    import torch

    whole = a.numel() // 8 * 8
    if whole and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        if not torch.equal(a[:whole].view(torch.int64), b[:whole].view(torch.int64)):
            return False
        a, b = a[whole:], b[whole:]
    return bool(torch.equal(a, b))


def _view(t: Any) -> tuple | None:
    """What makes two entries one tensor: the same storage, offset, shape, stride, dtype and conjugate/negative
    bits (None: not a tensor)."""
    if isinstance(t, TensorInfo):
        return id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype, (False, False)
    if not is_tensor(t):
        return None
    import torch

    if t.layout != torch.strided or t.is_nested:  # (a nested tensor has no one shape: never an alias here)
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
