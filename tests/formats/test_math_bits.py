"""Conjugate and negative views (issue 27, item 7): ``torch.save`` writes ``x.conj()`` and ``torch._neg_view(x)``
as their stored bytes plus the bits ``_rebuild_tensor_v2``/``_v3`` set again (their metadata argument), so
``torch.load`` returns the conjugated / negated values. A converted ``.pth`` keeps the bits (or holds the resolved
values), a ``.safetensors`` file holds the resolved values: ``torch.load`` of the output equals ``torch.load`` of
the source, bit for bit, on every path (torch-free, which leaves such tensors to torch; streamed; loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH


def _complex() -> torch.Tensor:
    return torch.complex(torch.arange(12.0), torch.arange(12.0) * 0.5 - 3).reshape(3, 4)


def _shared() -> dict[str, torch.Tensor]:
    """One storage viewed plainly, conjugated and negated: none may stand in for another."""
    x, y = _complex(), torch.arange(-3.0, 3.0)
    return {"x": x, "xc": x.conj(), "y": y, "yn": torch._neg_view(y)}


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "conj": lambda: {"c": _complex().conj(), "plain": torch.ones(2)},
    "neg": lambda: {"n": torch._neg_view(torch.arange(-4.0, 4.0).reshape(2, 4)), "plain": torch.ones(2)},
    "both-on-a-view": lambda: {"b": torch._neg_view(_complex().conj())[1:, ::2]},
    "parameter": lambda: {"p": torch.nn.Parameter(_complex().conj(), requires_grad=False),
                          "q": torch.nn.Parameter(torch._neg_view(torch.arange(3.0)))},
    "shared-storage": _shared,
}


def _values(t: torch.Tensor) -> tuple[Any, ...]:
    """What a loaded tensor is, bit for bit: dtype, shape and the bytes of its resolved values."""
    resolved = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.dtype, tuple(t.shape), bytes(resolved.reshape(-1).view(torch.uint8).numpy())


def _convert(via: str, src: Path, dst: Path, cli_runner: Any, *flags: str) -> None:
    if via == "cli":
        res = cli_runner.invoke(cli, ["convert", str(src), str(dst), "-q", *flags])
        assert res.exit_code == 0, res.output
    else:
        options: dict[str, Any] = {"trust": True} if "--trust" in flags else {}
        if "--dtype" in flags:
            options["dtype"] = flags[flags.index("--dtype") + 1]
        ckptfix.convert(src, dst, progress=False, **options)


@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free-first", "torch-path"])
@pytest.mark.parametrize("via", ["cli", "library"])
@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
@pytest.mark.parametrize("case", list(CASES))
def test_convert_keeps_what_torch_loads(case: str, ext: str, via: str, torch_free: str, tmp_path: Path,
                                        cli_runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    src, out = tmp_path / "src.pth", tmp_path / f"out{ext}"
    torch.save(CASES[case](), src)
    want = torch.load(src, weights_only=True)
    assert any(t.is_conj() or t.is_neg() for t in want.values())  # the bits reach torch.load of the source
    _convert(via, src, out, cli_runner)
    got = torch.load(out, weights_only=True) if ext == ".pth" else load_file(out)
    assert {k: _values(t) for k, t in got.items()} == {k: _values(t) for k, t in want.items()}


@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
@pytest.mark.parametrize("flags", [("--trust",), ("--dtype", "fp16")], ids=["loaded", "cast"])
def test_the_loaded_and_cast_paths_keep_them(flags: tuple[str, ...], ext: str, tmp_path: Path, cli_runner: Any) -> None:
    """Loaded by torch (``--trust``), or cast on meta (a cast reads the stored bytes: the bits must apply first;
    torch's ``copy_`` to another dtype drops a negative bit)."""
    src, out = tmp_path / "src.pth", tmp_path / f"out{ext}"
    torch.save(_shared() | CASES["both-on-a-view"]() | CASES["neg"](), src)
    want = torch.load(src, weights_only=True)
    _convert("cli", src, out, cli_runner, *flags)
    got = torch.load(out, weights_only=True) if ext == ".pth" else load_file(out)
    if "--dtype" in flags:
        want = {k: t.resolve_conj().resolve_neg().to(torch.float16) if t.is_floating_point() else t
                for k, t in want.items()}
    assert {k: _values(t) for k, t in got.items()} == {k: _values(t) for k, t in want.items()}


def test_untie_keeps_the_bits(tmp_path: Path, cli_runner: Any) -> None:
    """A tied conjugate view, given a storage of its own for safetensors, is still conjugated."""
    src, out = tmp_path / "src.pth", tmp_path / "out.safetensors"
    c, n = _complex().conj(), torch._neg_view(torch.arange(3.0))
    torch.save({"a": c, "b": c, "m": n, "k": n}, src)
    _convert("cli", src, out, cli_runner, "--untie")
    want = torch.load(src, weights_only=True)
    assert {k: _values(t) for k, t in load_file(out).items()} == {k: _values(t) for k, t in want.items()}
