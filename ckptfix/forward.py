"""Forward equivalence: a seeded input, a model run in eval mode, outputs compared within a tolerance.

The input recipe is the fixtures' own (``fixtures/train.py``): ``torch.randn(*shape)`` from a
``torch.Generator`` seeded with ``seed``, so a fixtures manifest's recorded outputs can be reproduced.
"""

from __future__ import annotations

from typing import Any

from .errors import CkptfixError

#: Seed of the input used for forward checks (the fixtures' own: fixtures/train.py INPUT_SEED).
INPUT_SEED = 1234

#: ``(atol, rtol)`` for an output compared with one recorded elsewhere (a fixtures ``manifest.json``),
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


def seeded_input(shape: tuple[int, ...], seed: int = INPUT_SEED) -> Any:
    """``torch.randn(*shape)`` from a generator seeded with ``seed`` (the fixtures' recipe)."""
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_model(net: Any, x: Any) -> Any:
    """``net(x)`` in eval mode without gradients, ``x`` moved to the model's device and float dtype."""
    import torch

    param = next((p for p in net.parameters() if p.is_floating_point()), None)
    if param is not None:
        x = x.to(param.device, param.dtype)
    net.eval()
    try:
        with torch.no_grad():
            return net(x)
    except Exception as e:  # noqa: BLE001 - the user's forward can raise anything
        raise CkptfixError(f"the model's forward on a {list(x.shape)} input failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); pass the right --input-shape") from None


def as_tensor(value: Any) -> Any:
    """Recorded outputs (nested lists of floats, as a manifest holds them) as a float64 tensor."""
    import torch

    return torch.tensor(value, dtype=torch.float64)


def output_tensors(out: Any) -> list[Any]:
    """Every tensor in a model's output (a tensor, or tuples / lists / dicts of them), in order."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in output_tensors(v)]
    return []


def recorded_tolerance(dtype: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for an output of ``dtype`` compared with a recorded value (:data:`RECORDED_TOLERANCE`).

    >>> recorded_tolerance(torch.float32)   # doctest: +SKIP
    (1e-06, 1e-05)
    """
    name = str(dtype).removeprefix("torch.")
    name = _COMPLEX_PARTS.get(name, name)
    if name in RECORDED_TOLERANCE:
        return RECORDED_TOLERANCE[name]
    return RECORDED_TOLERANCE["bfloat16"] if getattr(dtype, "is_floating_point", False) else (0.0, 0.0)


def pick_tolerance(got: Any, atol: float | None, rtol: float | None, recorded: bool) -> dict[str, Any]:
    """The tolerance one comparison uses, as the ``forward.against`` row reports it.

    ``atol``/``rtol`` None or 0 mean "not given". Given (either non-zero): those, for any comparison
    (``tolerance: "given"``). Not given: bit-exact against a value computed in this run
    (``"exact"``), :func:`recorded_tolerance` of the output's dtype against a recorded one
    (``"recorded"``; the loosest over the output's tensors).
    """
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in output_tensors(got)})
    if atol or rtol:
        return {"atol": float(atol or 0.0), "rtol": float(rtol or 0.0), "tolerance": "given", "output_dtypes": dtypes}
    if not recorded:
        return {"atol": 0.0, "rtol": 0.0, "tolerance": "exact", "output_dtypes": dtypes}
    pairs = [recorded_tolerance(t.dtype) for t in output_tensors(got)] or [(0.0, 0.0)]
    return {"atol": max(a for a, _ in pairs), "rtol": max(r for _, r in pairs), "tolerance": "recorded",
            "output_dtypes": dtypes}


def describe_tolerance(row: dict[str, Any]) -> str:
    """``atol=1e-06, rtol=1e-05: recorded-value default for float32`` for a ``forward.against`` row."""
    dtypes = "/".join(row["output_dtypes"]) or "this output"
    why = {"given": "as given", "exact": "bit-exact, both computed in this run",
           "recorded": f"recorded-value default for {dtypes}"}[row["tolerance"]]
    return f"atol={row['atol']:g}, rtol={row['rtol']:g}: {why}"


def compare_outputs(what: str, where: str, got: Any, want: Any, atol: float | None, rtol: float | None,
                    shape: tuple[int, ...], seed: int, recorded: bool = False) -> dict[str, Any]:
    """One ``forward.against`` row; ``max_abs_diff`` is None when the output structures differ.

    ``recorded``: ``want`` was recorded elsewhere (a manifest), so with no tolerance given it is
    compared within :func:`recorded_tolerance`, not bit for bit (see :func:`pick_tolerance`).
    """
    from .diff import tensor_diff

    tol = pick_tolerance(got, atol, rtol, recorded)
    row: dict[str, Any] = {"what": what, "path": where, "input_shape": list(shape), "seed": seed,
                           "max_abs_diff": None, "ok": False, **tol}
    a, b = output_tensors(got), output_tensors(want)
    if a and len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b)):
        diffs = [tensor_diff(x.double(), y.double(), tol["atol"], tol["rtol"]) for x, y in zip(a, b)]
        row.update(max_abs_diff=max(d for d, _ in diffs), ok=all(ok for _, ok in diffs))
    return row
