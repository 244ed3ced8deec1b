"""load_into's plan: the model read once (ops/load_into/modelwalk) agrees with torch's own ``state_dict(keep_vars=True)``
on every kind of module; the loader never computes the checkpoint's stats; a failed materialisation of meta
tensors puts back what it allocated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import ckptfix
from ckptfix.errors import LoadError
from ckptfix.ops.load_into import modelwalk, shards


class Shared(nn.Module):
    """A submodule under two names, a tied parameter, a non-persistent buffer, a missing bias, BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4, bias=False)
        self.again = self.block  # the same module twice: its keys under both names
        self.head = nn.Linear(4, 4)
        self.head.weight = self.block.weight
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_parameter("unset", None)


class Extra(nn.Linear):
    """Extra state in its state dict: torch's own keys are asked for."""

    def get_extra_state(self) -> Any:
        return {"v": 1}

    def set_extra_state(self, state: Any) -> None:
        self.seen = state


def _hooked() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))

    def rename(module: Any, sd: Any, prefix: str, local_metadata: Any) -> None:
        sd[prefix + "renamed"] = sd.pop(prefix + "weight")

    model[1]._register_state_dict_hook(rename)
    return model


MODELS = {"shared": Shared, "extra": lambda: nn.Sequential(Extra(3, 2), nn.ReLU()), "hooked": _hooked,
          "sequential": lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))}


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_walk_has_torchs_keys_and_tensors(kind: str) -> None:
    model = MODELS[kind]()
    walk = modelwalk.walk(model)
    want = model.state_dict(keep_vars=True)
    assert list(walk.state_dict) == list(want)
    assert all(walk.state_dict[k] is v for k, v in want.items() if isinstance(v, torch.Tensor))
    assert walk.module_names == [n for n, _ in model.named_modules()]
    assert len(walk.modules) == len({id(m) for m in model.modules()})
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and key.rpartition(".")[2] != "renamed":
            module, name, is_param = walk.place(key)
            assert getattr(module, name) is value and is_param == isinstance(value, nn.Parameter)


def test_the_walk_finds_the_non_persistent_buffers_and_own_loaders() -> None:
    model = Shared()
    walk = modelwalk.walk(model)
    assert [k for k, _ in walk.non_persistent] == ["cache"]
    assert walk.own == {model.norm}  # BatchNorm's _load_from_state_dict (its version handling)


def test_a_hook_renaming_a_key_is_refused_by_name(tmp_path: Path) -> None:
    model = _hooked()
    save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    with pytest.raises(LoadError, match=r"model key '1.renamed' is not a parameter or buffer"):
        ckptfix.load_into(model, tmp_path / "m.safetensors")


def test_load_into_never_computes_the_checkpoints_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats (counts over every tensor) are computed when first read: inspect reads them, load_into doesn't."""
    from ckptfix.ops import reading

    model = nn.Linear(3, 2)
    save_file(dict(model.state_dict()), str(tmp_path / "m.safetensors"))
    calls: list[int] = []
    real = reading.tensor_stats
    monkeypatch.setattr(reading, "tensor_stats", lambda *a: calls.append(1) or real(*a))
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    ckptfix.load_into(meta, tmp_path / "m.safetensors", check_values=False)
    assert calls == []
    assert ckptfix.read(tmp_path / "m.safetensors").stats.num_tensors == 2 and calls == [1]


def test_a_failed_materialisation_puts_back_what_it_allocated() -> None:
    with torch.device("meta"):
        first, second = nn.Linear(3, 2), nn.Linear(3, 2)
    first.register_buffer("built", torch.ones(2))  # off meta already: never touched
    built = first.built
    with pytest.raises(RuntimeError):
        shards.materialise([(first, "cpu"), (second, "no-such-device")])
    assert all(t.is_meta for t in (*first.parameters(), *second.parameters()))
    assert first.built is built and torch.equal(built, torch.ones(2))
    assert first.weight.shape == (2, 3) and second.bias.shape == (2,)
    shards.materialise([(first, "cpu")])
    assert not any(t.is_meta for t in first.parameters()) and first.built is built
