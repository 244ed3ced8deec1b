"""ckptfix: load any PyTorch checkpoint anywhere, fix wrapper prefixes, convert formats.

Importing ckptfix does not import torch; each function imports it when called.

>>> import ckptfix                                             # doctest: +SKIP
>>> sd = ckptfix.load("ddp_run.pth")                           # 'module.' gone, on CPU
>>> ckptfix.convert("ddp_run.pth", "model.safetensors")
>>> ckptfix.load_into(model, "compiled_ddp_run.pth")
"""

from __future__ import annotations

import sys
import types
from typing import Any

from . import errors
from .errors import CkptfixError

__version__ = "0.1.0"

#: functions that share their submodule's name: ``ckptfix.verify`` is always the function, while
#: ``from ckptfix.verify import …`` reaches the module through ``sys.modules``
_SAME_NAME = {"verify", "diff"}

_LAZY = {
    "verify": "verify",
    "VerifyReport": "verify",
    "diff": "diff",
    "DiffReport": "diff",
    "describe": "api",
    "load": "api",
    "read": "api",
    "inspect": "api",
    "convert": "api",
    "load_into": "api",
    "Checkpoint": "reports",
    "ConvertReport": "reports",
    "LoadReport": "reports",
    "reports": None,
    "wrappers": None,
    "devices": None,
    "formats": None,
    "safety": None,
    "limits": None,
    "scan": "safety",
    "ScanReport": "safety",
}

__all__ = ["CkptfixError", "errors", "__version__", *_LAZY]


class _Package(types.ModuleType):
    """Importing a submodule binds it on its package (``setattr(ckptfix, "verify", module)``); for
    the submodules named like their function, bind the function instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SAME_NAME and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    if name in _SAME_NAME:
        globals()[name] = value  # looked up once: the function, not the submodule
    return value
