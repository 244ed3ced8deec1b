"""A torch.save zip described without torch: its keys, shapes, dtypes, strides and byte ranges as
:class:`~ckptfix.core.tensorinfo.TensorInfo`, nothing constructed from the file.

Covers the common files exactly: ``data.pkl`` holding (ordered) dicts, lists, tuples, sets, numbers, strings,
dtypes and tensors/Parameters rebuilt by ``_rebuild_tensor_v2``/``_v3`` and ``_rebuild_parameter``. The same
safety check runs first (:func:`ckptfix.safety.ensure_safe`, as before every torch read), and the pickle goes
through ckptfix's restricted unpickler with a policy whose globals are inert tokens (:class:`dtype` is also
what the torch-free writer, :mod:`.planner`, writes back as torch's). Anything else raises
:class:`~ckptfix.core.torch_free.NeedsTorch` and the caller reads the file with torch: big-endian data, tensor
subclasses, sparse/quantized tensors, other globals, and every file the torch path would refuse for a reason
found only while unpickling, so a refusal is always torch's own.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

from ...core import limits, locations
from ...core.bytecopy import Recorded
from ...core.tensorinfo import StorageInfo, TensorInfo
from ...core.torch_free import NeedsTorch
from ...core.torch_tables import DIFFERENTIABLE, DTYPE_ITEMSIZE, STORAGE_DTYPES
from ...parse.format_registry import TORCH_ZIP
from ...parse.zipdir import zip_directory
from ...parse.inert import InertGlobal, InertObject
from ...parse.pickle_ops import Refused
from ...parse.unpickler import Policy, SafePickle, build_attributes
from ...parse.zipdir import data_start, fold, read_directory
from ...safety.file_scanners import Collector, scan_zip
from ...safety.allowlist import (BUILTIN_COMPLEX, BUILTIN_SET, INERT, ORDERED_DICT, REBUILD_PARAMETER,
                                 REBUILD_TENSOR_V2, REBUILD_TENSOR_V3, UNSAFE, classify)
from ...safety.guards import plain
from ...safety.scanner import ensure_safe
from ..base import RawRead


def read_torch_zip(path: str) -> RawRead:
    """``data.pkl`` unpickled into TensorInfo; the zip read with ckptfix's reader (torch's view of it)."""
    ensure_safe(path, TORCH_ZIP, unpickled_by_caller="data.pkl", placeholders=True)  # what the torch path runs first
    try:
        directory = zip_directory(path)
    except Exception as e:  # torch's reader gives the refusal
        raise NeedsTorch(f"zip directory: {e}") from None
    with locations.open_buffer(path) as buf:  # (a header-only read: the records' local headers and data.pkl)
        obj, tags = _describe_zip(_Archive(path, directory, buf), f"{path}: data.pkl", placeholders=True)
    if isinstance(obj, dict) and isinstance(obj.get("module"), dict) and {"ds_config", "ds_version"} & set(obj):
        raise NeedsTorch("a DeepSpeed model_states file")  # (what layout.deepspeed_info recognises)
    return RawRead(obj=obj, format=TORCH_ZIP, tags=tags)


def read_torch_record(path: str, data: bytes, base: int, where: str) -> tuple[Any, dict[int, str]]:
    """A ``torch.save`` zip held in bytes ``base..base+len(data)`` of the file ``path`` (a DCP bytes entry),
    as ``torch.load(io.BytesIO(data))`` reads it under the restricted policy: its value and the saved
    device of each storage, whose StorageInfo names ``path`` and the absolute offset in it.

    torch reads the range as an archive of its own, so the same bytes are checked as one: the static
    scan ``ckptfix scan`` runs on every DCP record (zip structure, readers agreeing, other pickles)
    must find nothing, and torch.load's own reads (TorchScript refusal, its records) must succeed."""
    if data[:4] != b"PK\x03\x04":
        raise NeedsTorch("not a torch zip (torch.load would read it as a legacy file)")
    report = Collector(where, TORCH_ZIP)
    try:
        scan_zip(report, data, len(data), False, False, unpickled_by_caller="data.pkl")
        findings = report.finish().findings
        directory = read_directory(data, len(data))
    except Exception as e:  # damage: torch's read gives the refusal
        raise NeedsTorch(f"{where}: {e}") from None
    if findings:
        raise NeedsTorch(f"{where}: {findings[0].message}")
    # a DCP record's globals outside the allow-list: inert placeholders, as the torch path reads them (refused inside
    # the selected state dict, kept beside it: a TrainState's BytesIO)
    return _describe_zip(_Archive(path, directory, data, base, loaded=True), f"{where}: data.pkl", placeholders=True)


