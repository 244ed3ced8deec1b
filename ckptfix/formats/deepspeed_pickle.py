"""Moved to :mod:`ckptfix.deepspeed_pickle`: a pickle policy sits below both the scanner and this reader.
Re-exported here for code that imports it from its old place."""

from __future__ import annotations

from ..deepspeed_pickle import (DYNAMIC_LOSS_SCALER, FRAGMENT_ADDRESS, LOSS_SCALER, STAND_INS, ZERO_STAGE_ENUM,
                                DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address, optim_names,
                                optim_policy)

__all__ = ["DYNAMIC_LOSS_SCALER", "FRAGMENT_ADDRESS", "LOSS_SCALER", "STAND_INS", "ZERO_STAGE_ENUM", "DynamicLossScaler",
           "LossScaler", "ZeroStageEnum", "fragment_address", "optim_names", "optim_policy"]
