"""What the gate suggests: the ``ckptfix convert`` line that writes a file the serving loader takes as saved,
the ``--dtype`` it casts to, and a rename or ``--by-order`` where the key names differ. Convert's flags are
spelled by :class:`~ckptfix.ops.convert_options.ConvertOptions`, never here.

>>> ckptfix.verify("ddp.pth", "torchvision:resnet18").convert_command           # doctest: +SKIP
'ckptfix convert ddp.pth ddp.fixed.pth --to single'
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import fields
from typing import Any

from ..core import locations
from ..ops.convert_options import ConvertOptions, flag_of
from ..statedict import repair, wrappers
from ..statedict.transforms import CAST_DTYPES

#: a dtype's name as convert's ``--dtype`` takes it (``float16`` → ``fp16``)
SHORT_DTYPES = {long: short for short, long in CAST_DTYPES.items()}
_CONVERT = {f.name: f for f in fields(ConvertOptions)}


def convert_flag(name: str) -> str:
    """How ``ckptfix convert`` spells its option ``name`` (``'strip_prefix'`` → ``'--strip-prefix'``)."""
    return flag_of(_CONVERT[name]).decls[0]


def cast_to(fit: repair.Fit, target: repair.Target) -> str | None:
    """``--dtype`` for convert when one cast makes every floating tensor the model's (its floats share one dtype)."""
    floats = {d for d in target.dtypes.values() if d and d.startswith(("float", "bfloat"))}
    if not fit.dtype_mismatch or len(floats) != 1:
        return None
    return SHORT_DTYPES.get(floats.pop())


def convert_command(path: str, keys: list[str], fix: repair.Repair, target: repair.Target, select: str | None,
                    dtype: str | None = None, ext: str = ".pth", untie: bool = False,
                    map_location: str | None = None) -> str | None:
    """The ``ckptfix convert …`` line writing ``PATH.fixed{ext}`` (a URL's: ``NAME.fixed{ext}`` here), which plain
    ``torch.load`` (or ``safetensors.torch.load_file``, for ``.safetensors``) + ``load_state_dict`` takes: with ``--untie``
    (tied tensors under every key) and ``--map-location`` (the devices) when given.

    Each candidate command is checked by running its key function over every key; ``None`` when
    no ``--to``/``--strip-prefix``/``--add-prefix`` combination reproduces the repair.
    """
    to = next((name for name, stack in wrappers.TARGETS.items() if stack == tuple(target.wrappers)), None)
    if to is None:
        return None
    lead = wrappers.leading_wrappers(keys[0]) if keys else ()
    strips = [None] if fix.strip_prefix is None else [fix.strip_prefix, ".".join((*lead, fix.strip_prefix))]
    for strip in strips:
        fn = wrappers.key_transform(to, strip_prefix=strip, add_prefix=fix.add_prefix)
        if all(fn(k) == fix.fn(k) for k in keys):
            stem = os.path.splitext(path.rstrip("/") or path)[0]
            if locations.is_remote(path):  # (written here: a local file named after the remote one)
                stem = os.path.splitext(path.rstrip("/").rsplit("/", 1)[-1])[0]
            argv = ["ckptfix", "convert", path, f"{stem}.fixed{ext}", convert_flag("to"), to]
            argv += [convert_flag("strip_prefix"), strip + "."] if strip else []
            argv += [convert_flag("add_prefix"), fix.add_prefix + "."] if fix.add_prefix else []
            argv += [convert_flag("select"), select] if select not in (None, "<nn.Module>") else []
            argv += [convert_flag("dtype"), dtype] if dtype else []
            argv += [convert_flag("untie")] if untie else []
            argv += [convert_flag("map_location"), map_location] if map_location else []
            return " ".join(shlex.quote(a) for a in argv)
    return None


def for_renamed_keys(fit: repair.Fit, target: repair.Target, path: str) -> list[dict[str, Any]]:
    """Where keys are both missing and unexpected: the prefix renames that fit (convert's ``--rename`` applies to
    the single form), and ``--by-order`` when the tensors pair up with the model's in order."""
    single = wrappers.strip_wrappers
    out = [{**rule, "text": _rename_text(rule["rename"]["from"], rule["rename"]["to"], rule["keys"], path)}
           for rule in repair.suggest_renames({single(k): repair.shape_of(fit.state_dict[k]) for k in fit.unexpected},
                                              {single(k): target.shapes[k] for k in fit.missing})]
    if repair.by_order_fits(fit.state_dict, target):
        out.append({"by_order": True, "keys": len(fit.state_dict), "text": (
            "the tensors pair up with the model's in order, shapes equal: "
            f"ckptfix convert {path} OUT {convert_flag('by_order')} --model SPEC [--arg NAME=VALUE …]")})
    return out


def _rename_text(old: str, new: str, keys: int, path: str) -> str:
    """The line suggesting a prefix rename (``old``/``new`` end in ``.``) and the ``ckptfix convert`` that applies it."""
    value = shlex.quote(f"{re.escape(old[:-1])}\\.(.*)={new}\\1")
    return (f"rename {old} -> {new} ({keys} keys, shapes agree): "
            f"ckptfix convert {shlex.quote(path)} OUT {convert_flag('rename')} {value}")
