"""``load_into`` and a ``torch.ao.quantization.quantize_dynamic`` model: its Linear layers keep their weights packed
(``scale``, ``zero_point`` and ``_packed_params`` in the state dict, no parameter or buffer), which torch's own
``load_state_dict`` unpacks; ckptfix refuses in one line naming the module and why, before touching the model, and
the load it names instead takes the file bit-exact and strict."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix import errors


def _quantized() -> Any:
    """A small MLP, its Linear layers dynamically quantized to qint8 (on whichever engine this torch has)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao.quantization's deprecation notice)
        net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        return torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)


def _packed(model: Any) -> list[torch.Tensor]:
    """Each quantized Linear's weight (its integers and its scale) and bias, unpacked."""
    out = []
    for layer in (model[0], model[2]):
        weight, bias = layer._weight_bias()
        out += [weight.int_repr(), torch.tensor(weight.q_scale()), bias]
    return out


def test_a_dynamically_quantized_model_is_refused_in_one_line(tmp_path: Path) -> None:
    if not set(torch.backends.quantized.supported_engines) - {"none"}:
        pytest.skip("this torch has no quantized engine")
    torch.manual_seed(0)
    saved = _quantized()
    torch.save(saved.state_dict(), tmp_path / "q.pth")
    torch.manual_seed(1)
    model = _quantized()
    before = _packed(model)
    with pytest.raises(errors.LoadError) as caught:
        ckptfix.load_into(model, tmp_path / "q.pth")
    message = str(caught.value)
    assert message.startswith("model module '0' is a quantized torch.ao.nn.quantized.dynamic.Linear: its weights are "
                              "packed ('0.scale' is no parameter or buffer"), message
    assert "model.load_state_dict(ckptfix.load(path))" in message and "\n" not in message
    assert all(torch.equal(a, b) for a, b in zip(_packed(model), before))  # (untouched)
    assert str(model.load_state_dict(ckptfix.load(tmp_path / "q.pth"), strict=True)) == "<All keys matched successfully>"
    assert all(torch.equal(a, b) for a, b in zip(_packed(model), _packed(saved)))  # (what it names loads bit-exact)
