"""The torch-free paths' one signal and their switch.

A reader or writer that works without torch (describing a torch zip, writing a safetensors file from
:class:`~ckptfix.core.tensorinfo.TensorInfo`, reading DCP metadata into stand-ins) raises :class:`NeedsTorch`
where it can't reproduce torch's answer exactly; its caller catches it in one place and takes the torch path,
which gives the answer, or its own refusal.
"""

from __future__ import annotations

import os

#: Set to ``0`` to take the torch path everywhere (the differential tests compare both paths).
ENV_SWITCH = "CKPTFIX_TORCH_FREE"


class NeedsTorch(Exception):
    """This file or output needs torch: the torch-free path declines (the caller takes the torch path)."""


def enabled() -> bool:
    """Whether the torch-free paths are on (:data:`ENV_SWITCH` not ``0``/``false``/``no``/``off``)."""
    return os.environ.get(ENV_SWITCH, "1").strip() not in ("0", "false", "no", "off")
