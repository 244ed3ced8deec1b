"""Lightning for the tests: the LightningModule the real-library tests train, and the session's real sharded run.

``lit_class()`` is the MLP as ``self.model`` of a LightningModule (tests/test_real_libraries.py trains it;
tests/real_lightning_sharded.py, a child process, shards it). ``sharded_run`` is a session fixture: that script
run once (a real 2-process ``Trainer.fit`` writing Lightning's sharded directories), for
tests/formats/test_lightning_dirs.py and tests/test_readme.py, which import it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

TESTS = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def lit_class() -> type:
    """The LightningModule class: the MLP as ``self.model`` (keys ``model.*``), defined once Lightning is imported."""
    import lightning as L

    class LitMLP(L.LightningModule):
        """The MLP as ``self.model`` (keys ``model.*``), Adam + StepLR, hyper-parameters saved."""

        def __init__(self, lr: float = 1e-2, arch: str = "mlp"):
            super().__init__()
            self.save_hyperparameters()
            self.model = _train_module().mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)}

    return LitMLP


def _train_module() -> Any:
    return sys.modules["ckptfix_fixtures_train"]  # conftest's `train` fixture loads it first


@dataclass
class ShardedRun:
    """What the real sharded run wrote, and the state it held at that save."""
    dirs: dict[str, Path]  # strategy (or "Fabric") → the directory it saved
    truth: dict[str, Any]  # the run's full state at that save (real_lightning_sharded.py's truth.pt)


@pytest.fixture(scope="session")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> ShardedRun:
    """tests/real_lightning_sharded.py run once per session (minutes): its directories and the run's state. Under
    pytest-xdist the workers share one run: the first makes it (under a file lock), the others read it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the workers' common base directory
    from filelock import FileLock

    with FileLock(str(shared / "lightning_sharded.lock")):
        return _run_child(shared / "lightning_sharded")


@functools.cache
def _run_child(out: Path) -> ShardedRun:
    """Once per session, though two test modules import the fixture (each its own fixture, one run); a run another
    xdist worker finished (its ``done`` marker) is read as it is."""
    best = out / "checkpoints" / "epoch=2-step=3.ckpt"
    if not (out / "done").exists():
        out.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                                 "WORLD_SIZE", "NODE_RANK")}
        res = subprocess.run([sys.executable, str(TESTS / "real_lightning_sharded.py"), str(out)], cwd=out,
                             capture_output=True, text=True, timeout=300, env={**env, "PYTHONWARNINGS": "ignore"})
        assert res.returncode == 0, res.stderr[-4000:]
        assert Path(res.stdout.strip().splitlines()[-1]) == best and best.is_dir()
        (out / "done").touch()
    assert sorted(p.name for p in best.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    truth = torch.load(out / "truth.pt", weights_only=False)  # the child's own plain save
    return ShardedRun({"ModelParallelStrategy": best, "FSDPStrategy": out / "fsdp", "Fabric": out / "fabric"}, truth)
