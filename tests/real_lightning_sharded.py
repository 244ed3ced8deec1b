"""Lightning's own sharded checkpoint directories, written by a real 2-process run for tests/formats/test_lightning_dirs.py.

    python tests/real_lightning_sharded.py OUT_DIR

``Trainer.fit`` with ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` on a CPU device mesh, gloo) trains
train.py's MLP as ``self.model`` of a LightningModule (Adam + StepLR, hyper-parameters saved) for
``EPOCHS`` one-batch epochs on 2 processes; ``ModelCheckpoint`` saves each epoch. Written under OUT_DIR:

- ``checkpoints/epoch=2-step=3.ckpt/``: ModelParallelStrategy's sharded directory, all of it Lightning's
  own code path (DCP entries ``state_dict`` and ``optimizer_0``, plus ``meta.pt``).
- ``fsdp/``: the same checkpoint dict saved by Lightning's own ``FSDPStrategy.save_checkpoint`` with
  ``state_dict_type="sharded"`` (DCP entries ``model`` and ``optimizer_0``, plus ``meta.pt``). FSDPStrategy
  itself needs a GPU (FSDP1 refuses a CPU device), so its save method gets ModelParallelStrategy's dict
  from this run: FSDP2's DTensors where FSDP1 has ShardedTensors — both stored by DCP as the same chunks.
- ``fabric/``: ``lightning.fabric``'s ModelParallelStrategy save function (``_save_checkpoint``, what
  ``fabric.save`` calls) on the same module and optimizer, with two plain entries (meta.pt).
- ``truth.pt``: what the run held at that save, gathered in full (plain torch.save, for the test to compare).

A child process: Lightning's launcher starts the second rank by running this script again.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

EPOCHS = 3
ROOT = Path(__file__).resolve().parent.parent


def _train_module() -> Any:
    name = "ckptfix_fixtures_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "fixtures" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


train = _train_module()
sys.path.insert(0, str(ROOT))  # (run as a script) the repository root, for the tests package
from tests.lightning_run import lit_class  # noqa: E402 - after train.py is loaded, which it uses


class LitMLP(lit_class()):
    """tests/lightning_run.py's LitMLP (the MLP as ``self.model``, Adam + StepLR, hyper-parameters saved),
    sharded with FSDP2 only when Lightning gives it a device mesh."""

    def configure_model(self) -> None:
        if self._device_mesh is None:  # single process: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def loader() -> torch.utils.data.DataLoader:
    x, y = train._batches("mlp")[0]  # one full batch per epoch (split over the ranks by Lightning's sampler)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))


class AlsoSave(Callback):
    """At every save, the same state through FSDPStrategy's and Fabric's save code, and the full truth."""

    def __init__(self, out: Path):
        self.out = out

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        from lightning.fabric.strategies.model_parallel import _save_checkpoint
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        fsdp = FSDPStrategy(state_dict_type="sharded")
        fsdp.cluster_environment = trainer.strategy.cluster_environment  # its global_rank: meta.pt on rank 0 only
        fsdp.save_checkpoint(dict(checkpoint), self.out / "fsdp")  # it pops state_dict/optimizer_states: a copy
        optimizer = trainer.optimizers[0]
        _save_checkpoint(self.out / "fabric", {"model": pl_module, "optimizer": optimizer, "step": trainer.global_step,
                                               "hparams": dict(pl_module.hparams)},
                         full_state_dict=False, rank=trainer.global_rank)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        truth = {"state_dict": get_model_state_dict(pl_module, options=full),
                 "optimizer": get_optimizer_state_dict(pl_module, optimizer, options=full),
                 "keys": list(checkpoint),
                 **{k: checkpoint[k] for k in ("epoch", "global_step", "lr_schedulers", "hyper_parameters")}}
        if trainer.global_rank == 0:
            torch.save(truth, self.out / "truth.pt")


def main(out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(train.MODEL_SEED)
    module = LitMLP()
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints")
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        callbacks=[checkpoint, AlsoSave(out)], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    trainer.fit(module, loader())
    if trainer.global_rank == 0:
        print(checkpoint.best_model_path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
