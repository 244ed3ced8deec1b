"""A DCP checkpoint's ``.metadata`` pickle, loaded without running code.

``FileSystemWriter`` pickles ``Metadata`` with protocol 4 (FRAME, STACK_GLOBAL, MEMOIZE). It is read
by ckptfix's restricted unpickler (:mod:`ckptfix.parse.unpickler`) with the torch policy plus DCP's
metadata dataclasses: they may be created (NEWOBJ) and given state (BUILD) — instances only, never
the classes themselves — and anything else (``os.system``…) is refused by name before it is built.

The names are a frozen table (:data:`DCP_METADATA_CLASSES`; ``tests/safety/test_dcp_tables.py`` compares it
with the installed torch), so the scanner needs no torch: :func:`load_inert` reads ``.metadata`` into
plain stand-ins (:class:`Inert`) and falls back to torch's classes for anything it doesn't know.

A pickle policy, so below both the scanner (:mod:`ckptfix.safety` walks ``.metadata`` with these names
allowed, then every record it lists) and the DCP reader (:mod:`ckptfix.formats.dcp.directory`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from ..core import limits, locations
from ..core.torch_free import NeedsTorch  # what the inert read raises for what it doesn't model
from ..parse.checkpoint_dirs import METADATA, member_path
from ..errors import CkptfixError, FormatError, MissingFileError, RemoteError, UnsafeCheckpointError, trust_advice
from .allowlist import GET_LAYOUT, RULES, TORCH_SIZE
from .guards import start_load, torch_policy
from .standins import path_class
from ..core.torch_tables import DTYPE_ITEMSIZE
from ..parse.unpickler import Policy, Refused, build_attributes, build_setstate, loads


_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

#: DCP's metadata dataclasses as ``FileSystemWriter`` pickles them (``module.qualname``), frozen so the
#: scanner needs no torch; NEWOBJ may create them and BUILD give them state
DCP_METADATA_CLASSES: frozenset[str] = frozenset({
    f"{_MD}.Metadata", f"{_MD}.TensorStorageMetadata", f"{_MD}.BytesStorageMetadata", f"{_MD}.ChunkStorageMetadata",
    f"{_MD}.TensorProperties", f"{_MD}.MetadataIndex", f"{_MD}.StorageMeta", f"{_FS}._StorageInfo",
    f"{_FS}._StoragePrefix",
})
#: the enum ``TensorProperties.__getstate__`` pickles the memory format with (called with its value)
DCP_METADATA_ENUMS: frozenset[str] = frozenset({f"{_MD}._MEM_FORMAT_ENCODING"})
#: the classes whose own ``__setstate__`` BUILD goes through (their state is a tuple, not a dict)
DCP_SETSTATE_CLASSES: frozenset[str] = frozenset({f"{_MD}.TensorProperties"})
#: the fields with a plain default (an instance pickled without them reads the class's default)
DCP_DEFAULTS: dict[str, dict[str, Any]] = {
    f"{_MD}.Metadata": {"planner_data": None, "storage_data": None, "storage_meta": None, "version": None},
    f"{_MD}.MetadataIndex": {"offset": None, "index": None},
    f"{_MD}.StorageMeta": {"checkpoint_id": None, "save_id": None, "load_id": None},
    f"{_FS}._StorageInfo": {"transform_descriptors": None},
}


def metadata_names() -> frozenset[str]:
    """The names DCP's ``.metadata`` may use beyond the torch policy (its dataclasses), for the scanner."""
    return DCP_METADATA_CLASSES | DCP_METADATA_ENUMS


def _resolve(name: str) -> Any:
    module, _, qualname = name.rpartition(".")
    return getattr(importlib.import_module(module), qualname)


@functools.lru_cache(maxsize=1)
def metadata_policy() -> Any:
    """The torch policy plus what ``FileSystemWriter.finish`` pickles into ``.metadata`` (the tables above)."""
    base = torch_policy()
    table, calls, newobj, build = dict(base.globals), dict(base.calls), set(base.newobj), dict(base.build)
    for name in DCP_METADATA_CLASSES:
        table[name] = cls = _resolve(name)
        newobj.add(id(cls))
        build[cls] = build_setstate if name in DCP_SETSTATE_CLASSES else build_attributes
    for name in DCP_METADATA_ENUMS:
        table[name] = enum = _resolve(name)
        calls[id(enum)] = lambda u, f, args, kwargs: f(*args, **kwargs)
    return Policy(table, calls, newobj, build, base.append, base.setitem, persistent=False, finish=base.finish)


