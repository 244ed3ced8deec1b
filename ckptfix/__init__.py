"""ckptfix: load any PyTorch checkpoint anywhere, fix wrapper prefixes, convert formats.

Importing ckptfix does not import torch; each function imports it when called.

>>> import ckptfix                                             # doctest: +SKIP
>>> sd = ckptfix.load("ddp_run.pth")                           # 'module.' gone, on CPU
>>> ckptfix.convert("ddp_run.pth", "model.safetensors")
>>> ckptfix.load_into(model, "compiled_ddp_run.pth")
"""

from __future__ import annotations

from typing import Any

from . import errors
from .errors import CkptfixError

# Bound eagerly (these modules import no torch at import time): the functions share their
# submodules' names, and importing a submodule first would otherwise leave ``ckptfix.verify``
# bound to the module instead of the function.
from .diff import DiffReport, diff
from .verify import VerifyReport, verify

__version__ = "0.1.0"

_LAZY = {
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

__all__ = ["CkptfixError", "errors", "__version__", "verify", "VerifyReport", "diff", "DiffReport", *_LAZY]


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:
        return importlib.import_module(f".{name}", __name__)
    return getattr(importlib.import_module(f".{module_name}", __name__), name)
