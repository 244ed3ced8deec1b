"""The rename a verify suggests (statedict/repair.suggest_renames finds it) is spelt as convert's ``--rename`` by
ConvertOptions' table, through model/fixes, never by the statedict layer itself (that it applies as suggested:
tests/model/test_verify.py's renamed ResNet layer)."""

from __future__ import annotations

import ast
import inspect
from collections import OrderedDict
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.model import fixes
from ckptfix.ops.convert_options import ConvertOptions, flag_of
from ckptfix.statedict import repair

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"


@pytest.fixture(scope="module")
def renamed(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MLP's state dict with ``0.`` (its first Linear) saved as ``first.``."""
    sd = torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)
    out = tmp_path_factory.mktemp("renamed") / "renamed.pth"
    torch.save(OrderedDict((("first." + k[2:]) if k.startswith("0.") else k, v) for k, v in sd.items()), out)
    return out


def _rename(path: Path) -> dict[str, Any]:
    report = ckptfix.verify(path, MLP_SPEC, forward=False)
    (rule,) = [s for s in report.suggestions if "rename" in s]
    return rule


def test_the_suggested_rename_is_spelt_by_convert_s_table(renamed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rule = _rename(renamed)
    assert rule["rename"] == {"from": "first.", "to": "0."} and rule["keys"] == 2
    assert f" OUT {flag_of(next(f for f in fields(ConvertOptions) if f.name == 'rename')).decls[0]} " in rule["text"]
    monkeypatch.setattr(fixes, "convert_flag", lambda name: f"--spelt-{name.replace('_', '-')}")
    assert " OUT --spelt-rename " in _rename(renamed)["text"]
    source = ast.parse(inspect.getsource(repair))
    assert not [n.value for n in ast.walk(source) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and "--rename" in n.value]

