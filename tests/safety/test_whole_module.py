"""A whole pickled model (``torch.save(model)``) is refused in a short line that names its class and the fix,
not a list of every layer class; anything else unsafe in the same file is still named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

from ckptfix.cli import cli
from tests import adversarial


ROOT_CLASSES = {"tiny": f"{adversarial.TinyNet.__module__}.TinyNet", "resnet18": "torchvision.models.resnet.ResNet"}


def _model(name: str) -> torch.nn.Module:
    return adversarial.TinyNet() if name == "tiny" else torchvision.models.resnet18()


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("name", ["tiny", "resnet18"])
def test_whole_module_refused_in_a_short_line(name: str, legacy: bool, command: str, tmp_path: Path,
                                              cli_runner: Any) -> None:
    torch.save(_model(name), tmp_path / "whole.pth", _use_new_zipfile_serialization=not legacy)
    args = [command, str(tmp_path / "whole.pth")] + ([str(tmp_path / "out.pth")] if command == "convert" else [])
    res = cli_runner.invoke(cli, args)
    assert res.exit_code == 1, res.output
    err = res.stderr
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert len(err) - 2 * len(str(tmp_path / "whole.pth")) < 480, (len(err), err)  # the path twice, and under 480
    assert ROOT_CLASSES[name] in err and "torch.save(model)" in err and "state_dict()" in err and "--trust" in err
    assert "torch.nn.modules.conv.Conv2d" not in err  # the layer classes are scan's to list
    assert not (tmp_path / "out.pth").exists()


def test_whole_module_with_a_call_still_names_the_call(tmp_path: Path, cli_runner: Any) -> None:
    """A model pickled beside a call of os.system: the short form still names the call."""
    torch.save({"model": adversarial.TinyNet(), "x": adversarial.Reduce(os.system, "true")}, tmp_path / "both.pth")
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "both.pth")])
    assert res.exit_code == 1, res.output
    assert res.stderr.count("\n") == 1 and ROOT_CLASSES["tiny"] in res.stderr, res.stderr
    assert f"{os.system.__module__}.system" in res.stderr, res.stderr
