"""Forward equivalence: a model run in eval mode, its outputs by name, compared within a tolerance.

The default float input is the fixtures' own (``fixtures/train.py``): ``torch.randn(*shape)`` from a
``torch.Generator`` seeded with ``seed``, so outputs recorded elsewhere can be reproduced; other
inputs (token IDs, files) are :mod:`ckptfix.model.inputs`' recipes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ForwardError
from ..core.units import dtype_name
from ..ops.diff import tensor_diff
from .verify_options import INPUT_SEED

#: ``(atol, rtol)`` for an output compared with one recorded elsewhere (a golden file, a fixtures manifest),
#: by the output's dtype: another CPU (AVX-512, AVX2, none) or a GPU rounds float kernels differently in
#: the last bits, so a recorded value is never compared bit for bit. float16/bfloat16/float64: the
#: defaults of ``torch.testing.assert_close`` for that dtype; other floating dtypes (float8 …) use
#: bfloat16's; integer and bool outputs stay exact.
RECORDED_TOLERANCE: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-6, 1e-5),
    "float16": (1e-5, 1e-3),
    "bfloat16": (1e-5, 1.6e-2),
}
_COMPLEX_PARTS = {"complex128": "float64", "complex64": "float32", "complex32": "float16"}


@dataclass
class ForwardRequest:
    """What the forward check compares with, on which input, within which tolerance (:func:`ckptfix.verify`)."""

    reference: Any = None
    golden: Any = None
    record_golden: bool = False
    atol: float | None = None
    rtol: float | None = None
    input_shape: tuple[int, ...] | None = None
    input_dtype: str | None = None
    input_range: tuple[float, float] | None = None
    inputs: Any = None
    seed: int = INPUT_SEED

    @property
    def ignored(self) -> str:
        """``; --reference, --golden ignored`` for the notes of a run without the forward check."""
        names = [n for n, v in (("--reference", self.reference), ("--golden", self.golden)) if v is not None]
        return f"; {', '.join(names)} ignored" if names else ""




def seeded_input(shape: tuple[int, ...], seed: int = INPUT_SEED) -> Any:
    """``torch.randn(*shape)`` from a generator seeded with ``seed`` (the fixtures' recipe)."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_model(net: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, what: str = "input") -> Any:
    """``net(*args, **kwargs)`` in eval mode without gradients; tensors moved to the model's device, and
    floating ones to its floating dtype (integer token IDs stay integers)."""
    import torch

    param = next((p for p in net.parameters() if p.is_floating_point()), None)

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or param is None:
            return v
        return v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device)

    args, kwargs = tuple(move(a) for a in args), {k: move(v) for k, v in (kwargs or {}).items()}
    net.eval()
    try:
        with torch.no_grad():
            return net(*args, **kwargs)
    except Exception as e:  # the user's forward can raise anything
        raise ForwardError(f"the model's forward on {what} failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); pass the right --input-shape, --input-dtype "
                           "and --input-range, or the tensors themselves with --input FILE") from None


def named_outputs(out: Any, prefix: str = "output") -> dict[str, Any]:
    """Every tensor in a model's output by its path: ``{'output': t}``, ``{'output.0': …, 'output.1': …}``,
    ``{'output.logits': …}`` (tuples, lists and dicts, nested); the names a golden file stores."""
    import torch

    if isinstance(out, torch.Tensor):
        return {prefix: out}
    items = out.items() if isinstance(out, dict) else enumerate(out) if isinstance(out, (list, tuple)) else ()
    return {name: t for k, v in items for name, t in named_outputs(v, f"{prefix}.{k}").items()}


def recorded_tolerance(dtype: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for an output of ``dtype`` compared with a recorded value (:data:`RECORDED_TOLERANCE`).

    >>> recorded_tolerance(torch.float32)   # doctest: +SKIP
    (1e-06, 1e-05)
    """
    name = dtype_name(dtype)
    name = _COMPLEX_PARTS.get(name, name)
    if name in RECORDED_TOLERANCE:
        return RECORDED_TOLERANCE[name]
    return RECORDED_TOLERANCE["bfloat16"] if getattr(dtype, "is_floating_point", False) else (0.0, 0.0)


def pick_tolerance(got: dict[str, Any], atol: float | None, rtol: float | None, default: str = "exact") -> dict[str, Any]:
    """The tolerance one comparison of the named outputs ``got`` uses, as its ``forward.against`` row reports it.

    ``atol``/``rtol`` None or 0 mean "not given". Given (either non-zero): those, for any comparison
    (``tolerance: "given"``). Not given, ``default`` says which: ``"exact"`` (bit for bit: both computed
    in this run), ``"recorded"`` (against a value recorded elsewhere: :func:`recorded_tolerance` of
    the output's dtype) or ``"dtype"`` (a half-precision run against a reference cast to the same
    dtype: the same table); the loosest over the output's tensors.
    """
    dtypes = sorted({dtype_name(t.dtype) for t in got.values()})
    if atol or rtol:
        return {"atol": float(atol or 0.0), "rtol": float(rtol or 0.0), "tolerance": "given", "output_dtypes": dtypes}
    if default == "exact":
        return {"atol": 0.0, "rtol": 0.0, "tolerance": "exact", "output_dtypes": dtypes}
    pairs = [recorded_tolerance(t.dtype) for t in got.values()] or [(0.0, 0.0)]
    return {"atol": max(a for a, _ in pairs), "rtol": max(r for _, r in pairs), "tolerance": default,
            "output_dtypes": dtypes}




def compare_outputs(what: str, where: str, got: dict[str, Any], want: dict[str, Any], atol: float | None,
                    rtol: float | None, recipe: Any, default: str = "exact") -> dict[str, Any]:
    """One ``forward.against`` row comparing named outputs (:func:`named_outputs`) made from ``recipe``'s
    input, matched by name (a file's order is its own); ``max_abs_diff`` is None when the names or
    shapes differ. ``default``: see :func:`pick_tolerance`."""
    tol = pick_tolerance(got, atol, rtol, default)
    row: dict[str, Any] = {"what": what, "path": where, "input_shape": list(recipe.shape) if recipe.shape else None,
                           "seed": recipe.seed, "input": recipe.to_dict(), "max_abs_diff": None, "ok": False, **tol}
    if got and set(got) == set(want) and all(got[k].shape == want[k].shape for k in got):
        diffs = [tensor_diff(got[k].double(), want[k].double(), tol["atol"], tol["rtol"]) for k in got]
        row.update(max_abs_diff=max(d for d, _ in diffs), ok=all(ok for _, ok in diffs))
    return row
