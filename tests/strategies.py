"""Hypothesis strategies the tests share: tensors of arbitrary bit patterns, state dicts with views and ties,
whole checkpoints around them (training extras, every dtype)."""

from __future__ import annotations

import string
from collections import OrderedDict
from typing import Any

import torch
from hypothesis import strategies as st

from ckptfix.statedict.wrappers import WRAPPER_SEGMENTS

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.bool]
_RESERVED = set(WRAPPER_SEGMENTS) | {"flat_param", "_flat_param"}
segment = st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=6).filter(
    lambda s: s not in _RESERVED)


@st.composite
def tensors(draw: Any, dtype: torch.dtype, min_dims: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, -0.0, subnormals included); bools are 0/1."""
    shape = draw(st.lists(st.integers(0 if min_dims == 0 else 2, 4), min_size=min_dims, max_size=3))
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


@st.composite
def state_dicts(draw: Any) -> OrderedDict:
    """Keys of wrapper-free segments; plain tensors, non-contiguous views, tied weights and other views of one storage."""
    keys = draw(st.lists(st.lists(segment, min_size=1, max_size=3).map(".".join), min_size=1, max_size=6,
                         unique=True))
    sd: OrderedDict = OrderedDict()
    for key in keys:
        kind = draw(st.sampled_from(["plain", "non-contiguous", "tied", "other-view"] if sd else ["plain",
                                                                                                 "non-contiguous"]))
        if kind == "plain":
            sd[key] = draw(tensors(draw(st.sampled_from(DTYPES))))
        elif kind == "non-contiguous":
            base = draw(tensors(draw(st.sampled_from(DTYPES)), min_dims=2))
            sd[key] = base.transpose(0, 1) if draw(st.booleans()) else base[:, ::2]
        else:
            other = sd[draw(st.sampled_from(list(sd)))]
            if kind == "tied" or other.numel() == 0:
                sd[key] = other  # the same tensor twice: tied weights
            else:
                sd[key] = other.reshape(-1)[draw(st.integers(0, other.numel() - 1)):] if other.is_contiguous() \
                    else other[0]  # another view of the same storage
    return sd
#: every dtype torch.save writes (``checkpoints`` adds tensors of each)
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
              torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


@st.composite
def checkpoints(draw: Any) -> Any:
    """A whole checkpoint: a state dict plus tensors of every dtype, bare, nested or among training extras."""
    sd = draw(state_dicts())
    for key in draw(st.lists(st.text("abcdefgh", min_size=1, max_size=4), max_size=4, unique=True)):
        t = draw(tensors(draw(st.sampled_from(ALL_DTYPES))))
        sd[f"extra.{key}"] = torch.nn.Parameter(t, requires_grad=False) if draw(st.booleans()) else t
    if draw(st.booleans()):
        sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    layout = draw(st.sampled_from(["bare", "nested", "training"]))
    if layout == "bare":
        return sd
    if layout == "nested":
        return {"state_dict": sd, "epoch": draw(st.integers(0, 10**6)), "note": draw(st.text(max_size=6))}
    return {"model": sd, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "scores": [draw(st.floats(allow_nan=False)), None, True], "ids": {1, 2}, "c": complex(1, 2),
            "dtype": torch.float16}
