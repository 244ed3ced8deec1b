"""What torch's weights-only loader refuses among a checkpoint's objects beside its tensors.

Plain ``torch.load(PATH, weights_only=True)`` takes containers (dict, list, tuple, set, ``OrderedDict``,
``Counter``), None, bool, numbers, str and bytes, tensors, and the torch objects of its own table
(:func:`ckptfix.safety.allowlist.torch_names`: dtypes, ``torch.Size``, ``torch.device`` …); any other object —
an ``argparse.Namespace``, a numpy scalar, an mmengine class, a placeholder for ``os.system`` — fails the whole load.
ckptfix reads more than that (its allow-list, inert placeholders): ``convert --keep-extra`` refuses to write such an
object into a ``.pth`` (the output would not load plainly), and ``load_into`` warns when it takes the weights
from a file holding one.

>>> refused({"model": {...}, "args": argparse.Namespace(lr=0.1)})   # doctest: +SKIP
[('args', 'argparse.Namespace')]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..core.tensorinfo import is_tensor
from ..core.units import listed, shown
from ..errors import ConversionError
from ..parse import inert
from ..safety.allowlist import GETATTR, torch_names
from ..safety.standins import StatisticsMethod

#: builtins the weights-only unpickler makes from its own opcodes (no global named)
_OPCODE_TYPES = (type(None), bool, int, float, str, bytes, dict, list, tuple)
#: torch's own values whose class is not the global torch pickles them by (``torch.float32`` is a ``torch.dtype``;
#: sizes and devices are pickled by their class, which torch's table names)
_TORCH_VALUES = frozenset({"torch.dtype", "torch.layout", "torch.qscheme"})


def refused(obj: Any) -> list[tuple[str, str]]:
    """Every object in ``obj`` the weights-only loader refuses, as (where, global name): where is a path of keys
    (``args``, ``hparams.opt``), the name the class ``torch.load`` would have to import. Tensors are not looked
    into; a refused object's attributes are searched too (what else the server would have to allow). Iterative;
    shared objects visited once."""
    allowed = torch_names()
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        x, where = stack.pop()
        if id(x) in seen or is_tensor(x):
            continue
        seen.add(id(x))
        name = _global_of(x)
        if name is not None and name not in allowed and name not in _TORCH_VALUES:
            found.append((where, name))
            state = getattr(x, "__dict__", None)
            stack.extend(reversed([(v, f"{where}.{k}") for k, v in state.items()]) if type(state) is dict else [])
        if isinstance(x, dict):
            stack.extend(reversed([(k, where) for k in x] + [(v, f"{where}.{k}" if where else str(k))
                                                              for k, v in x.items()]))
        elif isinstance(x, (list, tuple, set)):
            stack.extend(reversed([(v, where) for v in x]))
    return found


def _global_of(x: Any) -> str | None:
    """The global ``torch.save`` names for ``x``'s class (None: built from opcodes alone)."""
    if isinstance(x, (inert.InertGlobal, inert.InertObject)):
        return str(x.name)
    if isinstance(x, StatisticsMethod):  # written as getattr(HistoryBuffer, name)
        return GETATTR
    named = getattr(type(x), "pickled_as", None)  # a describing read's token (a dtype): the global it stands for
    if isinstance(named, property):
        return str(x.pickled_as)
    cls = x if isinstance(x, type) else type(x)  # a class is pickled as itself
    if cls in _OPCODE_TYPES and cls is not x:
        return None
    return f"{cls.__module__}.{cls.__qualname__}"


def described(found: list[tuple[str, str]]) -> str:
    """``args (argparse.Namespace), epoch (numpy.int64)``: the objects of :func:`refused`, the first few."""
    return listed([f"{shown(where or 'the top level')} ({shown(name)})" for where, name in found], 5)


def globals_named(found: list[tuple[str, str]]) -> str:
    """The globals of :func:`refused`, each once, as ``add_safe_globals`` would take them."""
    return ", ".join(shown(n) for n in dict.fromkeys(name for _, name in found))


def refuse_writing(source: str, dst: str, extra: Any, allow: Iterable[str]) -> None:
    """``convert --keep-extra`` into one ``.pth``: refused, in one line naming each object and its key, where the
    objects beside the state dict hold one that plain ``torch.load(weights_only=True)`` refuses (the output would
    fail the plain load as a whole), unless ``allow`` (``--allow``) names its global: the loader that resumes from
    the output allows it (``add_safe_globals``, or ``weights_only=False`` for a file its user trusts)."""
    allowed = frozenset(allow)
    found = [(where, name) for where, name in refused(extra) if name not in allowed]
    if found:
        flags = " ".join(f"--allow {n}" for n in dict.fromkeys(name for _, name in found))
        raise ConversionError(
            f"{source}: --keep-extra would write {described(found)} into {dst}, which torch.load(PATH, "
            f"weights_only=True) refuses; drop --keep-extra to write the state dict alone, or, where the code that "
            f"resumes from it allows them (add_safe_globals([{globals_named(found)}])), pass {shown(flags, 1000)}")
