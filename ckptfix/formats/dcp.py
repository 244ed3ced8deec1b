"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``__R_S.distcp`` files.

Reading consolidates every sharded tensor into one whole tensor (``.metadata`` is unpickled under
an allow-list: see ``dcp_metadata``). A tensor stored as one chunk is mapped from its ``.distcp``
file (no copy); a sharded one (FSDP2, …) is assembled chunk by chunk into a file-backed scratch
mapping under TMPDIR, so anonymous memory stays bounded by one chunk however large the
checkpoint. Keys DCP flattened from nested dicts (``model.0.weight`` from
``{"model": {"0.weight": …}}``) are nested again from its planner data. A Lightning ``meta.pt``
beside the DCP files joins them into one checkpoint (``lightning_dir``). Writing is torch's own
``torch.distributed.checkpoint.save`` in one process.
"""

from __future__ import annotations

import io
import math
import os
import re
import tempfile
import warnings
from collections import OrderedDict
from typing import Any

from ..atomic import DirOutput
from ..errors import CkptfixError, ConversionError, FormatError
from . import RawRead
from .dcp_metadata import METADATA, load_metadata
from ..zipfmt import RangeFile
from .sharded import member_path

DCP = "dcp"
# what a DCP output consists of (FileSystemWriter, single_file_per_rank): all that --force replaces
DIR_OUTPUT = DirOutput("DCP", re.compile(r"\.metadata|__\d+_\d+\.distcp"), METADATA)


def is_dcp_dir(path: str) -> bool:
    """A directory holding a DCP ``.metadata`` file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def read(path: str, plan: Any, trust: bool) -> RawRead:
    """Consolidate the DCP checkpoint in directory ``path``: one whole tensor per entry, nested again.

    With ``plan.is_meta`` tensors come back on meta and no tensor record is read (plain values,
    such as an optimizer's hyper-parameters, still are).
    """
    meta = load_metadata(path, trust)
    source = _Chunks(path, meta)
    try:
        flat, tags, sharded = _consolidate(meta, source, plan, trust)
    except CkptfixError:
        raise
    except (AttributeError, TypeError, ValueError, IndexError, KeyError, RuntimeError) as e:
        raise FormatError(f"{source.meta_path}: malformed DCP metadata ({type(e).__name__}: {e})") from None
    finally:
        source.close()
    files = {info.relative_path for info in meta.storage_data.values()}
    notes = [f"consolidated {len(flat)} DCP entries ({sharded} tensors sharded in chunks) from {len(files)} file(s)"]
    raw = RawRead(obj=_unflatten(flat, meta.planner_data, source.meta_path), format=DCP, tags=tags, notes=notes)
    from .lightning_dir import with_meta

    return with_meta(raw, path, plan, trust)  # Lightning's meta.pt beside the DCP files, if there is one


def record_ranges(path: str) -> dict[str, list[tuple[str, int, int]]]:
    """Every record the DCP directory's ``.metadata`` lists: file → [(entry, offset, length)], each
    inside its file (for the scanner; ``.metadata`` is read with the restricted unpickler)."""
    meta = load_metadata(path, trust=False)
    chunks = _Chunks(path, meta)
    out: dict[str, list[tuple[str, int, int]]] = {}
    try:
        for index, info in meta.storage_data.items():
            file = chunks.files[info.relative_path]
            size = os.path.getsize(file)
            if not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
                    and 0 <= info.length and info.offset + info.length <= size):
                raise FormatError(f"{file}: a record of {getattr(index, 'fqn', '?')!r} lies outside the file")
            offsets = getattr(index, "offset", None)
            what = f"{getattr(index, 'fqn', '?')}" + (f" @ {list(offsets)}" if offsets is not None else "")
            out.setdefault(file, []).append((what, info.offset, info.length))
    finally:
        chunks.close()
    return out


def _consolidate(meta: Any, source: _Chunks, plan: Any, trust: bool) -> tuple[dict[str, Any], dict[int, str], int]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from ..devices import storage_id

    dev = "cpu" if plan.user_fn is not None else plan.target("cpu")
    entries = meta.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    for fqn, md in tensors.items():
        source.check_geometry(fqn, md)
    sharded = [md for md in tensors.values() if not _whole(md)]
    scratch = None if dev == "meta" else _Scratch(sum(_aligned(_nbytes(md)) for md in sharded))
    flat: dict[str, Any] = {}
    tags: dict[int, str] = {}
    for fqn, md in entries.items():
        if fqn in tensors:
            t = source.tensor(fqn, md, scratch)
            if dev not in ("cpu", "meta"):
                t = t.to(dev)
            tags[storage_id(t)] = "cpu"
            flat[fqn] = t
        elif isinstance(md, BytesStorageMetadata):
            flat[fqn] = source.value(fqn, plan, trust, tags)
        else:
            raise FormatError(f"{source.meta_path}: entry {fqn!r} has unknown storage type {type(md).__name__}")
    return flat, tags, len(sharded)


