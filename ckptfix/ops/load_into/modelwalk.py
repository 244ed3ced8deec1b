"""A model read once for ``load_into``'s plan: its state dict keys and where each tensor lives, its modules,
which of them load their own way, and its non-persistent buffers.

One pass over ``named_modules`` gives all of it. The keys are torch's own (``state_dict(keep_vars=True)``):
built here from ``_parameters`` / ``_buffers`` as torch's ``_save_to_state_dict`` does, or — where any module
changes what its state dict holds (a ``state_dict`` or ``_save_to_state_dict`` of its own, extra state, state
dict hooks) — asked of torch itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...errors import LoadError
from . import shards


@dataclass
class ModelWalk:
    """What the plan needs of a model, read in one pass."""

    state_dict: Any  # key -> tensor (keep_vars), the model's own keys, in torch's order
    places: dict[str, tuple[Any, str, bool]]  # key -> (module, attribute, is a parameter); see place()
    by_name: dict[str, Any]  # every path to a module -> the module
    modules: list[Any]  # each module once
    module_names: list[str]  # named_modules() (each module once, its first name)
    own: set[Any] = field(default_factory=set)  # modules with their own _load_from_state_dict or load hooks
    non_persistent: list[tuple[str, Any]] = field(default_factory=list)  # (key, buffer): no checkpoint holds them

    def place(self, key: str) -> tuple[Any, str, bool]:
        """Where the tensor of ``key`` lives: (module, attribute, is a parameter)."""
        found = self.places.get(key)
        if found is not None:
            return found
        owner, _, name = key.rpartition(".")
        module = self.by_name.get(owner)
        is_param = module is not None and name in module._parameters
        if module is None or not (is_param or name in module._buffers):
            raise LoadError(_not_placed(key, self.by_name))
        return module, name, is_param

    def tensors(self) -> list[tuple[str, Any]]:
        """Every parameter and buffer of the model, by (first) name."""
        return [(k, t) for k, t in self.state_dict.items() if hasattr(t, "is_meta")] + self.non_persistent


def _not_placed(key: str, by_name: dict[str, Any]) -> str:
    """Why a model key names no parameter or buffer: a quantized module's packed weights (``quantize_dynamic``'s
    Linear saves ``scale``, ``zero_point`` and ``_packed_params``, which torch's own load unpacks), else a hook."""
    parts = key.split(".")
    owner = next(path for path in (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)) if path in by_name)
    cls = type(by_name[owner])
    if cls.__module__.startswith(("torch.ao.nn.quantized.", "torch.nn.quantized.")):
        return (f"model module {owner!r} is a quantized {cls.__module__.split('.modules')[0]}.{cls.__qualname__}: its "
                f"weights are packed ({key!r} is no parameter or buffer, torch's own load unpacks it), and ckptfix fills "
                "parameters and buffers only; load this model with model.load_state_dict(ckptfix.load(path))")
    return (f"model key {key!r} is not a parameter or buffer at that path (a state_dict hook renames it?); load this "
            "model with model.load_state_dict(ckptfix.load(path))")


def walk(model: Any) -> ModelWalk:
    """``model`` read once (see the module's docstring)."""
    import torch

    base = torch.nn.Module
    sd: Any = OrderedDict()
    places: dict[str, tuple[Any, str, bool]] = {}
    by_name: dict[str, Any] = {}
    modules: list[Any] = []
    names: list[str] = []
    seen: set[int] = set()
    out = ModelWalk(sd, places, by_name, modules, names)
    custom = False
    for name, module in model.named_modules(remove_duplicate=False):
        by_name[name] = module
        if id(module) not in seen:
            seen.add(id(module))
            modules.append(module)
            names.append(name)
        cls = type(module)
        hooks = [*module._load_state_dict_pre_hooks.values(), *module._load_state_dict_post_hooks.values()]
        if cls._load_from_state_dict is not base._load_from_state_dict or any(not shards.is_fsdp_hook(h) for h in hooks):
            out.own.add(module)
        custom = custom or bool(
            cls.state_dict is not base.state_dict or cls._save_to_state_dict is not base._save_to_state_dict
            or getattr(cls, "get_extra_state", base.get_extra_state) is not base.get_extra_state
            or module._state_dict_hooks or module._state_dict_pre_hooks)
        prefix = f"{name}." if name else ""
        for attr, p in module._parameters.items():
            if p is not None:
                sd[prefix + attr] = p
                places[prefix + attr] = (module, attr, True)
        for attr, b in module._buffers.items():
            if b is None:
                continue
            if attr in module._non_persistent_buffers_set:
                out.non_persistent.append((prefix + attr, b))
            else:
                sd[prefix + attr] = b
                places[prefix + attr] = (module, attr, False)
    if custom:  # torch's own keys (the hooks may rename, add or drop entries)
        out.state_dict = model.state_dict(keep_vars=True)
        out.places = {}
    return out


def left_on_meta(walk: ModelWalk) -> list[str]:
    """The parameters, then buffers, of the walked modules still on meta, by name (each module's
    ``_parameters`` and ``_buffers`` read again: an assignment replaced their entries)."""
    if not any(shards.on_meta(t) for m in walk.modules for d in (m._parameters, m._buffers) for t in d.values()
               if t is not None):
        return []
    prefix = {id(m): f"{n}." if n else "" for n, m in zip(walk.module_names, walk.modules)}
    return [prefix[id(m)] + a for kind in ("_parameters", "_buffers") for m in walk.modules
            for a, t in getattr(m, kind).items() if t is not None and shards.on_meta(t)]  # parameters first, as torch names them
