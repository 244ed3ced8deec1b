"""ckptfix/errors.py: each public error is the built-in type it claims, and a real situation raises it."""

from __future__ import annotations

import fractions
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix import errors
from ckptfix.model import forward, inputs, spec as models
from ckptfix.statedict import locate, transforms, wrappers
from ckptfix.core import limits
from ckptfix.core.devices import parse_cli_map_location

ROOT = Path(__file__).resolve().parent.parent
_BUILTINS = (ValueError, LookupError, RuntimeError, OSError, MemoryError)


def _unsafe(tmp: Path, fx: Path) -> Any:
    torch.save({"w": torch.zeros(2), "ratio": fractions.Fraction(1, 2)}, tmp / "unsafe.pth")
    return ckptfix.read(tmp / "unsafe.pth")


def _limit(tmp: Path, fx: Path) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(limits.ENV["max_depth"], "lots")
        return limits.current()


def _load(tmp: Path, fx: Path) -> Any:
    torch.save({"other.weight": torch.zeros(2, 2)}, tmp / "other.pth")
    return ckptfix.load_into(torch.nn.Linear(2, 2), tmp / "other.pth")


def _deepspeed(tmp: Path, fx: Path) -> Any:
    (tmp / "ds").mkdir()
    (tmp / "ds" / "latest").write_text("global_step9")
    return ckptfix.read(tmp / "ds")


def _forward(tmp: Path, fx: Path) -> Any:
    return forward.run_model(torch.nn.Linear(3, 2), (torch.zeros(1, 4),))


def _raise(fn: Callable[[], Any]) -> Callable[[Path, Path], Any]:
    return lambda tmp, fx: fn()


#: every public error → the built-in it also is (None: none) → a real situation that raises it
CASES: list[tuple[type[errors.CkptfixError], type[Exception] | None, Callable[[Path, Path], Any]]] = [
    (errors.FormatError, ValueError, lambda tmp, fx: ckptfix.read(fx / "manifest.json")),
    (errors.MissingFileError, FileNotFoundError, lambda tmp, fx: ckptfix.read(tmp / "nope.pth")),
    (errors.DestinationError, OSError, lambda tmp, fx: ckptfix.convert(fx / "mlp_ddp.pth", fx / "mlp_dp.pth")),
    (errors.UnsafeCheckpointError, None, _unsafe),
    (errors.DeviceError, ValueError, _raise(lambda: parse_cli_map_location(("cpu", "cuda:0=cpu")))),
    (errors.SelectError, LookupError, _raise(lambda: locate.find_state_dict({"epoch": 3}))),
    (errors.KeyCollisionError, ValueError, _raise(lambda: wrappers.rename_state_dict({"a": 1, "b": 2}, lambda k: "c"))),
    (errors.WrapperError, ValueError, _raise(lambda: wrappers.key_transform(to="fsdp9"))),
    (errors.ConversionError, ValueError, _raise(lambda: transforms.parse_dtype("fp8"))),
    (errors.ModelSpecError, ValueError, _raise(lambda: models.parse_model_args(["num_classes"]))),
    (errors.LoadError, RuntimeError, _load),
    (errors.LimitError, None, _limit),
    (errors.DeepSpeedZeroError, ValueError, _deepspeed),
    (errors.InputError, ValueError, _raise(lambda: inputs.parse_range("30522,0"))),
    (errors.GoldenError, ValueError,
     lambda tmp, fx: ckptfix.verify(fx / "mlp_single.pth", torch.nn.Linear(2, 2), record_golden=True)),
    (errors.ForwardError, RuntimeError, _forward),
    (errors.SigningError, ValueError,  # a signature to check, and no key to check it with
     lambda tmp, fx: ckptfix.verify(fx / "mlp_single.pth", torch.nn.Linear(2, 2), signature=tmp / "model.sig")),
    (errors.RemoteError, OSError, lambda tmp, fx: ckptfix.read("https://example.com/model.pth")),  # (no request sent)
    (errors.NeedsLocalCopy, OSError, lambda tmp, fx: ckptfix.read("https://example.com/model.pth", trust=True)),
]


def test_every_public_error_is_listed() -> None:
    public = {c for _, c in inspect.getmembers(errors, inspect.isclass)
              if issubclass(c, errors.CkptfixError) and c is not errors.CkptfixError}
    assert public == {c for c, _, _ in CASES}


@pytest.mark.parametrize("error, builtin, trigger", CASES, ids=[c.__name__ for c, _, _ in CASES])
def test_error_is_its_builtin_and_is_raised(error: type[errors.CkptfixError], builtin: type[Exception] | None,
                                            trigger: Callable[[Path, Path], Any], fixtures_dir: Path,
                                            tmp_path: Path) -> None:
    with pytest.raises(error) as info:
        trigger(tmp_path, fixtures_dir)
    e = info.value
    assert type(e) is error and isinstance(e, errors.CkptfixError)
    if builtin is None:  # caught as a built-in, it would be taken for another failure (inside ckptfix too)
        assert not isinstance(e, _BUILTINS)
    else:
        assert isinstance(e, builtin)
    assert str(e) and "\n" not in str(e) and not str(e).startswith(("'", "[Errno"))  # the message alone, one line


def test_no_bare_ckptfix_error_is_raised() -> None:
    """Each failure raises a specific subclass, so callers (and ``--json``'s ``error_type``) can tell them apart."""
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "ckptfix").rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bCkptfixError\(", line)
            and not line.lstrip().startswith("class ")]
    assert not bare
