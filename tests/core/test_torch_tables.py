"""The tables ckptfix keeps of torch so it needs no ``import torch`` are the installed torch's own.

- ``ckptfix.core.torch_tables``: torch's weights_only allow-list for the installed torch's release series,
  the dtype sizes, the dtypes that may require grad, the legacy storage classes;
- ``ckptfix.safety.dcp_policy``: DCP's metadata dataclasses, enums, ``__setstate__`` classes and defaults.

A torch upgrade that changes any of them fails here, saying what to add or remove. This file needs only
torch, pytest and ckptfix (no torchvision, safetensors or conftest), so ``make test`` also runs it in a
second venv with another torch release (``OTHER_TORCH`` in the Makefile).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as fs
from torch.distributed.checkpoint import metadata as md

from ckptfix.safety import dcp_policy
from ckptfix.safety.dcp_policy import DCP_DEFAULTS, DCP_METADATA_CLASSES, DCP_METADATA_ENUMS, DCP_SETSTATE_CLASSES
from ckptfix.parse.safetensors_header import DTYPES
from ckptfix.core.torch_tables import DIFFERENTIABLE, DTYPE_ITEMSIZE, STORAGE_DTYPES, TORCH_SAFE_GLOBALS, torch_series


def _delta(what: str, frozen: set | frozenset, live: set, where: str) -> str:
    return (f"{what} differs from torch {torch.__version__}'s: add {sorted(live - set(frozen))}, "
            f"remove {sorted(set(frozen) - live)} ({where})")


# -- ckptfix/core/torch_tables.py ------------------------------------------------------------------------------

def test_series_is_read_without_importing_torch() -> None:
    torch_series.cache_clear()
    try:
        assert torch_series() == ".".join(torch.__version__.split(".")[:2])
    finally:
        torch_series.cache_clear()


def test_frozen_allow_list_is_torchs() -> None:
    from torch._weights_only_unpickler import _get_allowed_globals

    series = torch_series()
    live = set(_get_allowed_globals())
    assert series in TORCH_SAFE_GLOBALS, f'no frozen allow-list for torch {series}: add "{series}": frozenset({sorted(live)})'
    assert set(TORCH_SAFE_GLOBALS[series]) == live, _delta(f"TORCH_SAFE_GLOBALS[{series!r}]", TORCH_SAFE_GLOBALS[series],
                                                           live, "ckptfix/core/torch_tables.py")


def test_allow_list_rules_of_torch_defaults_are_torchs() -> None:
    """Each rule the allow-list keeps for one of torch's defaults (a guard, a refusal) names a global torch
    allows, and none of ckptfix's additions is one of torch's."""
    from torch._weights_only_unpickler import _get_allowed_globals

    from ckptfix.safety.allowlist import RULES, TORCH

    live = set(_get_allowed_globals())
    torchs = {name for name, r in RULES.items() if r.origin == TORCH}
    assert torchs <= live, f"rules for globals torch {torch.__version__} no longer allows: {sorted(torchs - live)}"
    assert not (set(RULES) - torchs) & live, sorted((set(RULES) - torchs) & live)


def test_frozen_dtype_tables_are_torchs() -> None:
    for name, size in DTYPE_ITEMSIZE.items():
        assert torch._utils._element_size(getattr(torch, name)) == size, name
    assert DIFFERENTIABLE == {n for n in DTYPE_ITEMSIZE if getattr(torch, n).is_floating_point
                              or getattr(torch, n).is_complex}
    live = {cls: str(dt).removeprefix("torch.") for dt, cls in torch.storage._dtype_to_storage_type_map().items()}
    assert STORAGE_DTYPES == live, _delta("STORAGE_DTYPES", set(STORAGE_DTYPES.items()), set(live.items()),
                                          "ckptfix/core/torch_tables.py")
    assert set(DTYPES.values()) <= set(DTYPE_ITEMSIZE)


# -- ckptfix/safety/dcp_policy.py ------------------------------------------------------------------------------

def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _defined(module: Any, test: Any) -> set[Any]:
    return {o for o in vars(module).values() if inspect.isclass(o) and o.__module__ == module.__name__ and test(o)}


INSTALLED_CLASSES = _defined(md, dataclasses.is_dataclass) | _defined(fs, dataclasses.is_dataclass)


def test_metadata_classes_match_installed_torch() -> None:
    installed = {_name(c) for c in INSTALLED_CLASSES}
    assert DCP_METADATA_CLASSES == installed, _delta("DCP_METADATA_CLASSES", DCP_METADATA_CLASSES, installed,
                                                     "ckptfix/safety/dcp_policy.py")


def test_metadata_enums_match_installed_torch() -> None:
    installed = {_name(c) for c in _defined(md, lambda o: issubclass(o, enum.Enum))}
    assert DCP_METADATA_ENUMS == installed, _delta("DCP_METADATA_ENUMS", DCP_METADATA_ENUMS, installed,
                                                   "ckptfix/safety/dcp_policy.py")


def test_setstate_classes_match_installed_torch() -> None:
    installed = {_name(c) for c in INSTALLED_CLASSES if "__setstate__" in vars(c)}
    assert DCP_SETSTATE_CLASSES == installed, _delta("DCP_SETSTATE_CLASSES", DCP_SETSTATE_CLASSES, installed,
                                                     "ckptfix/safety/dcp_policy.py")


def test_defaults_match_installed_torch() -> None:
    """Plain defaults of the classes built from a dict (a field pickled without its value reads these)."""
    installed = {}
    for cls in INSTALLED_CLASSES:
        if _name(cls) in DCP_SETSTATE_CLASSES:
            continue
        plain = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        if plain:
            installed[_name(cls)] = plain
    assert DCP_DEFAULTS == installed, f"DCP_DEFAULTS should be {installed!r} for torch {torch.__version__}"


def test_policy_resolves_every_name_to_torch() -> None:
    policy = dcp_policy.metadata_policy()
    for name in DCP_METADATA_CLASSES | DCP_METADATA_ENUMS:
        assert _name(policy.globals[name]) == name