def _whole(md: Any) -> bool:
    """Stored as one chunk covering the whole tensor."""
    if len(md.chunks) != 1:
        return False
    chunk = md.chunks[0]
    return list(chunk.offsets) == [0] * len(md.size) and list(chunk.sizes) == list(md.size)


def _nbytes(md: Any) -> int:
    import torch

    return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


class _Scratch:
    """One file-backed shared mapping (its file unlinked at once) that sharded tensors are
    assembled in: its pages are the page cache's to write back, not anonymous memory."""

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

        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.empty(0, dtype=dtype)
        t.set_(self.storage[self.pos : self.pos + nbytes], 0, shape)
        self.pos += _aligned(nbytes)
        return t


class _Chunks:
    """The records of one DCP directory: located (inside it), checked against the metadata, mapped."""

    def __init__(self, path: str, meta: Any):
        self.path = path
        self.meta_path = os.path.join(path, METADATA)
        self.files: dict[str, str] = {}
        self.maps: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}
        self.records: dict[tuple, Any] = {}
        for index, info in meta.storage_data.items():
            offset = getattr(index, "offset", None)
            rel = getattr(info, "relative_path", None)
            if rel not in self.files:
                self.files[rel] = member_path(path, rel, self.meta_path, what="chunk file")
            self.records[(getattr(index, "fqn", None), None if offset is None else tuple(offset))] = info

    def record(self, fqn: str, chunk: Any = None) -> Any:
        """The storage info of ``fqn`` (a chunk of it for tensors)."""
        info = self.records.get((fqn, None if chunk is None else tuple(chunk.offsets)))
        if info is None:
            where = "" if chunk is None else f" chunk at offset {list(chunk.offsets)}"
            raise FormatError(f"{self.meta_path}: {fqn!r}{where} is in the metadata but no .distcp file holds it")
        if getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"{self.meta_path}: {fqn!r} is stored with transforms {info.transform_descriptors} "
                "(compression?); ckptfix reads plain FileSystemWriter checkpoints only"
            )
        return info

    def check_geometry(self, fqn: str, md: Any) -> None:
        """Every chunk inside the tensor and stored somewhere, together covering it exactly."""
        size = list(md.size)
        for c in md.chunks:
            if len(c.offsets) != len(size) or len(c.sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, size)
            ):
                raise FormatError(
                    f"{self.meta_path}: {fqn!r} chunk {list(c.offsets)}+{list(c.sizes)} falls outside its size {size}"
                )
            self.record(fqn, c)
        if sum(math.prod(c.sizes) for c in md.chunks) != math.prod(size):
            raise FormatError(f"{self.meta_path}: the chunks of {fqn!r} don't cover its {size} elements exactly")

    def tensor(self, fqn: str, md: Any, scratch: _Scratch | None) -> Any:
        """The whole tensor: on meta, mapped from its one chunk, or assembled in ``scratch``."""
        import torch

        size, dtype = list(md.size), md.properties.dtype
        if scratch is None:
            return torch.empty(size, dtype=dtype, device="meta")
        if _whole(md):
            return self._chunk(fqn, md.chunks[0], dtype)
        full = scratch.take(size, dtype, _nbytes(md))
        for c in md.chunks:
            if math.prod(c.sizes):
                full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))].copy_(self._chunk(fqn, c, dtype))
        return full

    def _blob(self, fqn: str, info: Any) -> RangeFile:
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
        return RangeFile(lambda pos, n: os.pread(f.fileno(), n, info.offset + pos), info.length)

    def _chunk(self, fqn: str, chunk: Any, dtype: Any) -> Any:
        """One chunk (a torch.save record) mapped from its file without a copy; loaded if it can't be."""
        import torch

        info = self.record(fqn, chunk)
        file = self.files[info.relative_path]
        blob = self._blob(fqn, info)
        if blob.read(4) != b"PK\x03\x04":
            raise FormatError(f"{file}: {fqn!r} is not a torch.save record (another DCP serialization format?)")
        from .torchfile import torch_load, translate_load_error

        try:
            blob.seek(0)
            shell = torch_load(blob, "meta", trust=False)  # structure only, no data
            if not isinstance(shell, torch.Tensor) or list(shell.shape) != list(chunk.sizes) or shell.dtype != dtype:
                got = f"{type(shell).__name__} {list(getattr(shell, 'shape', []))} {getattr(shell, 'dtype', '')}"
                raise FormatError(f"{file}: {fqn!r} chunk holds {got}, the metadata says {list(chunk.sizes)} {dtype}")
            nbytes = shell.untyped_storage().nbytes()
            # torch.load sets where the storage's bytes start in the record; without it, load for real
            offset = getattr(shell.untyped_storage(), "_checkpoint_offset", None)
            if offset is None or not 0 <= offset <= info.length - nbytes:
                blob.seek(0)
                return torch_load(blob, "cpu", trust=False)
        except CkptfixError:
            raise
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad record
            raise translate_load_error(f"{file}: {fqn!r} chunk", DCP, e) from None
        if nbytes == 0:
            return torch.empty(shell.shape, dtype=dtype)
        if file not in self.maps:
            self.maps[file] = torch.UntypedStorage.from_file(file, shared=False, nbytes=os.path.getsize(file))
        start = info.offset + offset
        t = torch.empty(0, dtype=dtype)
        t.set_(self.maps[file][start : start + nbytes], shell.storage_offset(), shell.shape, shell.stride())
        return t

    def value(self, fqn: str, plan: Any, trust: bool, tags: dict[int, str]) -> Any:
        """A non-tensor entry (torch.save bytes) under the same safe policy as a torch file."""
        from .. import limits
        from .torchfile import torch_load, translate_load_error

        info = self.record(fqn)
        if info.length > limits.current().max_pickle_bytes:
            raise limits.exceeded("max_pickle_bytes", f"entry {fqn!r}'s size", info.length, self.path)
        blob = io.BytesIO(self._blob(fqn, info).read())
        try:
            return torch_load(blob, plan.torch_map_location(tags), trust=trust)
        except CkptfixError:
            raise
        except Exception as e:  # noqa: BLE001 - all become FormatError / UnsafeCheckpointError
            raise translate_load_error(f"{self.path}: entry {fqn!r}", DCP, e) from None

    def close(self) -> None:
        for f in self.handles.values():
            f.close()


