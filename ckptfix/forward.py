"""Forward equivalence: a seeded input, a model run in eval mode, outputs compared within a tolerance.

The input recipe is the fixtures' own (``fixtures/train.py``): ``torch.randn(*shape)`` from a
``torch.Generator`` seeded with ``seed``, so a fixtures manifest's recorded outputs can be reproduced.
"""

from __future__ import annotations

from typing import Any

from .errors import CkptfixError

#: Seed of the input used for forward checks (the fixtures' own: fixtures/train.py INPUT_SEED).
INPUT_SEED = 1234


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


def compare_outputs(what: str, where: str, got: Any, want: Any, atol: float, rtol: float,
                    shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    """One ``forward.against`` row; ``max_abs_diff`` is None when the output structures differ."""
    from .diff import tensor_diff

    row: dict[str, Any] = {"what": what, "path": where, "input_shape": list(shape), "seed": seed,
                           "max_abs_diff": None, "ok": False}
    a, b = output_tensors(got), output_tensors(want)
    if a and len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b)):
        diffs = [tensor_diff(x.double(), y.double(), atol, rtol) for x, y in zip(a, b)]
        row.update(max_abs_diff=max(d for d, _ in diffs), ok=all(ok for _, ok in diffs))
    return row