def read_bytes(meta_path: str) -> bytes:
    """``.metadata``'s bytes, within the limit max_pickle_bytes."""
    try:
        size = locations.size_of(meta_path)
        if size > limits.current().max_pickle_bytes:
            raise limits.exceeded("max_pickle_bytes", "the DCP metadata's size", size, meta_path)
        return locations.read_all(meta_path)
    except (MissingFileError, RemoteError):
        raise
    except OSError as e:
        raise FormatError(f"{meta_path}: can't be read: {e.strerror or e}") from None


def load_metadata(path: str, trust: bool) -> Any:
    """The ``Metadata`` of the DCP directory ``path``, unpickled under the allow-list unless ``trust``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = locations.join(path, METADATA)
    data = read_bytes(meta_path)
    try:
        if trust:
            import pickle

            meta = pickle.loads(data)  # the caller trusts this file
        else:
            start_load()
            meta = loads(data, metadata_policy(), where=meta_path)
    except CkptfixError:
        raise
    except Exception as e:  # a hostile or broken pickle fails in many ways
        if isinstance(e, Refused):
            raise UnsafeCheckpointError(
                f"{meta_path}: refused: {e}. {trust_advice('checkpoint')}.",
                [e.name] if e.name else [],
            ) from None
        raise FormatError(f"{meta_path}: is corrupt or truncated (the pickle can't be read: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise FormatError(f"{meta_path}: holds a {type(meta).__name__}, not torch.distributed.checkpoint Metadata")
    if not isinstance(meta.storage_data, dict):
        raise FormatError(f"{meta_path}: has no storage data: not written by FileSystemWriter")
    return meta


def record_ranges(path: str) -> dict[str, list[tuple[str, int, int]]]:
    """Every record the DCP directory's ``.metadata`` lists: file → [(entry, offset, length)], each
    inside its file (for the scanner; ``.metadata`` is read with the restricted unpickler, into inert
    stand-ins where it can be, so no torch is imported)."""
    meta = load_inert(path)
    return _ranges(path, meta if meta is not None else load_metadata(path, trust=False))


def _ranges(path: str, meta: Any) -> dict[str, list[tuple[str, int, int]]]:
    meta_path = locations.join(path, METADATA)
    files: dict[Any, str] = {}
    for info in meta.storage_data.values():  # every chunk file checked before any record is
        rel = getattr(info, "relative_path", None)
        if rel not in files:
            files[rel] = member_path(path, rel, meta_path, what="chunk file")
    out: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in meta.storage_data.items():
        file = files[info.relative_path]
        size = locations.size_of(file)
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
                and 0 <= info.length and info.offset + info.length <= size):
            raise FormatError(f"{file}: a record of {getattr(index, 'fqn', '?')!r} lies outside the file")
        offsets = getattr(index, "offset", None)
        what = f"{getattr(index, 'fqn', '?')}" + (f" @ {list(offsets)}" if offsets is not None else "")
        out.setdefault(file, []).append((what, info.offset, info.length))
    return out


# -- the inert read: plain stand-ins, no torch ---------------------------------------------------------

class Inert:
    """A DCP metadata object as plain data: the name it was pickled under and its attributes."""

    pickled_name = ""

    def __repr__(self) -> str:
        return f"{self.pickled_name.rpartition('.')[2]}({vars(self)})"


class InertIndex(Inert):
    """``MetadataIndex``: equal and hashed by (fqn, offset) as torch's dataclass is (``index`` not compared)."""

    def _key(self) -> tuple[Any, Any]:
        if not hasattr(self, "fqn"):
            raise NeedsTorch("a MetadataIndex without fqn")
        return self.fqn, self.offset  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InertIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class Token:
    """A torch dtype or layout, by name (``"float32"``, ``"torch.strided"``)."""

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Token) and (self.kind, self.name) == (other.kind, other.name)

    def __hash__(self) -> int:
        return hash((self.kind, self.name))


#: pickled name → the stand-in class :func:`load_inert` creates for it
INERT_CLASSES: dict[str, type[Inert]] = {
    name: type(name.rpartition(".")[2], (InertIndex if name == f"{_MD}.MetadataIndex" else Inert,),
               {"pickled_name": name, "__module__": __name__, **DCP_DEFAULTS.get(name, {})})
    for name in sorted(DCP_METADATA_CLASSES)
}


