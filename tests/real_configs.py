"""Checkpoints with objects beside the weights, written in a child process for tests/safety/test_configs.py
and tests/statedict/test_placeholders.py, so the reading process never imports what wrote them.

    python tests/real_configs.py omegaconf OUT_DIR
    python tests/real_configs.py custom OUT_DIR

``omegaconf`` writes ``dictconfig.pt`` (torch.save of a dict holding an OmegaConf DictConfig: nested dicts,
lists, None, '???', an interpolation, typed nodes) and ``lightning.ckpt`` (a real Lightning ``Trainer.fit``
of one step on the CPU, whose module called ``save_hyperparameters(cfg)`` with a DictConfig (less '???',
which Lightning reads), as every
Hydra project does), and ``expected.json``: each config as ``OmegaConf.to_container(resolve=False)`` gives it.
``custom`` writes ``myproj/config.py`` (a dataclass ``RunConfig`` and an enum ``Mode``) under OUT_DIR/src,
imports it from there only here, and saves ``custom.pt`` ({'state_dict', 'config', 'epoch'}) and
``custom_in_sd.pt`` (a RunConfig inside the state dict). Both write ``weights.pt``: the state dicts as
plain tensors, for the parent to compare with ckptfix's reading bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

CONFIG_PY = '''\
import dataclasses
import enum


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass
class RunConfig:
    lr: float = 1e-3
    layers: int = 4
    name: str = "run"
    mode: Mode = Mode.TRAIN
    widths: list = dataclasses.field(default_factory=lambda: [8, 16])
'''


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4), "steps": torch.tensor([7], dtype=torch.int64)}


def omegaconf_files(out: Path) -> None:
    import lightning as L
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "model": {"hidden": 32, "layers": [1, 2, {"k": 3}], "act": "relu", "drop": 0.1, "name": None},
        "optim": {"lr": 1e-3, "betas": [0.9, 0.999], "decay": "${optim.lr}"},
        "data": "???", "flag": True, "seed": 7, "empty": {}, "nothing": [],
    })
    typed = OmegaConf.structured({"x": 1})  # a second config beside the first, under another key
    weights = _weights()
    torch.save({"state_dict": weights, "cfg": cfg, "more": [typed, {"plain": 1}]}, out / "dictconfig.pt")

    class Module(L.LightningModule):
        def __init__(self, cfg: Any):
            super().__init__()
            self.save_hyperparameters(cfg)
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "data"])  # Lightning reads every value: no '???'
    torch.manual_seed(0)
    module = Module(lit_cfg)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out))
    trainer.fit(module, data)
    trainer.save_checkpoint(out / "lightning.ckpt")
    torch.save({"dictconfig": weights, "lightning": {k: v.detach().clone() for k, v in module.state_dict().items()}},
               out / "weights.pt")
    expected = {"cfg": OmegaConf.to_container(cfg, resolve=False), "typed": OmegaConf.to_container(typed),
                "lightning": OmegaConf.to_container(lit_cfg, resolve=False)}
    (out / "expected.json").write_text(json.dumps(expected))


def custom_files(out: Path) -> None:
    src = out / "src" / "myproj"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "config.py").write_text(CONFIG_PY)
    sys.path.insert(0, str(out / "src"))
    from myproj.config import Mode, RunConfig  # only this process can import it

    weights = _weights()
    torch.save({"state_dict": weights, "config": RunConfig(lr=0.5, mode=Mode.EVAL), "epoch": 3}, out / "custom.pt")
    torch.save({"state_dict": {**weights, "extra": RunConfig()}, "epoch": 3}, out / "custom_in_sd.pt")
    torch.save({"custom": weights}, out / "weights.pt")


if __name__ == "__main__":
    {"omegaconf": omegaconf_files, "custom": custom_files}[sys.argv[1]](Path(sys.argv[2]))
