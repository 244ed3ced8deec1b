"""The issue-26 cases the plain serving loader refuses while ckptfix's reader takes them, written with torch itself:
``_metadata`` holding objects the weights-only unpickler refuses, pickle protocols 4 and 5, an upper-case storage
location tag, a ``tie_weights()`` model's file holding only the overwritten side, and a ``save_pretrained`` GPT-2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

MODELS = '''
import torch
from torch import nn


class TiedLM(nn.Module):
    """An embedding and a head whose weight ``tie_weights()`` overwrites with the embedding's (no transformers)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.tie_weights()

    def tie_weights(self):
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def tied():
    return TiedLM()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))
'''


def models_file(tmp: Path) -> Path:
    """The cases' model specs' file (``PATH:tied``, ``PATH:gpt2``)."""
    path = tmp / "observe_models.py"
    path.write_text(MODELS)
    return path


def _mlp_sd() -> dict:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).state_dict()


def _with_metadata(value: object) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        sd = _mlp_sd()
        sd._metadata[""]["extra"] = value  # type: ignore[attr-defined]
        torch.save(sd, tmp / "meta.pth")
        return tmp / "meta.pth"
    return make


def _protocol(n: int) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        torch.save(_mlp_sd(), tmp / f"proto{n}.pth", pickle_protocol=n)
        return tmp / f"proto{n}.pth"
    return make


def _upper_case_tag(tmp: Path) -> Path:
    """Storages tagged ``CPU``: a tagger registered ahead of torch's own for the save, removed after."""
    registry = torch.serialization._package_registry
    before = list(registry)
    torch.serialization.register_package(-1, lambda s: "CPU" if s.device.type == "cpu" else None, lambda s, loc: None)
    try:
        torch.save(_mlp_sd(), tmp / "upper.pth")
    finally:
        registry[:] = before
    return tmp / "upper.pth"


def _tied_overwritten_side(tmp: Path) -> Path:
    """The ``tied`` model's file holding only ``head.weight``, the side ``tie_weights()`` overwrites."""
    torch.save({"head.weight": torch.randn(10, 4)}, tmp / "tied_head.pth")
    return tmp / "tied_head.pth"


def _gpt2_save_pretrained(tmp: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("observe_models", models_file(tmp))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.gpt2().save_pretrained(tmp / "gpt2")
    return tmp / "gpt2" / "model.safetensors"


#: name → (maker, model spec name in :data:`MODELS` or None for the MLP fixture's, what ``--exact`` must say)
CASES: dict[str, tuple[Callable[[Path], Path], str | None, str]] = {
    "metadata-namespace": (_with_metadata(argparse.Namespace(lr=0.1)), None, "Namespace"),
    "metadata-numpy-scalar": (_with_metadata(np.float64(1.5)), None, "numpy"),
    "pickle-protocol-4": (_protocol(4), None, "Unsupported operand"),
    "pickle-protocol-5": (_protocol(5), None, "Unsupported operand"),
    "storage-tag-CPU": (_upper_case_tag, None, "CPU"),
    "tie-weights-overwritten-side": (_tied_overwritten_side, "tied", "emb.weight"),
    "save-pretrained-gpt2": (_gpt2_save_pretrained, "gpt2", "--serving-loader transformers"),
}
