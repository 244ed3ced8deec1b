"""A DCP checkpoint's ``.metadata`` pickle, loaded without running code.

``FileSystemWriter`` pickles ``Metadata`` with protocol 4 (FRAME, STACK_GLOBAL, MEMOIZE). It is read
by ckptfix's restricted unpickler (:mod:`ckptfix.unpickler`) with the torch policy plus DCP's
metadata dataclasses: they may be created (NEWOBJ) and given state (BUILD) — instances only, never
the classes themselves — and anything else (``os.system``…) is refused by name before it is built.

A pickle policy, so below both the scanner (:mod:`ckptfix.safety` walks ``.metadata`` with these names
allowed, then every record it lists) and the DCP reader (:mod:`ckptfix.formats.dcp`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from . import limits
from .checkpoint_dirs import METADATA, member_path
from .errors import CkptfixError, FormatError, UnsafeCheckpointError, trust_advice
from .guards import start_load, torch_policy
from .unpickler import Policy, Refused, build_attributes, build_setstate, loads


@functools.lru_cache(maxsize=1)
def metadata_policy() -> Any:
    """The torch policy plus what ``FileSystemWriter.finish`` pickles into ``.metadata``."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    base = torch_policy()
    table, calls, newobj, build = dict(base.globals), dict(base.calls), set(base.newobj), dict(base.build)
    for cls in (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
                md.TensorProperties, md.MetadataIndex, md.StorageMeta, fs._StorageInfo, fs._StoragePrefix):
        table[f"{cls.__module__}.{cls.__qualname__}"] = cls
        newobj.add(id(cls))
        build[cls] = build_setstate if "__setstate__" in vars(cls) else build_attributes
    enum = md._MEM_FORMAT_ENCODING
    table[f"{enum.__module__}.{enum.__qualname__}"] = enum
    calls[id(enum)] = lambda u, f, args, kwargs: f(*args, **kwargs)
    return Policy(table, calls, newobj, build, base.append, base.setitem, persistent=False, finish=base.finish)


def metadata_names() -> frozenset[str]:
    """The names DCP's ``.metadata`` may use beyond the torch policy (its dataclasses), for the scanner."""
    return frozenset(metadata_policy().globals) - frozenset(torch_policy().globals)


def read_bytes(meta_path: str) -> bytes:
    """``.metadata``'s bytes, within the limit max_pickle_bytes."""
    try:
        size = os.path.getsize(meta_path)
        if size > limits.current().max_pickle_bytes:
            raise limits.exceeded("max_pickle_bytes", "the DCP metadata's size", size, meta_path)
        with open(meta_path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FormatError(f"{meta_path}: can't be read: {e.strerror or e}") from None


def load_metadata(path: str, trust: bool) -> Any:
    """The ``Metadata`` of the DCP directory ``path``, unpickled under the allow-list unless ``trust``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = os.path.join(path, METADATA)
    data = read_bytes(meta_path)
    try:
        if trust:
            import pickle

            meta = pickle.loads(data)  # noqa: S301 - the caller trusts this file
        else:
            start_load()
            meta = loads(data, metadata_policy(), where=meta_path)
    except CkptfixError:
        raise
    except Exception as e:  # noqa: BLE001 - a hostile or broken pickle fails in many ways
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
    inside its file (for the scanner; ``.metadata`` is read with the restricted unpickler)."""
    meta = load_metadata(path, trust=False)
    meta_path = os.path.join(path, METADATA)
    files: dict[Any, str] = {}
    for info in meta.storage_data.values():  # every chunk file checked before any record is
        rel = getattr(info, "relative_path", None)
        if rel not in files:
            files[rel] = member_path(path, rel, meta_path, what="chunk file")
    out: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in meta.storage_data.items():
        file = files[info.relative_path]
        size = os.path.getsize(file)
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
                and 0 <= info.length and info.offset + info.length <= size):
            raise FormatError(f"{file}: a record of {getattr(index, 'fqn', '?')!r} lies outside the file")
        offsets = getattr(index, "offset", None)
        what = f"{getattr(index, 'fqn', '?')}" + (f" @ {list(offsets)}" if offsets is not None else "")
        out.setdefault(file, []).append((what, info.offset, info.length))
    return out
