"""Model specs: torchvision:NAME, package.module:callable, file.py:callable, --arg parsing, input shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptfix.errors import CkptfixError, ModelSpecError
from ckptfix.model.spec import build_model, infer_input_shape, parse_model_args, parse_shape, split_spec

ROOT = Path(__file__).resolve().parents[2]


def test_parse_model_args_literals_else_strings() -> None:
    assert parse_model_args(["num_classes=10", "pretrained=False", "dims=[64,128]", "model_name=resnet18",
                             "scale=0.5", "name='x=y'", "empty="]) == {
        "num_classes": 10, "pretrained": False, "dims": [64, 128], "model_name": "resnet18",
        "scale": 0.5, "name": "x=y", "empty": "",
    }


@pytest.mark.parametrize("bad", ["num_classes", "=3", "not valid=1"])
def test_parse_model_args_rejects_malformed(bad: str) -> None:
    with pytest.raises(ModelSpecError, match="expected NAME=VALUE"):
        parse_model_args([bad])


def test_split_spec_uses_the_last_colon() -> None:
    assert split_spec(r"C:\models\net.py:build") == (r"C:\models\net.py", "build")
    with pytest.raises(ModelSpecError, match="expected torchvision:NAME"):
        split_spec("resnet18")


def test_torchvision_builds_without_weights_and_with_args() -> None:
    model = build_model("torchvision:resnet18", {"num_classes": 10})
    assert model.fc.out_features == 10
    fresh = build_model("torchvision:resnet18", {"num_classes": 10})
    assert not torch.equal(model.conv1.weight, fresh.conv1.weight)  # random init, no pretrained weights


def test_torchvision_detector_does_not_fetch_a_backbone() -> None:
    # The default weights_backbone would download ImageNet weights; built offline it must be None.
    model = build_model("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", {"num_classes": 3})
    assert model.roi_heads.box_predictor.cls_score.out_features == 3


@pytest.mark.parametrize("spec, args, message", [
    ("torchvision:resnet19", {}, "torchvision has no model 'resnet19'; similar: resnet"),
    ("torchvision:resnet18", {"pretrained": True}, "without pretrained weights"),
    ("torchvision:resnet18", {"num_layers": 3}, "unexpected keyword argument 'num_layers'"),
    ("no_such_pkg.models:build", {}, "can't import 'no_such_pkg.models'"),
    ("torch.nn:NoSuchLayer", {}, "'torch.nn' has no attribute 'NoSuchLayer'"),
    ("math:pi", {}, "'pi' is a float, not a callable"),
    ("builtins:dict", {"a": 1}, "returned a dict, not a torch.nn.Module"),
    ("missing/dir/net.py:build", {}, "no such file 'missing/dir/net.py'"),
])
def test_spec_errors_say_why(spec: str, args: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelSpecError, match="^model spec .*" + _escape(message)):
        build_model(spec, args)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_package_module_callable() -> None:
    model = build_model("torch.nn:Linear", {"in_features": 3, "out_features": 2})
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


def test_file_callable_and_its_errors(tmp_path: Path) -> None:
    net = build_model(f"{ROOT / 'fixtures' / 'train.py'}:mlp")
    assert [tuple(p.shape) for p in net.parameters()][0] == (16, 13)
    (tmp_path / "broken.py").write_text("raise ImportError('needs mypkg')\n")
    with pytest.raises(ModelSpecError, match="running .*broken.py' failed: ImportError: needs mypkg"):
        build_model(f"{tmp_path / 'broken.py'}:build")
    (tmp_path / "raises.py").write_text("def build(width=4):\n    raise ValueError(f'bad width {width}')\n")
    with pytest.raises(ModelSpecError, match=r"building it with \{'width': 7\} failed: ValueError: bad width 7"):
        build_model(f"{tmp_path / 'raises.py'}:build", {"width": 7})


def test_infer_input_shape() -> None:
    assert infer_input_shape(build_model("torchvision:resnet18")) == (1, 3, 224, 224)
    assert infer_input_shape(nn.DataParallel(build_model("torchvision:mobilenet_v3_small"))) == (1, 3, 224, 224)
    mlp = build_model(f"{ROOT / 'fixtures' / 'train.py'}:mlp")
    assert infer_input_shape(mlp) == (1, 13)
    assert infer_input_shape(torch.compile(mlp, backend="eager")) == (1, 13)
    assert infer_input_shape(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 1))) is None
    assert infer_input_shape(build_model("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn")) is None


def test_parse_shape() -> None:
    assert parse_shape("1,3,224,224") == parse_shape("1x3x224x224") == (1, 3, 224, 224)
    for bad in ("", "1,a", "0,3"):
        with pytest.raises(CkptfixError, match="expected positive sizes"):
            parse_shape(bad)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30522, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any = None) -> torch.Tensor:
        return self.embed(input_ids) * attention_mask.unsqueeze(-1)


@pytest.mark.parametrize("make, first, vocab, needs", [
    (lambda: nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 3)), nn.Embedding, 50, ["input"]),
    (lambda: nn.DataParallel(nn.Sequential(nn.ReLU(), nn.EmbeddingBag(7, 2))), nn.EmbeddingBag, 7, ["input"]),
    (lambda: torch.compile(_Pair(), backend="eager"), nn.Embedding, 30522, ["input_ids", "attention_mask"]),
    (lambda: nn.Sequential(nn.Linear(13, 2)), nn.Linear, None, ["input"]),
    (lambda: nn.Sequential(nn.ReLU()), type(None), None, ["input"]),
])
def test_what_a_model_takes(make: Any, first: type, vocab: int | None, needs: list[str]) -> None:
    from ckptfix.model.spec import embedding_size, first_layer, forward_arguments

    model = make()
    assert isinstance(first_layer(model), first)
    assert embedding_size(model) == vocab and forward_arguments(model) == needs


@pytest.mark.parametrize("dtype, want", [(None, torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
                                         (torch.float16, torch.float16)])
def test_model_source_builds_in_the_serving_dtype(dtype: Any, want: torch.dtype) -> None:
    from ckptfix.model.spec import ModelSource, float_dtype

    given = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    for model in ("torch.nn:Linear", given):
        source = ModelSource(model, {"in_features": 3, "out_features": 2} if isinstance(model, str) else None, dtype)
        net = source.fresh()
        assert float_dtype(net) == str(want).removeprefix("torch.") and net is not given
        assert all(t.dtype == want for t in net.state_dict().values() if t.is_floating_point())
    assert given[1].num_batches_tracked.dtype == torch.int64 and given[0].weight.dtype == torch.float32  # untouched
    assert source.fresh()[1].num_batches_tracked.dtype == torch.int64  # integer buffers keep theirs
