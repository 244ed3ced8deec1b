"""A DCP checkpoint's ``.metadata`` pickle, loaded without running code.

``FileSystemWriter`` pickles ``Metadata`` with protocol 4, which torch's weights_only unpickler
can't parse (FRAME, STACK_GLOBAL, MEMOIZE). So it is read by pickle's documented way to restrict
globals — ``Unpickler.find_class`` answering only from an allow-list: DCP's metadata dataclasses,
``torch.Size``, dtypes and layouts, path objects, and ckptfix's own allow-list. Anything else
(``os.system``…) is refused by name before it is built.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from ..errors import FormatError, UnsafeCheckpointError

METADATA = ".metadata"


class _Refused(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def allowed_globals() -> dict[str, Any]:
    """``module.name`` → object for everything ``FileSystemWriter.finish`` pickles into ``.metadata``."""
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    from .. import safety

    allowed: dict[str, Any] = {}
    for obj in (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
                md.TensorProperties, md.MetadataIndex, md.StorageMeta, md._MEM_FORMAT_ENCODING,
                fs._StorageInfo, fs._StoragePrefix, torch.Size, torch.serialization._get_layout,
                pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath,
                *safety.allowed_globals()):
        obj, name = obj if isinstance(obj, tuple) else (obj, f"{obj.__module__}.{obj.__qualname__}")
        allowed[name] = obj
    allowed.update((str(v), v) for v in vars(torch).values() if isinstance(v, torch.dtype))
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    allowed: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise _Refused(full)
        return self.allowed[full]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata(path: str, trust: bool) -> Any:
    """The ``Metadata`` of the DCP directory ``path``, unpickled under the allow-list unless ``trust``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path, "rb") as f:
            if trust:
                meta = pickle.load(f)  # noqa: S301 - the caller trusts this file
            else:
                unpickler = _RestrictedUnpickler(f)
                unpickler.allowed = allowed_globals()
                meta = unpickler.load()
    except _Refused as e:
        raise UnsafeCheckpointError(
            f"{meta_path}: refused: the DCP metadata needs {e.name}, which is outside the safe allow-list "
            "(loading it could run code). If you trust this checkpoint and its author, pass --trust "
            "(library: trust=True).",
            [e.name],
        ) from None
    except OSError as e:
        raise FormatError(f"{meta_path}: can't be read: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - a hostile or broken pickle fails in many ways
        raise FormatError(f"{meta_path}: is corrupt or truncated (the pickle can't be read: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise FormatError(f"{meta_path}: holds a {type(meta).__name__}, not torch.distributed.checkpoint Metadata")
    if not isinstance(meta.storage_data, dict):
        raise FormatError(f"{meta_path}: has no storage data: not written by FileSystemWriter")
    return meta
