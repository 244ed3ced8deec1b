"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``__R_S.distcp`` files.

Reading consolidates every sharded tensor into one whole tensor. ``.metadata`` is a pickle (protocol
4, which torch's weights_only unpickler can't parse), so it is loaded by a restricted unpickler that
builds only DCP's metadata dataclasses, torch.Size/dtype/layout and paths, unless trusted. A tensor
stored as one chunk is mapped from its ``.distcp`` file (no copy); a sharded one (FSDP2, …) is
assembled chunk by chunk into a file-backed scratch mapping under TMPDIR, so anonymous memory
stays bounded by one chunk however large the checkpoint. Keys DCP flattened from nested dicts
(``model.0.weight`` from ``{"model": {"0.weight": …}}``) are nested again from its planner data.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import tempfile
import warnings
from collections import OrderedDict
from typing import Any

from ..errors import CkptfixError, ConversionError, FormatError, UnsafeCheckpointError
from . import RawRead
from .sharded import member_path

DCP = "dcp"
METADATA = ".metadata"


def is_dcp_dir(path: str) -> bool:
    """A directory holding a DCP ``.metadata`` file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


class _Refused(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _allowed_globals() -> dict[str, Any]:
    """What ``FileSystemWriter`` pickles into ``.metadata``, plus ckptfix's allow-list."""
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


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals: ``find_class`` answers only from the allow-list."""

    allowed: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise _Refused(full)
        return self.allowed[full]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def load_metadata(path: str, trust: bool) -> Any:
    """The ``Metadata`` object of the DCP directory ``path``, unpickled safely unless ``trust``."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path, "rb") as f:
            if trust:
                meta = pickle.load(f)  # noqa: S301 - the caller trusts this file
            else:
                unpickler = _MetadataUnpickler(f)
                unpickler.allowed = _allowed_globals()
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


