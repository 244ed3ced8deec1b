"""mmengine's own Runner, run in a child process for tests/test_real_libraries.py.

    python tests/real_mmengine.py train OUT.pt WORK_DIR
    python tests/real_mmengine.py resume OUT.pt WORK_DIR CKPT [CKPT ...]

``train`` fits the MLP (as ``backbone`` of an mmengine ``BaseModel``, Adam, a ``MultiStepLR`` scheduler)
for ``EPOCHS`` one-batch epochs on train.py's data, with mmengine's ``CheckpointHook`` saving every epoch
into WORK_DIR, the same seeded steps as train.py's ``_train``. ``resume`` resumes each CKPT with
``Runner(load_from=CKPT, resume=True)`` for one more epoch, each in its own work directory under WORK_DIR.
Both write OUT.pt (plain tensors, lists and strings, torch.save) with what the Runner's model and
message hub hold, for the parent to compare with ckptfix's reading of the files.

A child process, because the Runner changes its process for good: it seeds the global RNGs, sets the
multiprocessing start method and OpenCV's threads, registers global instances, and leaves ``mmengine``
in ``sys.modules``, where fixtures/layouts.py refuses to fake mmengine's module for its own fixtures.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

# mmengine 0.10.7 resumes with a bare torch.load(path), which torch >= 2.6 runs as weights_only=True;
# that refuses mmengine's own HistoryBuffer (and getattr) in every file the Runner writes. torch's
# documented switch back to full unpickling, for the files this test writes itself.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

import torch  # noqa: E402

SKIP_RC = 77  # test_real_libraries.py skips on this exit status, with the last line of stderr as reason
try:
    from mmengine.model import BaseModel
    from mmengine.runner import Runner
except ImportError as e:  # mmengine not installed, or OpenCV (mmengine's hooks import cv2) without libGL
    print(f"mmengine's Runner can't be imported here: {e}", file=sys.stderr)
    raise SystemExit(SKIP_RC) from None

EPOCHS = 5
ROOT = Path(__file__).resolve().parent.parent


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location("ckptfix_fixtures_train", ROOT / "fixtures" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


train = _train_module()


class MLPModel(BaseModel):
    """train.py's MLP as an mmengine model: ``forward(inputs, labels, mode)``, loss dict in mode 'loss'."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = train.mlp()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, mode: str = "tensor") -> Any:
        out = self.backbone(inputs)
        if mode == "loss":
            return {"loss": torch.nn.functional.mse_loss(out, labels)}
        return out


def _runner(work_dir: Path, name: str, max_epochs: int, **kw: Any) -> Runner:
    x, y = train._batches("mlp")[0]  # one full batch per epoch, as train.py's steps
    return Runner(
        model=MLPModel(), work_dir=str(work_dir), experiment_name=name,
        train_dataloader=dict(dataset=[dict(inputs=a, labels=b) for a, b in zip(x, y)], batch_size=len(x),
                              sampler=dict(type="DefaultSampler", shuffle=False),
                              collate_fn=dict(type="default_collate"), num_workers=0),
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs),
        optim_wrapper=dict(optimizer=dict(type="Adam", lr=1e-2)),
        param_scheduler=dict(type="MultiStepLR", milestones=[8, 11], by_epoch=True),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
        randomness=dict(seed=train.DATA_SEED), visualizer=dict(type="Visualizer", vis_backends=[]),
        default_scope="mmengine", log_level="WARNING", **kw)


def _state(runner: Runner) -> dict[str, Any]:
    hub = runner.message_hub
    model = runner.model
    model.eval()
    with torch.no_grad():
        output = model.backbone(train.fixed_input("mlp")).tolist()
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "output": output,
        "epoch": runner.epoch, "iter": runner.iter,
        "train/loss": hub.get_scalar("train/loss").data[0].tolist(),
        "train/lr": hub.get_scalar("train/lr").data[0].tolist(),
        "optimizer": runner.optim_wrapper.state_dict(),
        "last_checkpoint": (Path(runner.work_dir) / "last_checkpoint").read_text().strip(),
    }


def main(argv: list[str]) -> None:
    verb, out, work = argv[0], Path(argv[1]), Path(argv[2])
    if verb == "train":
        torch.manual_seed(train.MODEL_SEED)  # as train.py's _train, before the model is built
        runner = _runner(work, "train", EPOCHS)
        runner.train()
        torch.save(_state(runner), out)
    elif verb == "resume":
        states = []
        for i, ckpt in enumerate(argv[3:]):
            runner = _runner(work / f"resume{i}", f"resume{i}", EPOCHS + 1, load_from=ckpt, resume=True)
            runner.train()
            states.append(_state(runner))
        torch.save(states, out)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
