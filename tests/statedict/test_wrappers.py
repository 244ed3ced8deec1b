"""Wrapper segments: whole-segment stripping, stacks in any order, targets, collisions, _metadata."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from ckptfix.errors import KeyCollisionError, WrapperError
from ckptfix.statedict.wrappers import (check_no_flat_params, detect_wrappers, inner_wrappers, key_transform,
                                        match_to_target, rename_state_dict, strip_wrappers)


@pytest.mark.parametrize(
    "key, single",
    [
        ("module.submodule.weight", "submodule.weight"),  # replace('module.', '') gives 'subweight'
        ("module_list.0.weight", "module_list.0.weight"),
        ("submodule.weight", "submodule.weight"),
        ("module._orig_mod.conv1.weight", "conv1.weight"),
        ("_orig_mod.module.conv1.weight", "conv1.weight"),
        ("module.module.fc.bias", "fc.bias"),
        ("encoder._orig_mod.0.weight", "encoder.0.weight"),
        ("_forward_module.model._fsdp_wrapped_module.w", "model.w"),
        ("layer._checkpoint_wrapped_module.lin.weight", "layer.lin.weight"),
        ("mymodule.weight", "mymodule.weight"),
        ("module", ""),
    ],
)
def test_strip_wrappers_removes_whole_segments_only(key: str, single: str) -> None:
    assert strip_wrappers(key) == single


@pytest.mark.parametrize(
    "to, key, expected",
    [
        ("single", "module._orig_mod.fc.weight", "fc.weight"),
        ("ddp", "_orig_mod.fc.weight", "module.fc.weight"),
        ("dp", "fc.weight", "module.fc.weight"),
        ("ddp", "module.module.fc.weight", "module.fc.weight"),
        ("compile", "module.fc.weight", "_orig_mod.fc.weight"),
        ("keep", "module._orig_mod.fc.weight", "module._orig_mod.fc.weight"),
    ],
)
def test_targets(to: str, key: str, expected: str) -> None:
    assert key_transform(to)(key) == expected


def test_prefixes_by_whole_segments() -> None:
    fn = key_transform("single", strip_prefix="model.", add_prefix="backbone")
    assert fn("model.module.conv.weight") == "backbone.conv.weight"
    assert fn("modelx.conv.weight") == "backbone.modelx.conv.weight"  # not a substring match
    assert key_transform("ddp", add_prefix="backbone.")("fc.w") == "module.backbone.fc.w"
    # a framework prefix under a wrapper (Lightning + DDP: module.model.…) is found too
    assert key_transform("single", strip_prefix="model")("module.model.fc.w") == "fc.w"
    assert key_transform("keep", strip_prefix="model")("module.model.fc.w") == "module.fc.w"
    with pytest.raises(WrapperError):
        key_transform("single", strip_prefix="a..b")
    with pytest.raises(WrapperError):
        key_transform("sideways")


def test_detect_stack_and_inner_wrappers() -> None:
    keys = ["module._orig_mod.a.weight", "module._orig_mod.b.weight"]
    assert detect_wrappers(keys) == ["module", "_orig_mod"]
    assert detect_wrappers(["module.a", "b"]) == []
    assert inner_wrappers(["enc._orig_mod.0.weight", "dec.1.weight"]) == ["enc._orig_mod"]


def test_collision_is_refused_naming_both_keys() -> None:
    sd = OrderedDict([("module.fc.weight", 1), ("fc.weight", 2)])
    with pytest.raises(KeyCollisionError, match="'module.fc.weight' and 'fc.weight'"):
        rename_state_dict(sd, key_transform("single"), source="x.pth")


def test_fsdp1_flat_params_refused() -> None:
    with pytest.raises(WrapperError, match="FULL_STATE_DICT"):
        check_no_flat_params(["_fsdp_wrapped_module._flat_param"])
    check_no_flat_params(["flat.weight"])


def test_metadata_follows_keys_and_inner_module_wins() -> None:
    sd = OrderedDict([("module.bn.weight", 1)])
    sd._metadata = OrderedDict([("", {"version": 1}), ("module", {"version": 1}), ("module.bn", {"version": 2})])
    out = rename_state_dict(sd, key_transform("single"))
    assert out._metadata == OrderedDict([("", {"version": 1}), ("bn", {"version": 2})])
    back = rename_state_dict(out, key_transform("ddp"))
    assert list(back) == ["module.bn.weight"]
    assert back._metadata == OrderedDict([("", {"version": 1}), ("module", {"version": 1}), ("module.bn", {"version": 2})])


def test_match_to_target_adapts_any_wrapping() -> None:
    target = ["_orig_mod.module.fc.weight", "_orig_mod.module.enc._orig_mod.0.weight"]
    fn = match_to_target([], target)
    assert fn("module.fc.weight") == target[0]
    assert fn("enc.0.weight") == target[1]
    assert fn("extra.weight") == "_orig_mod.module.extra.weight"