def read(path: str, plan: Any, trust: bool) -> RawRead:
    """Consolidate the DCP checkpoint in directory ``path``: one whole tensor per entry, nested again."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from ..devices import storage_id

    meta = load_metadata(path, trust)
    source = _Chunks(path, meta)
    dev = "cpu" if plan.user_fn is not None else plan.target("cpu")
    entries = meta.state_dict_metadata
    sharded = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata) and not _whole(md)}
    scratch = None
    if dev != "meta":
        scratch = _Scratch(sum(_aligned(_nbytes(md)) for md in sharded.values()))
    flat: dict[str, Any] = {}
    tags: dict[int, str] = {}
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            t = source.tensor(fqn, md, scratch)
            if dev not in ("cpu", "meta"):
                t = t.to(dev)
            tags[storage_id(t)] = "cpu"
            flat[fqn] = t
        elif isinstance(md, BytesStorageMetadata):
            flat[fqn] = source.object(fqn, plan, trust, tags)
        else:
            raise FormatError(f"{source.meta_path}: entry {fqn!r} has unknown storage type {type(md).__name__}")
    source.close()
    files = {info.relative_path for info in meta.storage_data.values()}
    notes = [f"consolidated {len(entries)} DCP entries ({len(sharded)} tensors sharded in chunks) from {len(files)} file(s)"]
    if dev == "meta":
        notes.append("structure only: chunk files were not read")
    return RawRead(obj=_unflatten(flat, meta.planner_data, source.meta_path), format=DCP, tags=tags, notes=notes)


def _whole(md: Any) -> bool:
    return len(md.chunks) == 1 and list(md.chunks[0].offsets) == [0] * len(md.size) and list(md.chunks[0].sizes) == list(md.size)


def _nbytes(md: Any) -> int:
    import torch

    return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class _Scratch:
    """One file-backed shared mapping (unlinked at once) that sharded tensors are assembled in:
    its pages are the page cache's to write back, not anonymous memory."""

    def __init__(self, nbytes: int):
        self.storage: Any = None
        self.pos = 0
        if nbytes == 0:
            return
        import torch

        tmpdir = tempfile.gettempdir()
        try:
            fd, name = tempfile.mkstemp(prefix="ckptfix-dcp-", suffix=".scratch", dir=tmpdir)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS mid-copy
                else:
                    os.ftruncate(fd, nbytes)
                self.storage = torch.UntypedStorage.from_file(name, shared=True, nbytes=nbytes)
            finally:
                os.close(fd)
                os.unlink(name)
        except OSError as e:
            raise ConversionError(
                f"can't reserve {nbytes} bytes of scratch space in {tmpdir} to consolidate the sharded "
                f"tensors ({e.strerror or e}); point TMPDIR at a disk with room"
            ) from None

    def take(self, shape: list[int], dtype: Any, nbytes: int) -> Any:
        import torch

        t = torch.empty(0, dtype=dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        t.set_(self.storage[self.pos : self.pos + nbytes], 0, shape)
        self.pos += _aligned(nbytes)
        return t


class _Chunks:
    """The chunk records of one DCP directory: located, checked, mapped from their files."""

    def __init__(self, path: str, meta: Any):
        self.path = path
        self.meta_path = os.path.join(path, METADATA)
        self.files: dict[str, str] = {}
        self.maps: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}
        self.records: dict[tuple, Any] = {}
        for index, info in meta.storage_data.items():
            offset = getattr(index, "offset", None)
            key = (getattr(index, "fqn", None), None if offset is None else tuple(offset))
            rel = getattr(info, "relative_path", None)
            if rel not in self.files:
                self.files[rel] = member_path(path, rel, self.meta_path, what="chunk file")
            self.records[key] = info
        for fqn, md in meta.state_dict_metadata.items():
            for c in getattr(md, "chunks", []):
                self._record(fqn, c)

    def _record(self, fqn: str, chunk: Any = None) -> Any:
        key = (fqn, None if chunk is None else tuple(chunk.offsets))
        info = self.records.get(key)
        if info is None:
            where = "" if chunk is None else f" chunk at offset {list(chunk.offsets)}"
            raise FormatError(f"{self.meta_path}: {fqn!r}{where} is in the metadata but no .distcp file holds it")
        if getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"{self.meta_path}: {fqn!r} is stored with transforms {info.transform_descriptors} "
                "(compression?); ckptfix reads plain FileSystemWriter checkpoints only"
            )
        return info

    def _blob(self, fqn: str, info: Any) -> _Slice:
        file = self.files[info.relative_path]
        if file not in self.handles:
            self.handles[file] = open(file, "rb")  # noqa: SIM115 - closed in close()
        f = self.handles[file]
        size = os.fstat(f.fileno()).st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise FormatError(
                f"{file}: {fqn!r} is recorded at bytes {info.offset}..{info.offset + info.length} "
                f"but the file has {size}: truncated or from another save"
            )
        return _Slice(f, info.offset, info.length)

    def tensor(self, fqn: str, md: Any, scratch: _Scratch | None) -> Any:
        import torch

        size, dtype = list(md.size), md.properties.dtype
        for c in md.chunks:
            if len(c.offsets) != len(size) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, size)):
                raise FormatError(f"{self.meta_path}: {fqn!r} chunk {list(c.offsets)}+{list(c.sizes)} falls outside its size {size}")
        if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(size):
            raise FormatError(f"{self.meta_path}: the chunks of {fqn!r} don't cover its {size} elements exactly")
        if scratch is None:
            return torch.empty(size, dtype=dtype, device="meta")
        if _whole(md):
            return self._chunk(fqn, md.chunks[0], dtype)
        full = scratch.take(size, dtype, _nbytes(md))
        for c in md.chunks:
            if math.prod(c.sizes):
                full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))].copy_(self._chunk(fqn, c, dtype))
        return full

    def _chunk(self, fqn: str, chunk: Any, dtype: Any) -> Any:
        """One chunk as a tensor mapped from its file (no copy), or loaded when it can't be mapped."""
        import torch

        info = self._record(fqn, chunk)
        blob = self._blob(fqn, info)
        if blob.read(4) != b"PK\x03\x04":
            raise FormatError(f"{self.files[info.relative_path]}: {fqn!r} is not a torch.save record (another DCP serialization format?)")
        blob.seek(0)
        try:
            shell = torch.load(blob, map_location="meta", weights_only=True)  # structure only, no data
            offset = getattr(shell.untyped_storage(), "_checkpoint_offset", None) if isinstance(shell, torch.Tensor) else None
            if not isinstance(shell, torch.Tensor) or list(shell.shape) != list(chunk.sizes) or shell.dtype != dtype:
                got = f"{type(shell).__name__} {list(getattr(shell, 'shape', []))} {getattr(shell, 'dtype', '')}"
                raise FormatError(f"{self.files[info.relative_path]}: {fqn!r} chunk holds {got}, the metadata says {list(chunk.sizes)} {dtype}")
            if offset is None:
                blob.seek(0)
                return torch.load(blob, map_location="cpu", weights_only=True)
        except CkptfixError:
            raise
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad record
            raise FormatError(f"{self.files[info.relative_path]}: {fqn!r} chunk can't be read: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        file = self.files[info.relative_path]
        if file not in self.maps:
            self.maps[file] = torch.UntypedStorage.from_file(file, shared=False, nbytes=os.path.getsize(file))
        start = info.offset + offset
        nbytes = shell.untyped_storage().nbytes()
        t = torch.empty(0, dtype=dtype)
        if nbytes:
            t.set_(self.maps[file][start : start + nbytes], shell.storage_offset(), shell.shape, shell.stride())
        return t

    def object(self, fqn: str, plan: Any, trust: bool, tags: dict[int, str]) -> Any:
        """A non-tensor entry (torch.save bytes), under the same safe policy as a torch file."""
        import torch

        from .. import safety
        from .torchfile import translate_load_error

        info = self._record(fqn)
        blob = io.BytesIO(self._blob(fqn, info).read())
        try:
            with torch.serialization.safe_globals(safety.allowed_globals()):
                return torch.load(blob, map_location=plan.torch_map_location(tags), weights_only=not trust)
        except CkptfixError:
            raise
        except Exception as e:  # noqa: BLE001 - all become FormatError / UnsafeCheckpointError
            raise translate_load_error(f"{self.path}: entry {fqn!r}", DCP, e) from None

    def close(self) -> None:
        for f in self.handles.values():
            f.close()


class _Slice(io.RawIOBase):
    """Bytes ``offset .. offset+length`` of an open file as a seekable file of their own."""

    def __init__(self, f: Any, offset: int, length: int):
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.length - self.pos)
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n]) if n > 0 else 0
        self.pos += got
        return got