def _unflatten(flat: dict[str, Any], planner_data: Any, source: str) -> OrderedDict:
    """Nest DCP's flat keys again with its planner data (fqn → path of dict keys / list indices).

    The planner data also keeps the saved state dict's key order (the metadata lists entries rank by
    rank, so a buffer deduplicated onto rank 1 would come after every parameter).
    """
    root: OrderedDict = OrderedDict()
    paths = planner_data if isinstance(planner_data, dict) else {}
    for fqn in [*(k for k in paths if k in flat), *(k for k in flat if k not in paths)]:
        value = flat[fqn]
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
    """Save ``state_dict`` (or ``{key: state_dict}``) as a DCP directory, atomically, with torch's
    own ``torch.distributed.checkpoint.save`` in this process alone.

    Load it the way FSDP2 training resumes: ``sd = get_model_state_dict(model)``;
    ``dcp.load(sd, checkpoint_id=dst_dir)`` (``{key: sd}`` when written under ``key``);
    ``set_model_state_dict(model, sd)``.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from ..atomic import atomic_dir

    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in _leaves(state_dict)):
        raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a DCP checkpoint")
    notes = []
    if getattr(state_dict, "_metadata", None) is not None:
        notes.append("_metadata (module versions) is not kept: DCP has no place for it")
    with atomic_dir(dst_dir, force, DIR_OUTPUT, notes) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        try:
            dcp.save({key: state_dict} if key else state_dict, storage_writer=writer, no_dist=True)
        except CheckpointException as e:
            raise _unwrap(e) from None
    notes.append(f"written under {key!r}: load with torch.distributed.checkpoint.load({{{key!r}: sd}}, …)" if key
                 else "written with the state dict's keys at the top level")
    return notes


def _unwrap(e: Any) -> BaseException:
    """What failed inside ``dcp.save``, out of the CheckpointException it wraps every rank's error in.

    DCP catches BaseException, so a Ctrl-C arrives as a CheckpointException (itself a BaseException,
    its message the rank's whole traceback), often with the KeyboardInterrupt only in the context
    of the RuntimeError torch's zip writer raised on its way out. The interrupt comes back as
    itself, an OSError (a full disk) as itself for the atomic writer to report, anything else as
    a one-line ConversionError.
    """
    from .. import interrupts

    failures = [exc for exc, _trace in getattr(e, "failures", {}).values()]
    for exc in failures:
        interrupt = interrupts.cause(exc)
        if interrupt is not None:
            return interrupt
    for exc in failures:
        if isinstance(exc, OSError):
            return exc
    first = failures[0] if failures else e
    text = (str(first).strip().splitlines() or [type(first).__name__])[0 if failures else -1]
    return ConversionError(f"torch.distributed.checkpoint.save failed: {type(first).__name__}: {text}")


def _leaves(obj: Any) -> Any:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj
