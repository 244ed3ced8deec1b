"""Where the state dict sits inside a checkpoint, and putting a fixed one back in its place.

A bare state dict is a checkpoint by itself. A training checkpoint is a dict holding it under a
key such as ``state_dict`` (Lightning, timm, mmengine), ``model_state_dict`` (the PyTorch
tutorial), ``model``, ``net``, ``network`` or ``module`` (DeepSpeed), often beside EMA weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConversionError, DeepSpeedZeroError, SelectError
from ..core.tensorinfo import is_tensor

EMA_KEYS = ("state_dict_ema", "model_ema", "ema", "ema_state_dict", "model_ema_state_dict", "ema_model")


@dataclass
class Selection:
    """The chosen state dict, where it sat (``None``: the file is the state dict) and the rest."""

    state_dict: Any
    key: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    ema_keys: list[str] = field(default_factory=list)


def is_state_dict(obj: Any) -> bool:
    """A mapping of str keys holding at least one tensor and no nested mappings."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    has_tensor = False
    for k, v in obj.items():
        if not isinstance(k, str) or isinstance(v, Mapping):
            return False
        has_tensor = has_tensor or is_tensor(v)
    return has_tensor


def _module_state_dict(obj: Any) -> Any | None:
    import sys

    torch = sys.modules.get("torch")  # an nn.Module can exist only once torch is imported
    if torch is not None and isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    return None


def _is_ema(key: str) -> bool:
    k = key.lower()
    return k in EMA_KEYS or k.startswith("ema_") or k.endswith("_ema") or "_ema_" in k


def _resolve(obj: Mapping, key: str) -> Any:
    if key in obj:
        return obj[key]
    cur: Any = obj
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise KeyError(key)
        cur = cur[part]
    return cur


def find_state_dict(obj: Any, select: str = "auto", source: str = "checkpoint") -> Selection:
    """Pick the state dict: ``select='auto'`` takes the single non-EMA one, ``select=KEY`` that key."""
    if isinstance(obj, ZeroWeights):
        return Selection(obj.state_dict, None)
    if select in ("auto", None) and deepspeed_info(obj) is not None:
        select = "module"  # a DeepSpeed model_states file: its frozen_param_fragments are slices of 'module'
    module_sd = _module_state_dict(obj)
    if module_sd is not None:
        return Selection(module_sd, "<nn.Module>")
    if is_state_dict(obj) or isinstance(obj, Mapping) and not obj:  # (an empty dict: a model without parameters)
        if select not in ("auto", None):
            raise SelectError(f"{source}: is a bare state dict; there is no {select!r} entry to select (drop --select)")
        return Selection(obj, None)
    if not isinstance(obj, Mapping):
        raise SelectError(str(missing_state_dict(obj, source)))
    candidates = [k for k, v in obj.items() if isinstance(k, str) and (is_state_dict(v) or _module_state_dict(v) is not None)]
    ema = [k for k in candidates if _is_ema(k)]
    plain = [k for k in candidates if k not in ema]
    if select not in ("auto", None):
        try:
            chosen = _resolve(obj, select)
        except KeyError:
            raise SelectError(
                f"{source}: has no entry {select!r}; state dicts found: {', '.join(candidates) or 'none'}"
            ) from None
        sd = _module_state_dict(chosen)
        if sd is None and not is_state_dict(chosen):
            raise SelectError(f"{source}: entry {select!r} is a {type(chosen).__name__}, not a state dict")
        top = select.split(".")[0] if select not in obj else select
        return Selection(sd if sd is not None else chosen, select, _extra(obj, top), [k for k in ema if k != select])
    if len(plain) == 1:
        key = plain[0]
    elif len(plain) > 1:
        error = SelectError(f"{source}: holds several state dicts ({', '.join(plain)}); choose one with --select KEY "
                            "(library: select='KEY')")
        error.candidates = tuple(plain)
        raise error
    elif ema:
        raise SelectError(
            f"{source}: holds only EMA weights ({', '.join(ema)}); take them explicitly with --select {ema[0]}"
        )
    else:
        raise SelectError(str(missing_state_dict(obj, source)))
    value = obj[key]
    sd = _module_state_dict(value)
    return Selection(sd if sd is not None else value, key, _extra(obj, key), ema)


def missing_state_dict(obj: Any, source: str = "checkpoint") -> str | None:
    """Where ``obj`` holds no state dict at all (a bare tensor, a list, a dict of plain values), the line
    :func:`find_state_dict` refuses it with (``read`` and ``inspect`` show such a file whole); else None."""
    if isinstance(obj, ZeroWeights) or _module_state_dict(obj) is not None:
        return None
    if not isinstance(obj, Mapping):
        kind = "Tensor" if is_tensor(obj) else type(obj).__name__  # (a TensorInfo read without torch too)
        return f"{source}: holds a {kind}, not a state dict or a dict holding one"
    if not obj or is_state_dict(obj) or any(isinstance(k, str) and (is_state_dict(v) or _module_state_dict(v) is not None)
                                            for k, v in obj.items()):
        return None
    return f"{source}: no state dict found; its top-level entries are {', '.join(repr(k) for k in list(obj)[:12])}"


def detect_framework(obj: Any) -> str | None:
    """Name the training framework whose checkpoint layout ``obj`` has, from its top-level keys."""
    if not isinstance(obj, Mapping):
        return None
    keys = set(obj)
    if deepspeed_info(obj) is not None:
        return "deepspeed"
    if "pytorch-lightning_version" in keys or "lightning_version" in keys:
        return "lightning"
    if {"meta", "state_dict", "message_hub"} <= keys or ({"meta", "state_dict"} <= keys and isinstance(obj.get("meta"), Mapping)
                                                        and "mmengine_version" in obj["meta"]):
        return "mmengine"
    if "state_dict" in keys and "arch" in keys:
        return "timm"
    if "model_state_dict" in keys and "optimizer_state_dict" in keys:
        return "pytorch-tutorial"
    return None


RESUMED_BY_FRAMEWORK = ("lightning", "mmengine", "timm", "deepspeed")  # their own resume loads the weights back


def check_resumable(obj: Any, key: str | None, state_dict: Any, strip_prefix: str, source: str) -> None:
    """Refuse ``--strip-prefix`` with ``--keep-extra`` on a framework's training checkpoint: the framework
    resumes by loading the weights at ``key`` into the module that saved them, whose names keep the
    prefix (a LightningModule's ``self.model`` is ``model.0.weight``), so the output could never resume."""
    framework = detect_framework(obj)
    prefix = strip_prefix.strip().strip(".") + "."
    example = next((k for k in state_dict if isinstance(k, str) and k.startswith(prefix)), None)
    if key is None or framework not in RESUMED_BY_FRAMEWORK or example is None:
        return
    raise ConversionError(
        f"{source}: --strip-prefix {prefix} with --keep-extra would write a {framework} checkpoint that can't resume: "
        f"{framework} loads {key!r} into the module that saved it, whose keys keep {prefix!r} (Missing key(s) "
        f"in state_dict: \"{example}\" …); drop --strip-prefix for a resumable copy, or drop --keep-extra for the plain weights"
    )


@dataclass
class DeepSpeedInfo:
    """A DeepSpeed ``*model_states.pt``: ZeRO stage, training precision, and ``module`` keys that hold
    ZeRO-3's shape-[0] placeholders instead of the parameters ``param_shapes`` records."""

    stage: int | None
    precision: str
    version: str | None
    placeholders: dict[str, list[int]]