def _unflatten(flat: dict[str, Any], planner_data: Any, source: str) -> OrderedDict:
    """Nest DCP's flat keys again with its planner data (fqn → path of dict keys / list indices)."""
    root: OrderedDict = OrderedDict()
    paths = planner_data if isinstance(planner_data, dict) else {}
    for fqn, value in flat.items():
        path = paths.get(fqn) or (fqn,)
        if not isinstance(path, (tuple, list)) or not all(isinstance(p, (str, int)) for p in path):
            raise FormatError(f"{source}: the planner data gives {fqn!r} the path {path!r}, not a key path")
        cur: Any = root
        for key, nxt in zip(path[:-1], path[1:]):
            child = _get(cur, key)
            if child is None:
                child = [] if isinstance(nxt, int) else OrderedDict()
                _put(cur, key, child, len(flat), source)
            elif not isinstance(child, (dict, list)):
                raise FormatError(f"{source}: {fqn!r} nests inside {key!r}, which holds a value")
            cur = child
        _put(cur, path[-1], value, len(flat), source)
    return root


def _get(container: Any, key: Any) -> Any:
    if isinstance(container, list):
        return container[key] if isinstance(key, int) and 0 <= key < len(container) else None
    return container.get(key)


def _put(container: Any, key: Any, value: Any, limit: int, source: str) -> None:
    if isinstance(container, list):
        if not isinstance(key, int) or not 0 <= key < limit:
            raise FormatError(f"{source}: list index {key!r} in the planner data is out of range")
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def write(state_dict: Any, dst_dir: str, force: bool = False, key: str | None = None) -> list[str]:
    """Save ``state_dict`` (or ``{key: state_dict}``) as a DCP directory with torch's own
    ``torch.distributed.checkpoint.save`` (single process), atomically."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ..atomic import atomic_dir

    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in _leaves(state_dict)):
        raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a DCP checkpoint")
    obj = {key: state_dict} if key else state_dict
    notes = []
    if getattr(state_dict, "_metadata", None) is not None:
        notes.append("_metadata (module versions) is not kept: DCP has no place for it")
    with atomic_dir(dst_dir, force) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(obj, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True), no_dist=True)
    notes.append(f"DCP checkpoint: load with torch.distributed.checkpoint.load({{{key!r}: sd}} …)" if key
                 else "DCP checkpoint with the state dict's keys at the top level")
    return notes


def _leaves(obj: Any) -> Any:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj
