"""Shared fixtures: the committed fixtures and their manifest, the training script, the CLI runner, the refusal
check of damaged files; and the GPU marker's skip. Plain helpers live in helper modules (tests/compare.py …)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.fixture(params=["avx2", "portable", "numpy"])
def check_kernels(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the NaN/Inf check runs: the compiled kernels (``ckptfix.core._scan``) with AVX2 and without, and numpy
    (``CKPTFIX_NO_NATIVE=1``, a build without a C compiler); a kernel this build or CPU lacks is skipped
    (tests/core/test_scan.py fails where a compiler is but the kernels weren't built)."""
    from ckptfix.core import tensorcopy

    kernels = tensorcopy.native()
    if request.param == "numpy":
        monkeypatch.setattr(tensorcopy, "_scan", None)  # (as CKPTFIX_NO_NATIVE=1 leaves it)
        return "numpy"
    if kernels is None:
        pytest.skip("ckptfix.core._scan is not built")
    try:
        before = kernels.set_isa(request.param)
    except ValueError:
        pytest.skip(f"no {request.param} kernels on this CPU")
    request.addfinalizer(lambda: kernels.set_isa(before))
    return str(request.param)
