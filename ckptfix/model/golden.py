"""Golden outputs: a model's outputs for the forward input, recorded once in a safetensors file and
compared with on later runs within the recorded-value tolerance (:data:`ckptfix.model.forward.RECORDED_TOLERANCE`).

The file holds one tensor per output (named as :func:`ckptfix.model.forward.named_outputs` names them)
and, in its metadata under ``ckptfix.golden`` (JSON), the input recipe (shape, dtype, range, seed;
or the digest of the ``--input`` tensors), the serving dtype the model ran in, and what was run:
so a later compare makes the same input in the same dtype.

>>> ckptfix.verify("release.safetensors", "mypkg:build", golden="golden.safetensors")   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .. import formats
from ..core.atomic import atomic_path
from ..core.devices import DevicePlan
from ..errors import FormatError
from ..core.units import dtype_name
from ..parse.safetensors_header import read_header

META_KEY = "ckptfix.golden"
VERSION = 1


@dataclass
class Golden:
    """A golden file: the recorded ``outputs`` (name → tensor), the ``input`` recipe and serving ``dtype``."""

    path: str
    outputs: dict[str, Any]
    input: dict[str, Any]
    dtype: str
    info: dict[str, Any] = field(default_factory=dict)


def read_golden(path: Any) -> Golden:
    """Read a golden file with ckptfix's own safetensors reader (validated, no code runs)."""
    path = os.fspath(path)
    fmt = formats.sniff(path)
    if fmt != formats.SAFETENSORS:
        raise FormatError(f"{path}: is a {fmt} file; golden outputs are a .safetensors file that verify --golden records")
    _, _, meta = read_header(path)
    try:
        info = json.loads(meta[META_KEY])
        recipe, dtype = info["input"], str(info["dtype"])
        if not isinstance(recipe, dict):
            raise TypeError("input is not an object")
    except KeyError:
        raise FormatError(f"{path}: has no {META_KEY!r} metadata: not golden outputs that verify recorded; record "
                          "them with `ckptfix verify … --golden PATH --record-golden`") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise FormatError(f"{path}: its {META_KEY!r} metadata is malformed ({e})") from None
    outputs = formats.read(path, fmt, DevicePlan("cpu", source=path), trust=False).obj
    return Golden(path, dict(outputs), recipe, dtype, {k: v for k, v in info.items() if k not in ("input", "dtype")})


def write_golden(path: Any, outputs: dict[str, Any], recipe: dict[str, Any], dtype: str, **info: Any) -> None:
    """Write ``outputs`` (name → tensor) and the recipe atomically: a failed write leaves no file."""
    import torch
    from safetensors.torch import save_file

    path = os.fspath(path)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in outputs.items()}
    meta = {"format": "pt", META_KEY: json.dumps({"version": VERSION, "input": recipe, "dtype": dtype,
                                                  "torch": torch.__version__, **info}, default=str)}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=meta)


def summary(outputs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {shape, dtype}}`` for a report."""
    return {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in outputs.items()}
