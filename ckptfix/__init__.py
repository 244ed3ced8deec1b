"""ckptfix: load any PyTorch checkpoint anywhere, fix wrapper prefixes, convert formats.

Importing ckptfix does not import torch; each function imports it when called.

>>> import ckptfix                                             # doctest: +SKIP
>>> sd = ckptfix.load("ddp_run.pth")                           # 'module.' gone, on CPU
>>> ckptfix.convert("ddp_run.pth", "model.safetensors")
>>> ckptfix.load_into(model, "compiled_ddp_run.pth")

The package is layered (ARCHITECTURE.md): ``core`` → ``parse`` → ``safety`` → ``statedict`` → ``formats`` →
``ops`` → ``model`` → ``cli``. The names below are loaded on first use from the module that defines them;
the ``TYPE_CHECKING`` block names the same ones for type checkers (tests/test_package.py keeps both in step).

A URL scheme beyond ``https://``, ``s3://`` and ``hf://`` is one :class:`UrlBackend` subclass (``open`` returns a
``ckptfix.core.remote.ByteSource`` whose ``_fetch(offset, n)`` returns those bytes; listing and writing optional)
and one ``ckptfix.register_url_scheme("gs", GcsBackend())``: every verb then takes ``gs://`` URLs
(``unregister_url_scheme("gs")`` undoes it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors
from .errors import CkptfixError

__version__ = "0.1.0"

#: public name -> "module:attribute" (a function or class) or "module" (a public submodule)
_LAZY = {
    "verify": "model.verify:verify",
    "VerifyReport": "model.findings:VerifyReport",
    "diff": "ops.diff:diff",
    "DiffReport": "ops.diff:DiffReport",
    "describe": "ops.api:describe",
    "load": "ops.api:load",
    "read": "ops.api:read",
    "inspect": "ops.api:inspect",
    "convert": "ops.api:convert",
    "load_into": "ops.api:load_into",
    "Checkpoint": "reports:Checkpoint",
    "ConvertReport": "reports:ConvertReport",
    "LoadReport": "reports:LoadReport",
    "scan": "safety:scan",
    "ScanReport": "safety:ScanReport",
    "reports": "reports",
    "safety": "safety",
    "formats": "formats",
    "wrappers": "statedict.wrappers",
    "devices": "core.devices",
    "limits": "core.limits",
    "register_url_scheme": "core.remote:register",
    "unregister_url_scheme": "core.remote:unregister",
    "UrlBackend": "core.remote:Backend",
}

__all__ = ["CkptfixError", "errors", "__version__", "verify", "VerifyReport", "diff", "DiffReport", "describe", "load",
           "read", "inspect", "convert", "load_into", "Checkpoint", "ConvertReport", "LoadReport", "scan", "ScanReport",
           "reports", "safety", "formats", "wrappers", "devices", "limits", "register_url_scheme", "unregister_url_scheme",
           "UrlBackend"]

if TYPE_CHECKING:
    from . import formats, reports, safety
    from .core import devices, limits
    from .core.remote import Backend as UrlBackend, register as register_url_scheme, unregister as unregister_url_scheme
    from .model.findings import VerifyReport
    from .model.verify import verify
    from .ops.api import convert, describe, inspect, load, load_into, read
    from .ops.diff import DiffReport, diff
    from .reports import Checkpoint, ConvertReport, LoadReport
    from .safety import ScanReport, scan
    from .statedict import wrappers


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    module_name, _, attr = _LAZY[name].partition(":")
    value = importlib.import_module(f".{module_name}", __name__)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value  # looked up once
    return value
