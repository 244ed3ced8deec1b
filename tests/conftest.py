"""Shared test helpers: the committed fixtures, the training script, comparisons with recorded values,
GPU-tagged saves, CLI runner."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

# The tests mirror the package (tests/safety/, tests/formats/ …) and share corpora and strategies by importing
# each other's modules (``import test_hostile`` for its CASES): every folder of tests is importable by name.
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def _load_train_module() -> Any:
    spec = importlib.util.spec_from_file_location("ckptfix_fixtures_train", FIXTURES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def train() -> Any:
    """fixtures/train.py as a module: mlp(), resnet18(), fixed_input(), generate(), MODES."""
    return _load_train_module()


@pytest.fixture(scope="session")
def manifest() -> dict[str, Any]:
    """fixtures/manifest.json's ``fixtures`` table: file name → entry."""
    return json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@contextlib.contextmanager
def fake_location(tag: str | Callable[[Any], str]) -> Iterator[None]:
    """Make ``torch.save`` record ``tag`` (or ``tag(storage)``) as every storage's device.

    A GPU-saved file differs from a CPU one only in these tags, so this makes real
    cuda-tagged files on a machine without a GPU.
    """
    import torch

    fn = tag if callable(tag) else (lambda _storage: tag)
    with mock.patch.object(torch.serialization, "location_tag", fn):
        yield


def recorded_tolerance(got: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing ``got`` with a value recorded elsewhere: ckptfix's own table
    (:data:`ckptfix.model.forward.RECORDED_TOLERANCE`; float32: atol 1e-6, rtol 1e-5) by got's dtype.
    Python floats and numpy arrays count as float32: a training run logs them from float32 tensors."""
    import torch

    from ckptfix.model.forward import recorded_tolerance as by_dtype

    return by_dtype(got.dtype if isinstance(got, torch.Tensor) else torch.float32)


def close_to_recorded(got: Any, recorded: Any) -> bool:
    """``got`` (a tensor, numpy array or float computed in this run) equals ``recorded`` (the same value
    recorded on another machine) within :func:`recorded_tolerance`: same dtype and shape, NaN equal to NaN."""
    import numpy as np
    import torch

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
    import torch

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
    import torch

    from ckptfix.model.golden import write_golden

    recipe = {"shape": entry["input"]["shape"], "dtype": "float", "range": None, "seed": entry["input"]["seed"]}
    write_golden(path, {"output": torch.tensor(entry[output], dtype=torch.float32)}, recipe, "float32",
                 checkpoint=entry["file"])
    return path


def mapped_from(t: Any) -> str:
    """The file a tensor's memory is mapped from, per /proc/self/maps ('' for anonymous memory).

    Proves a read is lazy: tensor bytes still in the checkpoint file's pages, not copied.
    """
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return ""


@pytest.fixture
def cli_runner() -> Any:
    from click.testing import CliRunner

    return CliRunner()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture
def refused_as_damage(cli_runner: Any, tmp_path: Path) -> Callable[[str, Path], str]:
    """Run ``command`` (scan, inspect or convert) on ``path``; assert exit 1, one Error line naming the file,
    no --trust hint and nothing written; return the line."""

    def run(command: str, path: Path) -> str:
        out = tmp_path / "refused-out"
        out.mkdir(exist_ok=True)
        argv = {"scan": ["scan", str(path)], "inspect": ["inspect", str(path)],
                "convert": ["convert", str(path), str(out / "o.safetensors")]}[command]
        from ckptfix.cli import cli

        res = cli_runner.invoke(cli, argv)
        assert res.exit_code == 1 and res.stdout == "", res.output
        assert res.stderr.startswith(f"Error: {path}: ") and res.stderr.count("\n") == 1, res.stderr
        assert "--trust" not in res.stderr and list(out.iterdir()) == []
        return res.stderr

    return run
