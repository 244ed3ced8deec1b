"""The DeepSpeed classes a ZeRO ``*_optim_states.pt`` pickles, loaded as inert stand-ins.

DeepSpeed's ZeRO optimizers put three of their own objects into ``optimizer_state_dict``
(deepspeed 0.19.8: ``DeepSpeedZeroOptimizer.state_dict`` for stages 1–2, ``DeepSpeedZeroOptimizer_Stage3``
for stage 3):

- ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (fp32/bf16) or ``DynamicLossScaler`` (fp16):
  NEWOBJ then BUILD with a dict of plain attributes (``cur_scale``, ``dynamic``…; fp16 adds a
  ``torch.float16`` dtype);
- ``deepspeed.runtime.zero.config.ZeroStageEnum``: an ``int`` enum, REDUCE ``ZeroStageEnum(2)``;
- ``deepspeed.utils.tensor_fragment.fragment_address`` (stages 1–2, ``param_slice_mappings``): a
  dataclass, NEWOBJ then BUILD ``{'numel': …, 'start': …}``.

:func:`optim_policy` is the torch policy plus exactly these: the stand-ins only store what BUILD
gives them (a dict of str keys), ``ZeroStageEnum`` takes one of its four values, deepspeed is never
imported (it need not be installed). Used for the optim_states files only. A pickle policy, so below
both the scanner (:mod:`ckptfix.safety`, which allows these names) and the DeepSpeed reader.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any

from .guards import torch_policy
from ..parse.unpickler import Policy, Refused, build_attributes

LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
ZERO_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


class _Attributes:
    """A stand-in holding the attributes a pickle's BUILD gave it, nothing else."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"<{type(self).__module__}.{type(self).__qualname__} stand-in: {fields}>"


class LossScaler(_Attributes):
    """DeepSpeed's static loss scaler: ``cur_scale``, ``dynamic``."""


class DynamicLossScaler(_Attributes):
    """DeepSpeed's fp16 dynamic loss scaler: ``cur_scale``, ``scale_window``, ``dtype``…"""


class fragment_address(_Attributes):  # DeepSpeed's name
    """Where a parameter's slice sits in a rank's flat partition: ``numel``, ``start``."""


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ZeRO stage enum (an int: compares equal to 0–3)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# Named as the originals (repr, messages); a C pickler asked to write one fails loudly, since the
# module can't be imported, instead of writing ckptfix's own name.
for _cls, _name in ((LossScaler, LOSS_SCALER), (DynamicLossScaler, DYNAMIC_LOSS_SCALER),
                    (ZeroStageEnum, ZERO_STAGE_ENUM), (fragment_address, FRAGMENT_ADDRESS)):
    _cls.__module__, _cls.__qualname__ = _name.rsplit(".", 1)

STAND_INS: dict[str, type] = {LOSS_SCALER: LossScaler, DYNAMIC_LOSS_SCALER: DynamicLossScaler,
                              ZERO_STAGE_ENUM: ZeroStageEnum, FRAGMENT_ADDRESS: fragment_address}


def _zero_stage(u: Any, f: Any, args: tuple, kwargs: dict) -> ZeroStageEnum:
    if kwargs or len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2, 3):
        raise Refused(f"{ZERO_STAGE_ENUM} is allowed only as pickle writes a member: ZeroStageEnum(0..3)")
    return ZeroStageEnum(args[0])


@functools.lru_cache(maxsize=1)
def optim_policy() -> Any:
    """The torch policy plus what DeepSpeed's ZeRO optimizers pickle into ``*_optim_states.pt``."""
    base = torch_policy()
    table, calls, newobj, build = dict(base.globals), dict(base.calls), set(base.newobj), dict(base.build)
    table.update(STAND_INS)
    for cls in (LossScaler, DynamicLossScaler, fragment_address):
        newobj.add(id(cls))
        build[cls] = build_attributes
    calls[id(ZeroStageEnum)] = _zero_stage
    return Policy(table, calls, newobj, build, base.append, base.setitem, finish=base.finish)


def optim_names() -> frozenset[str]:
    """The names an optim_states pickle may use beyond the torch policy, for the static scanner."""
    return frozenset(STAND_INS)
