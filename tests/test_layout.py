"""Where the state dict sits: bare, training checkpoints, EMA, explicit and ambiguous selection."""

from __future__ import annotations

import pytest
import torch

from ckptfix.errors import SelectError
from ckptfix.layout import find_state_dict, put_back

SD = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}


@pytest.mark.parametrize("key", ["state_dict", "model_state_dict", "model", "net", "network", "module"])
def test_known_keys(key: str) -> None:
    sel = find_state_dict({key: SD, "epoch": 3, "optimizer": {"state": {}, "param_groups": []}})
    assert sel.key == key and sel.state_dict is SD
    assert set(sel.extra) == {"epoch", "optimizer"}


def test_bare_state_dict() -> None:
    sel = find_state_dict(SD)
    assert sel.key is None and sel.extra == {}
    with pytest.raises(SelectError, match="bare state dict"):
        find_state_dict(SD, select="state_dict")


def test_auto_never_takes_ema_but_reports_it() -> None:
    ema = {k: v * 2 for k, v in SD.items()}
    sel = find_state_dict({"state_dict": SD, "state_dict_ema": ema, "epoch": 1})
    assert sel.key == "state_dict" and sel.ema_keys == ["state_dict_ema"]
    assert find_state_dict({"state_dict": SD, "state_dict_ema": ema}, select="state_dict_ema").state_dict is ema
    with pytest.raises(SelectError, match="only EMA weights .*--select model_ema"):
        find_state_dict({"model_ema": ema, "epoch": 1})


def test_ambiguous_and_missing() -> None:
    with pytest.raises(SelectError, match="several state dicts \\(generator, discriminator\\)"):
        find_state_dict({"generator": SD, "discriminator": SD})
    with pytest.raises(SelectError, match="no state dict found"):
        find_state_dict({"epoch": 1, "loss": 0.5})
    with pytest.raises(SelectError, match="no entry 'nope'; state dicts found: model"):
        find_state_dict({"model": SD}, select="nope")


def test_put_back_keeps_layout_and_order() -> None:
    ckpt = {"epoch": 1, "model_state_dict": SD, "loss": 0.1}
    new = {"x": torch.ones(1)}
    out = put_back(ckpt, "model_state_dict", new)
    assert list(out) == ["epoch", "model_state_dict", "loss"] and out["model_state_dict"] is new
    assert put_back(SD, None, new) is new
