"""torchao's quantized tensor subclasses, read as their inner tensors: the classes named, never imported.

``torch.save`` of a torchao ``Int8Tensor`` (``Float8Tensor``, ``Int4Tensor`` …) pickles
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, (cls, dtype, size, stride, offset, layout, device,
requires_grad), state)``, where ``state`` holds the inner tensors (``qdata``, ``scale``, ``zero_point``) and
plain attributes (``block_size``, an enum, a kwargs dataclass). The allow-list names the classes
(:data:`ckptfix.safety.allowlist.TORCHAO_SUBCLASSES`) with the stand-in :class:`SubclassName`; the guards here
check the two calls and make a :class:`TensorSubclass`, a record, never the class. When the load ends,
:func:`flatten` puts each one's inner tensors in its place under torchao's own flattened names
(``<module>._<name>_<inner>``, as ``flatten_tensor_state_dict`` writes them into safetensors), so every verb
reads them as plain tensors. Serving such a file still needs torchao: ``torch.load(weights_only=True)``
refuses the classes unless ``import torchao`` ran (:data:`SERVING_NEEDS`).
"""

from __future__ import annotations

import threading
from typing import Any

from ..core.units import few, shown
from ..parse.unpickler import Refused, Unpickler, type_name
from .allowlist import SUBCLASS, rule

#: what a server needs before ``torch.load(weights_only=True)`` of such a file: the finding's advice
SERVING_NEEDS = ("the serving process needs `import torchao` before torch.load (torchao registers its tensor "
                 "classes as safe globals), or torch.serialization.add_safe_globals([...]) of each class")
_made = [0]  # records made in this process: none, and no load can hold one (flatten skips its walk)
_flattened = threading.local()  # the last load's: class name → (weight keys, inner names)


class SubclassName:
    """An allowed torchao tensor class, kept as its name (``torchao.quantization.Int8Tensor``)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<tensor subclass {shown(self.name)} (not imported)>"


class EnumName(SubclassName):
    """An allowed torchao enum (``KernelPreference``), kept as its name; calling it makes an :class:`EnumValue`."""

    __slots__ = ()


class EnumValue:
    """``Enum(value)`` as pickle writes a member: the enum's name and the value, nothing looked up."""

    def __init__(self, name: str, value: str | int):
        self.name, self.value = name, value

    def __repr__(self) -> str:
        return f"<{shown(self.name)}({self.value!r}) (not imported)>"


