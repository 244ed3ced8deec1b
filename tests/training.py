"""A few seeded training steps, the losses of which show that a resumed (converted) checkpoint trains on exactly as
the original would (tests/statedict/test_transforms.py, tests/statedict/test_layouts.py)."""

from __future__ import annotations

import torch
from torch import nn


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` steps of MSE training on one seeded batch: the losses, which a resumed run must reproduce."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(32, 13, generator=g), torch.randn(32, 1, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


#: what each framework's checkpoint holds beside its weights that plain ``torch.load(weights_only=True)`` refuses:
#: ``convert --keep-extra`` writes them only when ``--allow`` names them (the framework resumes with its own loader)
RESUMES_WITH = {"timm": ("argparse.Namespace",),
                "mmengine": ("mmengine.logging.history_buffer.HistoryBuffer", "numpy.ndarray", "builtins.getattr",
                             "numpy.float64")}


def allow_flags(framework: str) -> tuple[str, ...]:
    """``--allow NAME`` for each of :data:`RESUMES_WITH`'s names of ``framework``."""
    return tuple(x for name in RESUMES_WITH[framework] for x in ("--allow", name))