def _describe_zip(archive: _Archive, where: str, placeholders: bool) -> tuple[Any, dict[int, str]]:
    """The records torch reads before unpickling, then ``data.pkl``: (value, storage id → saved device)."""
    order = archive.read("byteorder", must_exist=False)
    if order is not None and order != b"little":
        raise NeedsTorch("big-endian data")
    version = archive.read(".data/version", must_exist=False)
    version = archive.read("version", must_exist=False) if version is None else version
    if version is None or version.strip() not in (b"1", b"2", b"3"):
        raise NeedsTorch("a file format version torch.save doesn't write")
    alignment = archive.read(".storage_alignment", must_exist=False)
    if alignment is not None and not alignment.strip().isdigit():
        raise NeedsTorch("a malformed .storage_alignment record")
    if archive.entry("constants.pkl", must_exist=False) is not None:
        raise NeedsTorch("a TorchScript archive")
    data = archive.read("data.pkl")
    if data is None:  # (read raises for a missing record it must find)
        raise NeedsTorch("no data.pkl")
    return _unpickle(where, data, archive, placeholders)


class _Archive:
    """Records looked up as torch's reader does (under the first entry's folder, ASCII case folded).

    ``buf`` holds the archive, which starts at byte ``base`` of the file ``path`` (0 for a file, the
    record's offset for a torch.save zip inside a DCP file). ``loaded``: read as ``torch.load`` of a stream
    reads it (a DCP bytes entry), which makes a new storage for every reference to a record and needs the
    record to hold exactly its bytes; else as ``torchzip.read_structure`` maps a file (one storage per
    record, at least its bytes)."""

    def __init__(self, path: str, directory: Any, buf: Any, base: int = 0, loaded: bool = False):
        self.path, self.directory, self.buf, self.size, self.base = path, directory, buf, len(buf), base
        self.loaded = loaded
        self.prefix = directory.root + "/"
        self.index: dict[bytes, list[Any]] = {}  # directory.lookup's answers, found in one pass, not one per record
        for e in directory.entries:
            self.index.setdefault(fold(e.raw_name), []).append(e)

    def entry(self, name: str, must_exist: bool = True) -> Any:
        found = self.index.get(fold((self.prefix + name).encode("utf-8")), [])
        if len(found) != 1:
            if not found and not must_exist:
                return None
            raise NeedsTorch(f"record {name}: {len(found)} entries")
        return found[0]

    def start(self, name: str, entry: Any) -> int:
        """Where the record's bytes start in ``buf``, checked to be stored plainly inside it."""
        try:
            start = data_start(self.buf, self.size, entry)[0]
        except Exception as e:
            raise NeedsTorch(str(e)) from None
        if entry.method != 0 or entry.flags & 1 or entry.compress_size != entry.file_size \
                or start + entry.file_size > self.size:
            raise NeedsTorch(f"record {name} is not stored plainly")
        return start

    def read(self, name: str, must_exist: bool = True) -> bytes | None:
        e = self.entry(name, must_exist)
        if e is None:
            return None
        start = self.start(name, e)
        if e.file_size > limits.current().max_pickle_bytes:
            raise NeedsTorch(f"record {name} is over max_pickle_bytes")
        return bytes(self.buf[start : start + e.file_size])

    def storage(self, key: str, nbytes: int, location: str) -> StorageInfo:
        """Record ``data/KEY`` as the storage of ``nbytes`` it holds, its offset in the file ``path``."""
        entry = self.entry(f"data/{key}")
        if entry.file_size < nbytes or self.loaded and entry.file_size != nbytes:
            raise NeedsTorch(f"record data/{key} holds {entry.file_size} bytes, its tensor {nbytes}")
        offset = self.base + self.start(f"data/{key}", entry)
        record = Recorded(self.path, f"data/{key}", offset, entry.file_size, entry.crc,
                          self.directory.crc(entry) is not None)
        return StorageInfo(self.path, key, offset, nbytes, location, record)


