"""The state dict's ``_metadata``: what torch's loaders read kept, every other entry dropped with a line saying why.

``load_state_dict`` hands ``_metadata[path]`` (``{}`` where absent) to the load hooks of the module at ``path``, and
``_metadata.get("")`` is its first call. torch's modules read ``version`` (compared with an int: BatchNorm,
InstanceNorm, quantized modules) and ``spectral_norm`` (``{"weight.version": 1}``); ``state_dict()`` writes nothing
else. So kept: a dict of module paths, each a dict of plain values (None, bool, numbers, str, and lists, tuples and
str-keyed dicts of them), ``version`` a number. Dropped, each with a line naming the module key and why: an entry
that is not a dict (its module's hooks fail on it), a ``version`` torch can't compare, a value that is not plain
data (an inert placeholder, a ``Namespace``: the weights-only loader refuses the file), and
``assign_to_params_buffers`` (``load_state_dict(assign=…)``'s flag: from a file it makes every plain load assign).
A ``_metadata`` that is not a dict fails ``load_state_dict`` with every model: refused in one line where weights are
taken, a note where a checkpoint is described, a finding in ``verify``. Read by :func:`ckptfix.ops.reading.summarise`,
so ``read``, ``load``, ``load_into``, ``convert`` and ``verify`` see one rule.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ..errors import FormatError
from ..parse import inert

#: keys of a module's entry that torch's own loaders read, and what each must hold
VERSION = "version"  # every module: ``local_metadata.get("version")`` compared with an int
SPECTRAL_NORM = "spectral_norm"  # torch.nn.utils.spectral_norm: ``{"weight.version": 1}``, each compared with an int
LOAD_TIME = "assign_to_params_buffers"  # set by load_state_dict(assign=…) as it loads; state_dict() never writes it
#: why an object is dropped: what the weights-only loader refuses (a placeholder, a Namespace, a numpy scalar …)
NOT_PLAIN = "not plain data (None, bool, numbers, str, and lists and dicts of them)"
#: nesting deeper than this is not plain data (a module's entry holds flat values)
MAX_DEPTH = 32
_SHOWN = 120  # characters of a key or value shown in a line


def clean_metadata(md: Any) -> tuple[Any, list[str], bool]:
    """``md`` as torch's loaders take it, one line per dropped part (naming the module key and why), and whether the
    whole of it was dropped (not a dict: ``load_state_dict`` fails on it with every model).

    The kept ``_metadata`` is ``md`` itself when nothing is dropped, else a new OrderedDict of the kept entries.

    >>> clean_metadata({"bn": {"version": "1"}, "fc": {"version": 1}})[1]   # doctest: +ELLIPSIS
    ["_metadata['bn']['version']: a str ('1'), not a number: ..."]
    """
    if md is None:
        return None, [], False  # (torch's own reading: no _metadata)
    if not isinstance(md, dict):
        return None, [f"_metadata is {_kind(md)}, not a dict of module paths: load_state_dict fails on it with any "
                      "model (its first step is _metadata.get(''))"], True
    kept: OrderedDict[str, Any] = OrderedDict()
    lines: list[str] = []
    for path, entry in md.items():
        where = f"_metadata[{_shown(path)}]"
        if not isinstance(path, str):
            lines.append(f"{where}: {_kind(path)} key, not a module path (load_state_dict looks modules up by "
                         "their str path)")
        elif not isinstance(entry, dict):
            lines.append(f"{where}: {_kind(entry)}, not a dict: load_state_dict fails on it with any model that has a "
                         f"module at {_shown(path)} (its load hooks call .get on it)")
        else:
            kept_entry, entry_lines = _clean_entry(where, entry)
            kept[path] = kept_entry
            lines += entry_lines
    return (md if not lines else kept), lines, False


def objects(lines: list[str]) -> list[str]:
    """Of :func:`clean_metadata`'s lines, those dropping an object (what makes the weights-only loader refuse
    the file as saved: ``load_into`` warns of them), each as where and what: ``_metadata['']['x']: an argparse.Namespace``."""
    return [line[: -len(NOT_PLAIN) - 2] for line in lines if line.endswith(NOT_PLAIN)]


def note(line: str) -> str:
    """A line of :func:`clean_metadata` as a verb's note: what was dropped, and why."""
    return f"{line}; dropped"