def enum_value(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> EnumValue:
    """A member of an allowed enum, as pickle writes one: REDUCE of the enum with one str or int value."""
    if kwargs or len(args) != 1 or type(args[0]) not in (str, int) or not isinstance(f, EnumName):
        raise Refused(f"{type_name(f)}: an enum member is read only as pickle writes it (one str or int value)")
    u.charge(len(args[0]) if isinstance(args[0], str) else 1, f.name)
    return EnumValue(f.name, args[0])


class TensorSubclass:
    """One pickled subclass tensor: its class name, outer dtype and size, inner tensors and attributes."""

    def __init__(self, name: str, dtype: Any, size: tuple[int, ...], state: dict[str, Any]):
        self.name, self.dtype, self.size = name, dtype, size
        self.inner = {k: v for k, v in state.items() if _is_tensor(v)}
        self.attributes = {k: v for k, v in state.items() if k not in self.inner}
        _made[0] += 1

    def __repr__(self) -> str:
        return f"<{shown(self.name)} {self.dtype} {list(self.size)}: {', '.join(self.inner)}>"


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def _ints(x: Any) -> bool:
    return isinstance(x, tuple) and all(type(i) is int and i >= 0 for i in x)


def wrapper_subclass(u: Unpickler, f: Any, args: tuple, kwargs: dict) -> Any:
    """``_rebuild_wrapper_subclass(cls, dtype, size, stride, offset, layout, device, requires_grad)``: only for
    an allowed class; nothing is allocated (the shell's values are its inner tensors), the arguments kept."""
    import torch

    if kwargs or len(args) != 8 or not isinstance(args[0], SubclassName):
        raise Refused(f"_rebuild_wrapper_subclass of {type_name(args[0]) if args else 'nothing'}: only torchao's "
                      "quantized tensor classes are read (as their inner tensors)")
    cls, dtype, size, stride, offset = args[:5]
    if not isinstance(dtype, torch.dtype) or not _ints(size) or not _ints(stride) or len(size) != len(stride) \
            or type(offset) is not int or type(args[7]) is not bool:
        raise Refused(f"_rebuild_wrapper_subclass of {shown(cls.name)} with unexpected arguments")
    return cls, dtype, tuple(size)


def from_type(u: Unpickler, func: Any, new_type: SubclassName, inner_args: Any, state: Any) -> TensorSubclass:
    """``_rebuild_from_type_v2`` of an allowed class: the wrapper rebuild (through its guard) and the state,
    a dict of public attribute names, kept as a :class:`TensorSubclass`."""
    if not isinstance(inner_args, tuple) or not inner_args or inner_args[0] is not new_type:
        raise Refused(f"_rebuild_from_type_v2 to {shown(new_type.name)}: the rebuild names another class")
    import torch

    if func is not torch._utils._rebuild_wrapper_subclass:
        raise Refused(f"_rebuild_from_type_v2 to {shown(new_type.name)} through {type_name(func)}: only "
                      "torch's wrapper-subclass rebuild makes it")
    if not isinstance(state, dict) or not all(type(k) is str and k.isidentifier() and not k.startswith("__")
                                              for k in state):
        raise Refused(f"{shown(new_type.name)}: its state must be a dict of attribute names")
    cls, dtype, size = u.call(func, inner_args, None, "REDUCE")
    return TensorSubclass(cls.name, dtype, size, state)


def flatten(obj: Any) -> Any:
    """``obj`` with each :class:`TensorSubclass` in a dict replaced by its inner tensors, under torchao's
    flattened names; a record anywhere else is refused (no verb could read it)."""
    if not _made[0]:
        return obj
    _flattened.found = {}
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            if any(isinstance(v, TensorSubclass) for v in x.values()):
                _flatten_dict(x)
            stack.extend(v for v in x.values() if isinstance(v, (dict, list, tuple)))
        elif isinstance(x, (list, tuple)):
            if any(isinstance(v, TensorSubclass) for v in x):
                raise Refused("a torchao tensor outside a dict: ckptfix reads them only in a state dict")
            stack.extend(v for v in x if isinstance(v, (dict, list, tuple)))
    return obj


def flat_name(key: str, inner: str) -> str:
    """torchao's flattened name of ``key``'s inner tensor ``inner``: ``a.b.weight`` → ``a.b._weight_qdata``."""
    module, _, name = key.rpartition(".")
    return f"{module}._{name}_{inner}" if module else f"_{name}_{inner}"


def _flatten_dict(d: dict) -> None:
    items = list(d.items())
    d.clear()
    for key, value in items:
        if not isinstance(value, TensorSubclass):
            d[key] = value
            continue
        if not isinstance(key, str):
            raise Refused(f"a torchao tensor under the key {shown(repr(key))}: only string keys are read")
        keys, inner_names = _flattened.found.setdefault(value.name, ([], {}))
        keys.append(key)
        inner_names.update(dict.fromkeys(value.inner))
        for inner, tensor in value.inner.items():
            name = flat_name(key, inner)
            if name in d or any(k == name for k, _ in items):
                raise Refused(f"{shown(key)}'s inner tensor {shown(inner)} and the entry {shown(name)} collide")
            d[name] = tensor


def take_notes() -> list[str]:
    """A note per torchao class the last load read (its weights, their inner tensors, what serving needs); reset."""
    found, _flattened.found = getattr(_flattened, "found", None) or {}, {}
    return [f"{len(keys)} torchao {name.rpartition('.')[2]} ({few(keys, 2)}): read as their inner tensors "
            f"({', '.join(inner)}) under torchao's flattened names ({flat_name(keys[0], next(iter(inner)))} …); "
            "torchao not imported (serving the file needs it imported)" for name, (keys, inner) in found.items()]


def static_wrapper(name: str, args: Any, op: str, r: Any) -> str | None:
    """The scanner's twin of :func:`wrapper_subclass`: the class must be an allowed torchao tensor class."""
    cls = args[0] if isinstance(args, tuple) and args else None
    full = getattr(cls, "full", None)
    found = rule(full) if isinstance(full, str) else None
    if found is None or found.stand_in != SUBCLASS:
        return (f"{op} calls {name} for {shown(str(full or type_name(cls)))}: only torchao's quantized tensor "
                "classes are read (as their inner tensors)")
    return None