def deepspeed_info(obj: Any) -> DeepSpeedInfo | None:
    """What a DeepSpeed engine's ``save_checkpoint`` wrote (``module`` beside ``ds_config``/``ds_version``), else None.

    Matched to deepspeed 0.19.8: ``ds_config`` is the engine's config dict (``zero_optimization.stage``,
    ``bf16``/``fp16`` ``enabled``); ``param_shapes`` a list (one per param group) of name → torch.Size.
    """
    if not isinstance(obj, Mapping) or not isinstance(obj.get("module"), Mapping) or not {"ds_config", "ds_version"} & set(obj):
        return None
    config: Mapping[str, Any] = obj["ds_config"] if isinstance(obj.get("ds_config"), Mapping) else {}
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    enabled = [name for name in ("bf16", "bfloat16", "fp16")
               if isinstance(config.get(name), Mapping) and config[name].get("enabled")]
    module = obj["module"]
    floats = {str(t.dtype) for t in module.values() if is_tensor(t) and t.is_floating_point()}
    precision = ("bf16" if enabled[0] != "fp16" else "fp16") if enabled else \
        {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(floats.pop() if len(floats) == 1 else "", "fp32")
    shapes: dict[str, Any] = {}
    for group in obj.get("param_shapes") or []:
        if isinstance(group, Mapping):
            shapes.update(group)
    placeholders = {k: [int(n) for n in shapes[k]] for k, t in module.items()
                    if is_tensor(t) and t.numel() == 0 and k in shapes and math.prod(shapes[k]) > 0}
    version = obj.get("ds_version")
    return DeepSpeedInfo(stage if isinstance(stage, int) else None, precision,
                         version if isinstance(version, str) else None, placeholders)


class ZeroWeights(Mapping):
    """A DeepSpeed ZeRO checkpoint read whole: rank 0's model_states entries (the layout ``framework``
    names) and ``state_dict``, the fp32 master weights consolidated from every rank's optim_states."""

    def __init__(self, model_states: Mapping, state_dict: Any):
        self.model_states = model_states
        self.state_dict = state_dict

    def __getitem__(self, key: str) -> Any:
        return self.model_states[key]

    def __iter__(self) -> Any:
        return iter(self.model_states)

    def __len__(self) -> int:
        return len(self.model_states)


def check_deepspeed(obj: Any, select: str | None, source: str, refuse: bool = True) -> list[str]:
    """Notes on a DeepSpeed model_states file read as it is (``select='module'``, or no optim_states to
    consolidate from), or DeepSpeedZeroError (``refuse``) when its ``module`` isn't usable weights:
    ZeRO-3 placeholders (never), or ZeRO-1/2's half-precision training copy (only when asked for by
    ``select='module'``). ``refuse=False`` (inspect) turns both into notes. A consolidated
    checkpoint (:class:`ZeroWeights`) needs none: its reader says what it did."""
    info = None if isinstance(obj, ZeroWeights) else deepspeed_info(obj)
    if info is None:
        return []
    version = f"deepspeed {info.version}" if info.version else "deepspeed"
    asked = select == "module"
    optim = _optim_states_hint(source)
    if info.stage == 3 or info.placeholders:
        key, shape = next(iter(info.placeholders.items()), ("", []))
        example = f" (e.g. {key!r} is {shape} in its param_shapes)" if key else ""
        what = f"a DeepSpeed ZeRO-3 per-rank file ({version}, {info.precision})"
        why = (f"its 'module' holds {len(info.placeholders)} placeholder tensors of shape [0] where the weights go"
               f"{example}; ZeRO-3 splits the weights across every rank's *_optim_states.pt"
               + ("; --select module can't help: the placeholders hold no values; drop it to consolidate them"
                  if asked else f", {optim}"))
    elif info.precision != "fp32" and info.stage in (1, 2):
        if asked:
            return [f"DeepSpeed ZeRO-{info.stage} ({version}): took the {info.precision} training copy in 'module' as "
                    "asked (select='module'); without it ckptfix consolidates the fp32 master weights from the "
                    "*_optim_states.pt files"]
        what = f"a DeepSpeed ZeRO-{info.stage} checkpoint trained in {info.precision} ({version})"
        why = (f"its 'module' holds the {info.precision} training copy of the weights; the fp32 master weights are "
               f"in the *_optim_states.pt files, {optim}; to take the {info.precision} copy deliberately, pass "
               "--select module (library: select='module')")
    else:
        stage = f"ZeRO-{info.stage}" if info.stage is not None else "checkpoint"
        return [f"DeepSpeed {stage} ({version}, {info.precision}): 'module' holds the model's full weights"
                + ("" if asked else "; no *_optim_states.pt beside it to consolidate the fp32 master weights from")]
    if refuse:
        raise DeepSpeedZeroError(f"{source}: is {what}: {why}")
    return [f"{what}: {why}; convert, load and verify refuse it as it is"]


def _optim_states_hint(source: str) -> str:
    """Where ckptfix needs the optim_states files to be, for a model_states file read without them."""
    where = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else source
    return (f"which are not in {where}: give the checkpoint directory (the one holding `latest`) or the tag "
            "directory with every rank's files, and ckptfix consolidates the fp32 weights as zero_to_fp32.py does")


def common_prefix(keys: list[str]) -> str | None:
    """The first segment every key shares (Lightning's attribute, e.g. ``'model.'``), if any."""
    if not keys:
        return None
    first = {k.split(".", 1)[0] for k in keys}
    if len(first) == 1 and all("." in k for k in keys):
        return first.pop() + "."
    return None


def _extra(obj: Mapping, key: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != key}


def put_back(original: Mapping, key: str | None, state_dict: Any) -> Any:
    """The checkpoint with ``state_dict`` in place of the one at ``key``, same layout and order."""
    if key is None or key == "<nn.Module>":
        return state_dict
    if key not in original:  # dotted path
        head, rest = key.split(".", 1)
        return {k: (put_back(v, rest, state_dict) if k == head else v) for k, v in original.items()}
    out = type(original)() if isinstance(original, dict) else {}
    for k, v in original.items():
        out[k] = state_dict if k == key else v
    return out