def _build_properties(u: Any, inst: Any, state: Any) -> None:
    # TensorProperties.__setstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    if type(state) is not tuple or len(state) != 5:
        raise NeedsTorch("TensorProperties state is not the 5-tuple torch writes")
    u.charge(5, "BUILD")
    inst.dtype, inst.layout, inst.requires_grad, inst.memory_format, inst.pin_memory = state


def _size(u: Any, f: Any, args: tuple, kwargs: dict) -> tuple[int, ...]:
    if kwargs or len(args) != 1 or type(args[0]) not in (tuple, list) or not all(type(n) is int for n in args[0]):
        raise NeedsTorch("torch.Size of something other than ints")
    u.charge(len(args[0]), TORCH_SIZE)
    return tuple(args[0])


def _layout(u: Any, f: Any, args: tuple, kwargs: dict) -> Token:
    if kwargs or len(args) != 1 or type(args[0]) is not str:
        raise NeedsTorch("_get_layout of something other than a name")
    return Token("layout", args[0])


def _memory_format(u: Any, f: Any, args: tuple, kwargs: dict) -> int:
    if kwargs or len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2):
        raise NeedsTorch("a memory format torch's enum doesn't have")
    return args[0]


def _path(u: Any, f: Any, args: tuple, kwargs: dict) -> Any:
    if kwargs or not all(type(a) is str for a in args):
        raise NeedsTorch("a path of something other than strings")
    u.charge(sum(len(a) for a in args), "path")
    return f(*args)  # a pure path: parts only, no file system access


@functools.lru_cache(maxsize=1)
def inert_policy() -> Policy:
    """``.metadata`` into stand-ins: DCP's dataclasses as :class:`Inert`, dtypes and layouts as :class:`Token`,
    ``torch.Size`` as a tuple, paths as pure paths. Nothing else resolves (the torch path decides)."""
    table: dict[str, Any] = dict(INERT_CLASSES)
    calls: dict[int, Callable[..., Any]] = {}
    build: dict[type, Callable[..., Any]] = {}
    for name, cls in INERT_CLASSES.items():
        build[cls] = _build_properties if name in DCP_SETSTATE_CLASSES else build_attributes
    for name in DTYPE_ITEMSIZE:
        table[f"torch.{name}"] = Token("dtype", name)
    for name, guard in ((TORCH_SIZE, _size), (GET_LAYOUT, _layout), (f"{_MD}._MEM_FORMAT_ENCODING", _memory_format)):
        table[name] = token = Token("callable", name)
        calls[id(token)] = guard
    for name, r in RULES.items():
        if r.stand_in == "path":
            table[name] = pure = path_class(name, pure=True)
            calls[id(pure)] = _path
    return Policy(table, calls, {id(c) for c in INERT_CLASSES.values()}, build, append=(list,), setitem=(dict,),
                  persistent=False)


def is_inert(obj: Any, name: str) -> bool:
    """``obj`` is the stand-in of DCP's class ``name`` (``"TensorStorageMetadata"``)."""
    return type(obj) in (INERT_CLASSES.get(f"{_MD}.{name}"), INERT_CLASSES.get(f"{_FS}.{name}"))


def load_inert(path: str) -> Any:
    """The DCP directory's ``Metadata`` as :class:`Inert` stand-ins without importing torch, or None when
    the file holds anything else, is refused or is broken (the torch read, :func:`load_metadata`, then gives
    the answer or the error). Its storage data is checked the way :func:`record_ranges` reads it."""
    meta_path = locations.join(path, METADATA)
    data = read_bytes(meta_path)
    try:
        meta = loads(data, inert_policy(), where=meta_path)
    except Exception:  # anything unexpected is the torch path's to answer
        return None
    if not is_inert(meta, "Metadata") or type(getattr(meta, "state_dict_metadata", None)) is not dict \
            or type(meta.storage_data) is not dict:
        return None
    for index, info in meta.storage_data.items():
        if not (is_inert(index, "MetadataIndex") and is_inert(info, "_StorageInfo")
                and all(hasattr(info, a) for a in ("relative_path", "offset", "length"))):
            return None
    return meta


def inert_record_ranges(path: str) -> dict[str, list[tuple[str, int, int]]] | None:
    """:func:`record_ranges` from the inert read, or None when it needs torch's classes."""
    meta = load_inert(path)
    return None if meta is None else _ranges(path, meta)