class _Token:
    """A global as the describing unpickler sees it: named, inert, never called with file data."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name

    @property
    def pickled_as(self) -> str:
        """The global a pickle names for it (what ``torch.load(weights_only=True)`` must allow)."""
        return self.name


class dtype(_Token):  # named as torch's, so a dtype value renders as torch's does
    """``torch.float32`` etc.: the dtype's name."""

    @property
    def pickled_as(self) -> str:
        return f"torch.{self.name}"


class _StorageType(_Token):
    def __init__(self, name: str, dtype_name: str):
        super().__init__(name)
        self.dtype = dtype_name


class _Typed:
    """A storage as ``persistent_load`` hands it over: the bytes and the dtype the pickle names."""

    def __init__(self, storage: StorageInfo, dtype_name: str):
        self.storage, self.dtype = storage, dtype_name


def _policy(placeholders: bool) -> Any:
    table: dict[str, Any] = {ORDERED_DICT: OrderedDict, BUILTIN_SET: set, BUILTIN_COMPLEX: complex}
    for name in DTYPE_ITEMSIZE:
        table[f"torch.{name}"] = dtype(name)
    for cls, dtype_name in STORAGE_DTYPES.items():
        if dtype_name in DTYPE_ITEMSIZE:  # quantized storages: torch's path
            table[f"torch.{cls}"] = table[f"torch.cuda.{cls}"] = _StorageType(cls, dtype_name)
    table["torch.storage.UntypedStorage"] = _StorageType("UntypedStorage", "uint8")
    table[REBUILD_TENSOR_V2] = _rebuild_v2 = _Token("_rebuild_tensor_v2")
    table[REBUILD_TENSOR_V3] = _rebuild_v3 = _Token("_rebuild_tensor_v3")
    table[REBUILD_PARAMETER] = _rebuild_param = _Token("_rebuild_parameter")
    calls = {id(OrderedDict): plain, id(set): plain, id(complex): plain,
             id(_rebuild_v2): _guard_v2, id(_rebuild_v3): _guard_v3, id(_rebuild_param): _guard_parameter}
    return Policy(table, calls, set(), {OrderedDict: build_attributes}, append=(list,), setitem=(dict, OrderedDict),
                  inert=_placeholder if placeholders else None)


def _placeholder(name: str) -> InertGlobal:
    """A global outside the allow-list, or read as inert data: a placeholder, as on the torch path; an allowed
    one this policy lacks (torch's path builds it): refused, so the caller reads the file with torch."""
    module, _, qualname = name.rpartition(".")
    if classify(module, qualname) not in (UNSAFE, INERT):
        raise Refused(f"{name}: read on torch's path")
    return InertGlobal(name)


def _view(u: Any, args: tuple, dtype_name: str) -> TensorInfo:
    """``_rebuild_tensor``'s view, checked as :func:`ckptfix.safety.guards.check_view` checks it."""
    storage, offset, size, stride = args[:4]
    if not isinstance(storage, _Typed) or dtype_name not in DTYPE_ITEMSIZE:
        raise NeedsTorch("a tensor of an unsupported kind")
    if type(offset) is not int or type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride) \
            or len(size) > 64 or not all(type(n) is int for n in (*size, *stride)):
        raise NeedsTorch("malformed view")
    if offset < 0 or any(n < 0 for n in (*size, *stride)):
        raise NeedsTorch("negative view")
    itemsize = DTYPE_ITEMSIZE[dtype_name]
    reach = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if 0 not in size and (reach + 1) * itemsize > storage.storage.nbytes:
        raise NeedsTorch("view out of bounds")
    requires_grad, hooks = args[4], args[5]
    if requires_grad is not False or not (type(hooks) in (dict, OrderedDict) and not hooks):
        raise NeedsTorch("requires_grad or hooks on a plain tensor")
    u.charge(len(size) * 2, "_rebuild_tensor")
    return TensorInfo(dtype_name, size, stride, offset, storage.storage)


