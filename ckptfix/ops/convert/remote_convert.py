"""``convert`` from a URL: what it can do without a local copy, and the refusal, with its reason, of what it can't.

A remote torch zip, safetensors file or Hugging Face sharded checkpoint is converted on the torch-free path: its
structure described from header ranges, its tensor bytes copied range by range into the atomic temp output
(:mod:`ckptfix.core.rangecopy`), each zip record's CRC-32 checked from the bytes as fetched. A request that needs
torch's reader (``--trust``, a ``--dtype`` cast, ``--by-order``, a device other than the CPU, a file or a value only
torch reads exactly) would read the whole file with torch: refused here, never downloaded silently.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ...core import locations, torch_free
from ...errors import NeedsLocalCopy
from ...parse import format_registry as registry
from ..convert_options import ConvertOptions, flag_of


def refuse_torch(req: Any, why: str | None = None) -> None:
    """Raise NeedsLocalCopy for a remote source the conversion would read with torch (``why``: what needs it, when
    the torch-free writer said so); nothing for a local one."""
    if not locations.is_remote(req.src):
        return
    sources = ", ".join(f.label or f.name for f in registry.FORMATS.values() if "convert" in f.from_url)
    outputs = ", ".join(f.extensions[0] for f in registry.FORMATS.values() if f.write_without_torch)
    raise NeedsLocalCopy(req.src, "converting it", f"{why or _why(req)} needs torch's reader, which reads a local file; "
                         f"a URL of {sources} converts to {outputs} or shards without torch: drop the option")


def _why(req: Any) -> str:
    """What sends ``req`` to torch's reader: an option or the file's format (:func:`needs_torch`), else the checkpoint."""
    return needs_torch(req) or "this checkpoint (a tensor bound for another device, or a value only torch reads exactly)"


def needs_torch(req: Any) -> str | None:
    """Why the conversion ``req`` (a validated :class:`~ckptfix.ops.convert.steps.Request`) needs torch's reader, by
    the option (its command-line flag) or the format that asks for it; None where the torch-free path can take it
    (then only what the checkpoint holds can still need torch). The planner asks this, and a URL's refusal says it."""
    if req.trust:
        return _flag("trust")
    if req.dtype is not None:
        return f"{_flag('dtype')} {req.dtype} (the cast)"
    if req.dequantize:
        return _flag("dequantize")
    if req.by_order is not None:
        return _flag("by_order")
    if not torch_free.enabled():
        return f"{torch_free.ENV_SWITCH}=0"
    if not registry.get(req.fmt_in).copy_without_torch:
        return f"a {req.fmt_in} source"
    if not registry.get(req.fmt_out).write_without_torch:
        return f"{req.fmt_out} output"
    if req.plan.fixed != "cpu" and req.plan.mapping is None:
        return "map_location other than the CPU"
    return None


def _flag(option: str) -> str:
    """``--dtype`` for ``dtype``: the command-line spelling :class:`ConvertOptions` declares for the option."""
    return flag_of(next(f for f in fields(ConvertOptions) if f.name == option)).decls[0]
