"""torch zip files at the byte level: read the structure without tensor data, write by copying records.

``read_structure`` unpickles ``data.pkl`` with ckptfix's restricted unpickler into tensors on ``meta`` and a
``StorageRef`` per storage: where its bytes sit in the file, their size, CRC and saved device.
``write_structure`` pickles a (renamed) object of such
tensors and copies each referenced record into a new archive in the kernel — a prefix fix of a
multi-GB file costs about what ``cp`` does.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any, cast

from ...core import filefill, locations, outputs
from ...core.bytecopy import CrcCheck, CrcWorker, Recorded, RemoteFile, SegmentsCrcWorker, Source, Sources
from ...core.devices import storage_id
from ...core.torch_free import NeedsTorch
from ...errors import CkptfixError, FormatError, UnsafeCheckpointError
from ...parse.format_registry import TORCH_ZIP
from ...parse.zipdir import zip_directory
from ...parse.unpickler import SafePickle
from ...parse.zipdir import data_start
from ...core.tensorinfo import layout_name, sparse_parts
from ...safety import guards, scanner, subclasses, tensor_guards
from ..base import CastRef, PiecedRef, RawRead, StorageRef, source_record, storage_bytes
from .meta_pickle import pickle_meta
from . import digest_records
from .digest_records import tensor_keys
from .torch_io import tensors_in, translate_load_error, unpickling_error
from .zipwriter import ZipWriter


def read_structure(path: str, policy: Any = None, storage_for: Callable[[str, str, int], Any] | None = None) -> RawRead:
    """Tensors on meta plus ``refs`` (storage id → StorageRef); reads only the pickle and zip directory.
    ``policy``: the unpickler's (default :func:`ckptfix.safety.guards.torch_policy`). NeedsTorch where
    torch.load's general path is needed (big-endian data). ``storage_for(record key, saved location, nbytes)``, if
    given, makes each storage instead of meta (:func:`read_onto`)."""
    import torch

    try:
        # (a URL: a file object over its source, only the zip directory and the records asked for fetched;
        # the reader's stubs lack has_record, get_record_offset)
        reader: Any = torch._C.PyTorchFileReader(locations.as_file(path))
        if reader.has_record("byteorder") and reader.get_record("byteorder") != b"little":
            raise NeedsTorch("big-endian data")
        data = reader.get_record("data.pkl")
        directory = zip_directory(path)
        members = {e.name.split("/", 1)[-1]: e for e in directory.entries}
    except (RuntimeError, ValueError, OSError) as e:
        raise FormatError(f"{path}: is a truncated or corrupt torch zip archive ({str(e).splitlines()[0]})") from None

    storages: dict[str, Any] = {}
    kept: dict[str, Any] = {}  # record -> the typed storage torch.load keeps for it (its first holding bytes)
    refs: dict[int, StorageRef] = {}
    tags: dict[int, str] = {}

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {saved_id!r:.80}")
        _, storage_type, key, location, numel = saved_id
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage id {saved_id!r:.80}")
        location = location.decode("ascii") if isinstance(location, bytes) else str(location)
        if key in kept:  # as torch.load: the record's first typed storage, whatever class this id names
            return kept[key]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        if key not in storages or nbytes > 0:  # (an empty storage isn't kept: torch.load reads the record again)
            name = f"data/{key}"
            if not reader.has_record(name):
                raise FormatError(f"{path}: the pickle refers to storage {key!r} but the archive has no {name} record")
            offset, member = reader.get_record_offset(name), members.get(name)
            # (torch < 2.12's reader has no get_record_size: the zip directory's entry says the same)
            size = reader.get_record_size(name) if hasattr(reader, "get_record_size") else getattr(member, "file_size", 0)
            if size < nbytes:
                raise FormatError(f"{path}: record {name} holds {size} bytes, its tensor needs {nbytes}")
            st = torch.UntypedStorage(nbytes, device="meta") if storage_for is None else storage_for(key, location, nbytes)
            storages[key] = st
            sid = storage_id(st)
            record = None if member is None else Recorded(path, name, offset, member.file_size, member.crc,
                                                          directory.crc(member) is not None)
            crc = record.known if record is not None and record.size == nbytes else None  # else computed when written
            refs[sid] = StorageRef(path, offset, nbytes, location, crc, str(key), record)
            tags[sid] = location
        typed = torch.storage.TypedStorage(wrap_storage=storages[key], dtype=dtype, _internal=True)
        if nbytes > 0:
            kept[key] = typed
        return typed

    obj = _unpickle(path, data, policy or guards.torch_policy(placeholders=True), persistent_load)
    _check_sparse(path, obj, refs)  # (on meta: its indices read here; else checked as the load ended)
    return RawRead(obj=obj, format=TORCH_ZIP, tags=tags, refs=refs, notes=subclasses.take_notes())


def _check_sparse(path: str, obj: Any, refs: dict[int, StorageRef]) -> None:
    """The sparse tensors of a structure read (on meta): their indices read from the file (``refs``: where each
    storage's bytes are) and checked against their size as a read of the values checks them (UnsafeCheckpointError:
    an index out of range, which densifying would read or write out of bounds, as torch's weights_only refuses)."""
    import torch

    found = [t for t in tensors_in(obj) if layout_name(t) is not None and t.is_meta]
    if not found:
        return
    with locations.open_buffer(path) as buf:
        for t in found:
            indices = []
            for part in sparse_parts(t)[:-1]:
                ref = refs[storage_id(part)]
                raw = bytearray(buf[ref.offset : ref.offset + ref.nbytes])
                if len(raw) < ref.nbytes:
                    raise FormatError(f"{path}: a sparse tensor's indices run past the end of the file (truncated?)")
                data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                indices.append(torch.empty(0, dtype=part.dtype).set_(data.untyped_storage(), part.storage_offset(),
                                                                     part.shape, part.stride()))
            try:
                tensor_guards.check_sparse(t, indices, path)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(f"{path}: refused: {e}") from None


def read_onto(path: str, plan: Any, staged: Callable[[str], bool] | None = None) -> RawRead | None:
    """A local torch zip read onto the devices ``plan`` (a DevicePlan without a callable) maps its storages to: each
    storage bound for a device where ``staged(device)`` (default: a GPU) read from the file through staging windows
    (:func:`~ckptfix.core.filefill.fill_staged`: pinned, copied asynchronously, never from a mapping: safetensors#729),
    the others slices of the file's mapping, as ``torch.load(mmap=True)`` makes them. ``data.pkl`` is unpickled twice:
    on meta first (every storage's record and device; NeedsValues where a rebuild needs values, NeedsTorch where torch
    must read it), then with the filled storages, which every tensor guard then checks by its values. None where no
    storage is staged (torch's reader serves)."""
    import torch

    staged = staged or (lambda dev: torch.device(dev).type == "cuda")
    first = read_structure(path)
    refs = {ref.key: ref for ref in first.refs.values() if ref.nbytes}  # (a record's storage: its one with bytes)
    devices = {key: plan.target(ref.location) for key, ref in refs.items()}
    if not any(staged(dev) for dev in devices.values()):
        return None
    storages: dict[str, Any] = {}
    fills: list[tuple[Any, int]] = []
    mapping = None
    for key, ref in refs.items():
        if staged(devices[key]):
            storages[key] = torch.UntypedStorage(ref.nbytes, device=devices[key])
            fills.append((torch.empty(0, dtype=torch.uint8, device=devices[key]).set_(storages[key]), ref.offset))
        else:
            if mapping is None:
                locations.hold(path)
                mapping = torch.UntypedStorage.from_file(path, shared=False, nbytes=locations.size_of(path))
            storages[key] = mapping[ref.offset : ref.offset + ref.nbytes]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        filefill.fill_staged([(t, fd, offset, torch.uint8, path) for t, offset in fills], check=False)
    finally:
        os.close(fd)

    def storage_for(key: str, location: str, nbytes: int) -> Any:
        return storages[key] if nbytes else torch.UntypedStorage(0, device=plan.target(location))

    second = read_structure(path, storage_for=storage_for)
    return RawRead(obj=second.obj, format=second.format, tags=second.tags, notes=second.notes)  # (refs: not meta)


def _unpickle(path: str, data: bytes, policy: Any, persistent_load: Callable[[Any], Any]) -> Any:
    """``data.pkl`` of ``path`` unpickled under ``policy``; whatever it refuses or breaks on is named by the full
    static scan where that finds more, else one FormatError."""
    stream = io.BytesIO(data)
    unpickler = SafePickle(policy).Unpickler(stream, encoding="utf-8")
    unpickler.where = f"{path}: data.pkl"
    unpickler.persistent_load = persistent_load
    guards.start_load()
    try:
        obj = policy.finish(unpickler.load())
        if stream.tell() != len(data):  # bytes after STOP: torch ignores them, a second pickle can hide there
            scanner.ensure_safe(path, TORCH_ZIP, placeholders=True)
            raise UnsafeCheckpointError(f"{path}: refused: {len(data) - stream.tell()} bytes follow the pickle in data.pkl")
    except CkptfixError:
        raise
    except pickle.UnpicklingError as e:  # the restricted unpickler refused something
        scanner.ensure_safe(path, TORCH_ZIP, placeholders=True)  # the full static scan names every offending global
        raise unpickling_error(path, e) from None
    except Exception as e:  # every failure of a hostile or broken pickle becomes a FormatError
        scanner.ensure_safe(path, TORCH_ZIP, placeholders=True)
        raise translate_load_error(path, TORCH_ZIP, e) from None
    return obj


def data_members(path: str) -> list[Recorded]:
    """Every ``data/KEY`` record of the torch zip ``path`` with the CRC-32 its zip records (none where the
    zip can't be read: the read then gives its own error), to check while torch reads them."""
    try:
        directory = zip_directory(path)
        entries = [e for e in directory.entries if e.name.split("/", 1)[-1].startswith("data/")]
        with locations.open_buffer(path) as buf:
            return [Recorded(path, e.name.split("/", 1)[-1], data_start(buf, len(buf), e)[0], e.file_size, e.crc,
                             directory.crc(e) is not None) for e in entries if e.method == 0]
    except (OSError, ValueError):
        return []


class _LazyCrcs:
    """CRCs for records whose source doesn't record one (safetensors): computed on another thread
    while the kernel copies, so the copy and the checksum run on two cores; a remote source's from the bytes
    its copy fetches."""

    def __init__(self, order: list[tuple[str, StorageRef]], sources: Sources):
        self.order = [ref for _, ref in order if ref.crc is None and not isinstance(ref, (CastRef, PiecedRef))]
        self.sources = sources
        self.workers: dict[int, Any] = {}

    def get(self, src: Source, offset: int, size: int) -> Callable[[], int]:
        if isinstance(src, RemoteFile):
            return src.crc_of(offset, size)
        if src not in self.workers:
            path = next(p for p, f in self.sources.fds.items() if f == src)
            ranges = [(r.offset, r.nbytes) for r in self.order if r.path == path]
            self.workers[src] = CrcWorker(os.open(path, os.O_RDONLY), ranges)
        worker = self.workers[src]
        return lambda: worker.get(offset, size)

    def start_segments(self, jobs: list[tuple[tuple[int, int, int], ...]]) -> None:
        """Start on the CRCs of members made of several ranges, ``((fd, offset, size), …)`` each."""
        if jobs:
            self.workers[-1] = SegmentsCrcWorker(jobs)

    def get_segments(self, job: tuple[tuple[int, int, int], ...]) -> Callable[[], int]:
        worker = self.workers[-1]
        return lambda: worker.result(job)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def write_structure(
    obj: Any,
    refs: dict[int, StorageRef],
    dst: str,
    location: Callable[[str], str],
    archive: str = "archive",
) -> int:
    """Write ``obj`` (tensors on meta, storages in ``refs``) as a torch zip; returns data bytes copied.

    ``location`` maps each saved device tag to the tag written. Records keep their source keys
    when they come from a torch zip, so only storages still referenced are copied.
    """
    import torch

    data, order, key_of = pickle_meta(obj, refs, location)
    strided = torch.strided  # (a sparse tensor's storages are named by their keys alone)
    names = tensor_keys(obj, lambda x: key_of.get(storage_id(x)) if isinstance(x, torch.Tensor) and x.layout == strided
                        else None)
    return write_archive(data, order, dst, archive, names)


def write_archive(data_pkl: bytes, order: list[tuple[str, StorageRef]], dst: str, archive: str = "archive",
                  names: dict[str, str] | None = None) -> int:
    """A torch zip at ``dst``: ``data_pkl`` and, for each ``(key, ref)`` of ``order``, record ``data/KEY``
    copied from the ref's byte range (in the kernel) or computed (CastRef, PiecedRef), then ckptfix's digest and
    lineage records (:mod:`.digest_records`; ``names``: each tensor's storage key); returns bytes copied."""
    archive = "".join(c if c.isalnum() or c in "_-" else "_" for c in archive) or "archive"
    copied = 0
    with Sources() as sources:
        crcs = _LazyCrcs(order, sources)
        check = CrcCheck((source_record(ref) for _key, ref in order), sources)
        try:
            pieces: dict[int, tuple[tuple[int, int, int], ...]] = {}  # id(PiecedRef) -> its (fd, offset, size)s
            for _key, ref in order:
                segments = ref.segments() if isinstance(ref, PiecedRef) else None
                if segments is not None and not any(locations.is_remote(path) for path, _o, _n in segments):
                    pieces[id(ref)] = tuple((cast(int, sources(path)), offset, n) for path, offset, n in segments)
            crcs.start_segments(list(pieces.values()))
            with outputs.create(dst) as (f, out):
                z = ZipWriter(f, out)
                z.add_bytes(f"{archive}/data.pkl", data_pkl)
                z.add_bytes(f"{archive}/byteorder", b"little")
                for key, ref in order:
                    if isinstance(ref, PiecedRef) and id(ref) in pieces:  # chunk after chunk, in the kernel
                        z.add_segments(f"{archive}/data/{key}", list(pieces[id(ref)]), crcs.get_segments(pieces[id(ref)]))
                        copied += ref.nbytes
                        continue
                    if isinstance(ref, (CastRef, PiecedRef)):  # a dtype cast, chunks to assemble: one tensor at a time
                        z.add_tensor_data(f"{archive}/data/{key}", storage_bytes(ref.materialize()))
                        continue
                    src = sources(ref.path)
                    crc = ref.crc if ref.crc is not None else crcs.get(src, ref.offset, ref.nbytes)
                    z.add_copy(f"{archive}/data/{key}", src, ref.offset, ref.nbytes, crc)
                    copied += ref.nbytes
                check.verify()  # (runs the queued remote copies first)
                z.add_bytes(f"{archive}/version", b"3\n")
                z.add_bytes(f"{archive}/.data/serialization_id", z.serialization_id())
                for name, data in digest_records.records(archive, z.crcs(), names or {}):
                    z.add_bytes(name, data)
                z.close()
        finally:
            crcs.close()
            check.close()
    return copied