def _guard_v2(u: Any, f: Any, args: tuple, kwargs: dict) -> TensorInfo:
    # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks, metadata=None)
    if kwargs or len(args) not in (6, 7) or len(args) == 7 and args[6] is not None and args[6] != {}:
        raise NeedsTorch("_rebuild_tensor_v2 with metadata")
    storage = args[0]
    return _view(u, args, storage.dtype if isinstance(storage, _Typed) else "")


def _guard_v3(u: Any, f: Any, args: tuple, kwargs: dict) -> TensorInfo:
    # _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None)
    if kwargs or len(args) not in (7, 8) or len(args) == 8 and args[7] is not None and args[7] != {} \
            or not isinstance(args[6], dtype):
        raise NeedsTorch("_rebuild_tensor_v3 with unexpected arguments")
    return _view(u, args, args[6].name)


def _guard_parameter(u: Any, f: Any, args: tuple, kwargs: dict) -> TensorInfo:
    # _rebuild_parameter(data, requires_grad, backward_hooks)
    if kwargs or len(args) != 3 or not isinstance(args[0], TensorInfo) or type(args[1]) is not bool:
        raise NeedsTorch("_rebuild_parameter with unexpected arguments")
    data, requires_grad, hooks = args
    if not (type(hooks) in (dict, OrderedDict) and not hooks) or requires_grad and data.dtype not in DIFFERENTIABLE:
        raise NeedsTorch("a Parameter torch would refuse")
    return TensorInfo(data.dtype, data.shape, data.stride, data.storage_offset, data.storage, requires_grad, True)


def _unpickle(where: str, data: bytes, archive: _Archive, placeholders: bool) -> tuple[Any, dict[int, str]]:
    storages: dict[str, StorageInfo] = {}
    tags: dict[int, str] = {}
    kept: dict[str, tuple[str, int]] = {}  # record -> (dtype, nbytes) of the typed storage torch.load keeps for it

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5 or saved_id[0] not in ("storage", b"storage"):
            raise NeedsTorch("unexpected persistent id")
        _, storage_type, key, location, numel = saved_id
        if type(key) is not str or type(numel) is not int or numel < 0 or not isinstance(storage_type, _StorageType):
            raise NeedsTorch("malformed storage id")
        location = location.decode("ascii") if isinstance(location, bytes) else str(location)
        # torch.load keeps the first typed storage that holds bytes and hands it to every later reference to
        # the record, whose own storage class and size it ignores (_rebuild_tensor_v2 takes that dtype)
        dtype_name, nbytes = kept.get(key) or (storage_type.dtype, numel * DTYPE_ITEMSIZE[storage_type.dtype])
        if key not in storages or archive.loaded or key not in kept and nbytes > 0:  # a new storage
            storages[key] = archive.storage(key, nbytes, location)
            tags[id(storages[key])] = location
        if nbytes > 0:
            kept.setdefault(key, (dtype_name, nbytes))
        return _Typed(storages[key], dtype_name)

    stream = io.BytesIO(data)
    unpickler = SafePickle(_policy(placeholders)).Unpickler(stream, encoding="utf-8")
    unpickler.where = where
    unpickler.persistent_load = persistent_load
    try:
        obj = unpickler.load()
    except Exception as e:  # the torch path refuses it its own way
        raise NeedsTorch(f"{where}: {type(e).__name__}: {e}") from None
    if stream.tell() != len(data):
        raise NeedsTorch("bytes follow the pickle")
    _check_plain(obj)
    return obj, tags


_ATOMS = (str, int, float, bool, complex, type(None), TensorInfo, dtype)


def _check_plain(obj: Any) -> None:
    """Only values that describe as torch's would: no bare storages or tokens."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _ATOMS) or id(x) in seen:
            continue
        seen.add(id(x))
        if type(x) in (dict, OrderedDict):
            stack.extend(x.keys())
            stack.extend(x.values())
            extra = vars(x) if type(x) is OrderedDict else {}
            if set(extra) - {"_metadata"}:
                raise NeedsTorch("attributes on a dict")
            stack.extend(extra.values())
        elif type(x) in (list, tuple, set):
            stack.extend(x)
        elif type(x) is InertObject:  # a placeholder: what its arguments and state hold must be plain too
            stack.extend((*x.args, x.state, *x.listitems, *(v for kv in x.dictitems for v in kv)))
        elif type(x) is not InertGlobal:
            raise NeedsTorch(f"a {type(x).__name__} value")