def apply(state_dict: Any, source: str, refuse: bool) -> list[str]:
    """Set ``state_dict._metadata`` to what :func:`clean_metadata` keeps; its lines (:func:`note` makes each a
    note). ``refuse``: a ``_metadata`` no model loads (not a dict) raises FormatError naming ``source``, else it is
    dropped with its line."""
    md = getattr(state_dict, "_metadata", None)
    if md is None:
        return []
    kept, lines, whole = clean_metadata(md)
    if whole and refuse:
        raise FormatError(f"{source}: the state dict's {lines[0]}; `ckptfix inspect {source}` shows the rest")
    if whole:
        delattr(state_dict, "_metadata")
    elif kept is not md:
        state_dict._metadata = kept
    return lines


def _clean_entry(where: str, entry: dict) -> tuple[dict, list[str]]:
    """A module's entry: its items torch reads checked for the type torch compares them with, the rest plain data."""
    kept: dict[str, Any] = {}
    lines: list[str] = []
    for name, value in entry.items():
        at = f"{where}[{_shown(name)}]"
        why = None
        if not isinstance(name, str):
            why = f"{_kind(name)} key, not a name"
        elif name == LOAD_TIME:
            why = ("load_state_dict(assign=…)'s flag, set as it loads and never saved by state_dict(): from a file it "
                   "makes every plain load assign the file's tensors (their dtype and device kept)")
        elif name == VERSION and not _is_version(value):
            why = (f"{_kind(value)}, not a number: torch's modules compare it with an int (BatchNorm's load fails on "
                   "it)")
        elif name == SPECTRAL_NORM and not (isinstance(value, dict) and all(
                isinstance(k, str) and _is_version(v) for k, v in value.items())):
            why = f"{_kind(value)}, not a dict of versions: spectral_norm's load hook compares each with an int"
        elif not _is_plain(value):
            why = f"{_kind(value)}, {NOT_PLAIN}"
        if why is None:
            kept[name] = value
        else:
            lines.append(f"{at}: {why}")
    return kept, lines


def _is_version(value: Any) -> bool:
    """What ``version < 2`` takes as torch means it: a number, or None (no version: the oldest)."""
    return value is None or type(value) in (int, float, bool)


def _is_plain(value: Any) -> bool:
    """None, bool, int, float, str, and lists, tuples and str-keyed dicts of them (JSON's values), at most
    :data:`MAX_DEPTH` deep: the values torch's load hooks read and every output format can hold."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        x, depth = stack.pop()
        if x is None or type(x) in (bool, int, float, str):
            continue
        if depth >= MAX_DEPTH:
            return False
        if type(x) in (list, tuple):
            stack.extend((v, depth + 1) for v in x)
        elif type(x) in (dict, OrderedDict) and all(type(k) is str for k in x):
            stack.extend((v, depth + 1) for v in x.values())
        else:
            return False
    return True


def _kind(value: Any) -> str:
    """What ``value`` is, for a line: ``a list``, ``a str ('1')``, ``an inert placeholder for os.system …``."""
    if isinstance(value, (inert.InertGlobal, inert.InertObject)):
        return (f"an inert placeholder for {_clip(value.name)} (a global outside the allow-list, never imported; "
                "torch's weights-only loader refuses it)")
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if type(value) in (bool, int, float, str):
        return f"{article} {name} ({_shown(value)})"
    return f"{article} {_clip(name)}"


def _shown(value: Any) -> str:
    """``repr`` (control characters escaped), clipped: a key or value from the file as a line shows it."""
    return _clip(repr(value))


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "…"
