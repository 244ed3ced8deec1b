"""Comparisons the tests share: with a value recorded on another machine (the fixtures' manifest), bit for bit
(two state dicts, two loaded checkpoints, a tensor's raw bytes), and with torch's own verdict on a file."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptfix.model.forward import recorded_tolerance as by_dtype
from ckptfix.model.golden import write_golden


def recorded_tolerance(got: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing ``got`` with a value recorded elsewhere: ckptfix's own table
    (:data:`ckptfix.model.forward.RECORDED_TOLERANCE`; float32: atol 1e-6, rtol 1e-5) by got's dtype.
    Python floats and numpy arrays count as float32: a training run logs them from float32 tensors."""
    return by_dtype(got.dtype if isinstance(got, torch.Tensor) else torch.float32)


def close_to_recorded(got: Any, recorded: Any) -> bool:
    """``got`` (a tensor, numpy array or float computed in this run) equals ``recorded`` (the same value
    recorded on another machine) within :func:`recorded_tolerance`: same dtype and shape, NaN equal to NaN."""
    atol, rtol = recorded_tolerance(got)
    if isinstance(got, torch.Tensor):
        return (isinstance(recorded, torch.Tensor) and got.dtype == recorded.dtype and got.shape == recorded.shape
                and bool(torch.isclose(got.double(), recorded.double(), atol=atol, rtol=rtol, equal_nan=True).all()))
    if isinstance(got, np.ndarray):
        return (isinstance(recorded, np.ndarray) and got.dtype == recorded.dtype and got.shape == recorded.shape
                and bool(np.allclose(got, recorded, atol=atol, rtol=rtol, equal_nan=True)))
    return math.isclose(got, recorded, rel_tol=rtol, abs_tol=atol) or (math.isnan(got) and math.isnan(recorded))


def assert_close_to_recorded(got: Any, recorded: Any, what: str = "output") -> None:
    """A tensor computed in this run against one recorded on another machine (a fixtures manifest's
    ``output``, nested lists of floats): same shape, every element within :func:`recorded_tolerance`
    of got's dtype, never bit for bit (other CPUs round float kernels differently). Values computed
    in this run are compared with ``torch.equal`` instead."""
    atol, rtol = recorded_tolerance(got)
    want = torch.as_tensor(recorded, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, recorded {list(want.shape)}"
    diff = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert bool(torch.isclose(got.double(), want, atol=atol, rtol=rtol).all()), (
        f"{what}: max abs diff {diff:.3g} from the recorded value, beyond the recorded-value tolerance for "
        f"{str(got.dtype).removeprefix('torch.')} (atol={atol:g}, rtol={rtol:g})")


def golden_from_manifest(entry: dict[str, Any], path: Path, output: str = "output") -> Path:
    """Write a fixtures manifest entry's recorded ``output`` (or ``ema_output``) and input recipe as a golden
    file that ``verify --golden`` compares with (recorded on another machine, as a manifest's values are)."""
    recipe = {"shape": entry["input"]["shape"], "dtype": "float", "range": None, "seed": entry["input"]["seed"]}
    write_golden(path, {"output": torch.tensor(entry[output], dtype=torch.float32)}, recipe, "float32",
                 checkpoint=entry["file"])
    return path


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ordered: bool = True) -> None:
    """Same keys (in the same order unless ``ordered`` is False), same dtypes, shapes and bits."""
    assert (list(got) if ordered else sorted(got)) == (list(want) if ordered else sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def differences(a: Any, b: Any, where: str = "", recorded: bool = False) -> list[str]:
    """Where two loaded checkpoints differ: types, dict keys and their order, lengths, values (tensors
    and arrays bit for bit, dtype included). Objects compare by class name and attributes (``@``).
    ``recorded``: ``b`` was made on another machine, so its tensors, arrays and floats need only be
    within the recorded-value tolerance of ``a``'s (:func:`close_to_recorded`)."""
    if type(a).__qualname__ != type(b).__qualname__:
        return [f"{where}: {type(a).__qualname__} vs {type(b).__qualname__}"]
    floating = (isinstance(a, float) or isinstance(a, np.ndarray) and a.dtype.kind == "f"
                or isinstance(a, torch.Tensor) and a.is_floating_point())
    if recorded and floating:
        return [] if close_to_recorded(a, b) else [where]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, np.ndarray):
        return [] if a.dtype == b.dtype and np.array_equal(a, b) else [where]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}", recorded)]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{where}[{i}]", recorded)]
    if isinstance(getattr(a, "__dict__", None), dict) and not callable(a):
        return differences(vars(a), vars(b), f"{where}@", recorded)
    return [] if a == b or a is b else [where]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, via a fresh stride-1 copy (``contiguous()`` keeps odd strides on size-1 dims)."""
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1)).view(torch.uint8)


def torch_refuses(path: Path, in_child: bool = False) -> bool:
    """torch.load(weights_only=True) refuses or fails on ``path`` (in a child process where torch's own
    unpickler may crash: it hashes dict keys of any depth, recursing in C)."""
    if in_child:
        code = "import sys, torch; torch.load(sys.argv[1], weights_only=True)"
        return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120).returncode != 0
    try:
        torch.load(path, weights_only=True)
    except Exception:  # any refusal or failure counts
        return True
    return False
