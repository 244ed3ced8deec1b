"""The torch-free describe path against the torch path: what several test modules compare through both.

``outcome``/``assert_same``: ``describe`` and ``inspect`` of one path with the torch-free switch on and off;
``fixture_paths``: every committed fixture; ``save_both``: a checkpoint as torch.save and safetensors files;
``PROBE``: a child's ``ckptfix`` run that reports whether it imported torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.tensorinfo import TensorInfo
from ckptfix.core.torch_free import ENV_SWITCH
from tests import quant_files

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
#: the formats the torch-free path describes itself (the rest go through torch by design)
DESCRIBED = {"torch-zip", "safetensors", "sharded-safetensors", "sharded-pth", "dcp"}


def outcome(path: Path, torch_free: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``inspect --json`` and the text output, or the error class, through one path."""
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    try:
        ckpt = ckptfix.describe(path)
    except ckptfix.CkptfixError as e:
        return type(e).__name__
    from click.testing import CliRunner

    text = CliRunner().invoke(cli, ["inspect", str(path)])
    return json.dumps(ckpt.to_dict(), default=str, indent=1), text.output, text.exit_code


def assert_same(path: Path, monkeypatch: pytest.MonkeyPatch, described: bool | None = None) -> Any:
    """``path`` gives the same through both paths; with ``described``, whether the torch-free path took it."""
    fast, slow = outcome(path, True, monkeypatch), outcome(path, False, monkeypatch)
    assert fast == slow, path
    if described is not None:
        monkeypatch.setenv(ENV_SWITCH, "1")
        took = not isinstance(fast, str) and all(isinstance(v, TensorInfo) or not _is_tensor(v)
                                                for v in ckptfix.describe(path).state_dict.values())
        assert took == described, f"{path}: torch-free path {'not ' if described else ''}taken"
    return fast


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, TensorInfo))


def fixture_paths() -> list[Path]:
    """Every committed checkpoint fixture: the files by suffix, and the directories (not fixtures/quant/, the
    quantized releases of tests/quant_files)."""
    return sorted(p for p in FIXTURES.iterdir() if p.suffix in (".pth", ".pt", ".ckpt", ".tar", ".safetensors")
                  or p.is_dir() and not p.name.startswith(("_", ".")) and p != quant_files.QUANT)


def save_both(obj: Any, d: Path) -> Any:
    """``obj`` as d/ckpt.pth (torch.save) and its state dict as d/ckpt.safetensors; returns the state dict."""
    torch.save(obj, d / "ckpt.pth")
    inner = obj.get("state_dict", obj.get("model"))
    sd = inner if isinstance(inner, dict) else obj  # a state dict may hold a tensor named "model" itself
    save_file(safetensors_copy(sd), d / "ckpt.safetensors")
    return sd


def safetensors_copy(sd: Any) -> dict[str, torch.Tensor]:
    """The tensors safetensors can hold, each contiguous, a tensor shared by several keys kept once."""
    from ckptfix.parse.safetensors_header import DTYPES

    out, seen = {}, {}
    for k, t in sd.items():
        if isinstance(t, torch.Tensor) and str(t.dtype).removeprefix("torch.") in DTYPES.values():
            sid = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()), t.shape)
            out[k] = seen.setdefault(sid, t.detach().contiguous().clone()) if t.numel() else t.detach().clone()
    unique: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for k, t in out.items():  # safetensors refuses shared tensors: keep the first of each
        if id(t) not in taken:
            taken.add(id(t))
            unique[k] = t
    return unique


#: ``python -c PROBE ARGS…``: runs ``ckptfix ARGS…`` and says on stderr whether it imported torch (TORCH=…)
PROBE = ("import atexit, sys\n"
          "atexit.register(lambda: sys.stderr.write(f\"\\nTORCH={'torch' in sys.modules}\\n\"))\n"
          "from ckptfix.cli import main\nsys.argv = ['ckptfix', *sys.argv[1:]]\nmain()\n")
