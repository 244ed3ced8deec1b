"""Shared test helpers: the committed fixtures, the training script, GPU-tagged saves, CLI runner."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


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
