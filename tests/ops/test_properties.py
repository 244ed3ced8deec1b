"""Property tests: random state dicts survive every format round trip bit-exactly; random wrapper
stacks normalise to the single form; the static walker agrees with pickle on plain data."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.parse import pickle_walk
from ckptfix.statedict.wrappers import WRAPPER_SEGMENTS
from tests.compare import raw_bytes
from tests.strategies import segment, state_dicts

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])


def assert_bit_exact(got: Any, expected: OrderedDict) -> None:
    assert list(got) == list(expected)
    for key, t in expected.items():
        g = got[key]
        assert g.dtype == t.dtype and g.shape == t.shape, key
        assert torch.equal(raw_bytes(g), raw_bytes(t)), key


@SETTINGS
@given(sd=state_dicts())
def test_every_format_round_trip_is_bit_exact(sd: OrderedDict, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("rt")
    torch.save(sd, d / "zip.pth")
    torch.save(sd, d / "legacy.pth", _use_new_zipfile_serialization=False)
    for src in ("zip.pth", "legacy.pth"):
        for dst in ("out.pth", "out.safetensors"):
            out = d / f"{src}.{dst}"
            ckptfix.convert(d / src, out)
            assert_bit_exact(ckptfix.load(out), sd)
    # and back out of safetensors, through both writers again
    ckptfix.convert(d / "zip.pth.out.safetensors", d / "again.pth")
    ckptfix.convert(d / "again.pth", d / "again.safetensors")
    for path in (d / "again.pth", d / "again.safetensors"):
        assert_bit_exact(ckptfix.load(path), sd)


def test_one_element_view_with_stride_2(tmp_path: Path) -> None:
    """Found by the property above: ``contiguous()`` is a no-op on a 1-element view whose stride is
    2, and the safetensors writer's byte view then failed."""
    base = torch.arange(6.0).reshape(2, 3)[:, ::2]
    sd = OrderedDict(base=base, one=base[0, 1:])  # shape [1], stride (2,)
    torch.save(sd, tmp_path / "src.pth", _use_new_zipfile_serialization=False)
    ckptfix.convert(tmp_path / "src.pth", tmp_path / "out.safetensors")
    assert_bit_exact(ckptfix.load(tmp_path / "out.safetensors"), sd)


@SETTINGS
@given(base=st.lists(st.lists(segment, min_size=1, max_size=4).map(".".join), min_size=1, max_size=8, unique=True),
       stack=st.lists(st.sampled_from(WRAPPER_SEGMENTS), max_size=4),
       inner=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 3), st.sampled_from(WRAPPER_SEGMENTS)), max_size=4))
def test_wrapper_stacks_normalise_to_single(base: list[str], stack: list[str], inner: list[tuple[int, int, str]],
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    keys = []
    for i, key in enumerate(base):
        segs = key.split(".")
        for which, at, wrapper in inner:  # a wrapped submodule: a segment mid-key
            if which == i and at < len(segs) - 1:
                segs.insert(at + 1, wrapper)
        keys.append(".".join([*stack, *segs]))
    path = tmp_path_factory.mktemp("wrap") / "ckpt.pth"
    torch.save(OrderedDict((k, torch.full((1,), float(i))) for i, k in enumerate(keys)), path)
    single = ckptfix.load(path)
    assert list(single) == base
    assert [float(v) for v in single.values()] == [float(i) for i in range(len(base))]
    assert list(ckptfix.load(path, to="ddp")) == [f"module.{k}" for k in base]
    assert list(ckptfix.load(path, to="compile")) == [f"_orig_mod.{k}" for k in base]


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=4), inner,
                                                                                            max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(value=plain, protocol=st.integers(3, 5))
def test_walker_value_matches_pickle(value: Any, protocol: int) -> None:
    """On plain data the simulated stack machine builds exactly what pickle.loads does (memo included)."""
    data = pickle.dumps(value, protocol=protocol)
    walk = pickle_walk.walk(data)
    assert walk.error is None and walk.end == len(data) and walk.uses == []
    assert walk.value == pickle.loads(data)
