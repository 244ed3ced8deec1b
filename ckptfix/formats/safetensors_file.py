"""safetensors: header validated by ckptfix, tensors mapped from the file without copying.

Written files carry ``{"format": "pt"}`` and, under the ``ckptfix`` metadata key, what
safetensors itself can't hold: aliases (tied weights written once), the key order, and the
state dict's ``_metadata``. ckptfix's reader restores all three; other readers ignore them.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from typing import Any

from ..errors import ConversionError, FormatError
from ..render import dtype_name
from . import SAFETENSORS, CastRef, PiecedRef, RawRead, check_expansion, mapped, no_duplicate_keys

META_KEY = "ckptfix"

_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}


def read_header(path: str) -> tuple[int, dict[str, dict], dict[str, str]]:
    """Validate and return ``(data_start, entries, metadata)``; every problem is a FormatError."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise FormatError(f"{path}: truncated safetensors file ({size} bytes)")
        n = struct.unpack("<Q", raw_len)[0]
        if n + 8 > size:
            raise FormatError(f"{path}: safetensors header length ({n}) runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys(f"{path}: safetensors header"))
    except FormatError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_len = size - 8 - n
    spans = []
    for key, e in header.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise FormatError(f"{path}: tensor {key!r}: header entry needs dtype, shape and data_offsets")
        if e["dtype"] not in _DTYPES:
            raise FormatError(f"{path}: tensor {key!r}: unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise FormatError(f"{path}: tensor {key!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise FormatError(f"{path}: tensor {key!r}: data_offsets {offs!r} fall outside the data ({data_len} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = _itemsize(_DTYPES[e["dtype"]])
        if numel * itemsize != offs[1] - offs[0]:
            raise FormatError(
                f"{path}: tensor {key!r}: shape {shape} × {e['dtype']} is {numel * itemsize} bytes "
                f"but its byte range holds {offs[1] - offs[0]}"
            )
        if offs[1] > offs[0]:
            spans.append((offs[0], offs[1], key))
    spans.sort()
    for (_b0, e0, k0), (b1, _e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise FormatError(f"{path}: tensors {k0!r} and {k1!r} overlap in the file")
    return 8 + n, header, meta


def check_file(path: str) -> None:
    """Validate the header and ckptfix's own metadata (aliases) without reading tensor data; every
    problem is a FormatError. For ``scan``: a file ckptfix would read differently from other readers
    is not passed as clean."""
    _start, header, meta = read_header(path)
    _aliases(path, _ckptfix_meta(path, meta), header)


def _itemsize(dtype_name: str) -> int:
    from ..torch_tables import DTYPE_ITEMSIZE  # frozen: validating a header needs no torch

    return DTYPE_ITEMSIZE[dtype_name]


def read(path: str, plan: Any) -> RawRead:
    import torch

    start, header, meta = read_header(path)
    _ckptfix_meta(path, meta)  # a malformed entry is refused before anything is mapped
    dev = plan.target("cpu") if plan.user_fn is None else "cpu"
    size = os.path.getsize(path)
    whole = None
    if dev != "meta" and size > start:
        whole = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    from ..devices import storage_id
    from . import StorageRef

    tensors: dict[str, Any] = {}
    refs: dict[int, StorageRef] = {}
    for key, e in header.items():
        dtype = getattr(torch, _DTYPES[e["dtype"]])
        b, end = e["data_offsets"]
        if dev == "meta":
            t = torch.empty(e["shape"], dtype=dtype, device="meta")
            refs[storage_id(t)] = StorageRef(path, start + b, end - b, "cpu")
        else:
            t = torch.empty(0, dtype=dtype)
            if end > b:
                t.set_(whole[start + b : start + end], 0, e["shape"])
            else:
                t = torch.empty(e["shape"], dtype=dtype)
            if dev != "cpu":
                t = t.to(dev)
        tensors[key] = t
    sd = assemble(path, header, meta, tensors)
    tags = {storage_id(t): "cpu" for t in sd.values()}
    return RawRead(obj=sd, format=SAFETENSORS, tags=tags, refs=refs)


def assemble(path: str, header: dict[str, dict], meta: dict[str, str], tensors: dict[str, Any]) -> OrderedDict:
    """The state dict from the stored ``tensors`` (tensors, or TensorInfo for the torch-free reader):
    ckptfix's tied-weight aliases, key order and ``_metadata`` restored."""
    extra = _ckptfix_meta(path, meta)
    aliases = _aliases(path, extra, header)
    order = [k for k in extra.get("order", []) if isinstance(k, str) and (k in tensors or k in aliases)]
    order = list(dict.fromkeys(order))
    order += [k for k in header if k not in order]
    order += [k for k in aliases if k not in order]
    sd: OrderedDict = OrderedDict()
    for k in order:
        sd[k] = tensors[aliases.get(k, k)]
    if isinstance(extra.get("module_metadata"), dict):
        sd._metadata = OrderedDict(extra["module_metadata"])  # type: ignore[attr-defined]
    return sd


def _aliases(path: str, extra: dict, header: dict[str, dict]) -> dict[str, str]:
    """ckptfix's tied-weight aliases (alias → stored tensor), each checked: an alias never replaces a
    tensor the file really stores (other readers would see that one), it names a stored tensor, and
    the shape and dtype it records (ckptfix ≥ 0.2 writes them) are that tensor's."""
    raw = extra.get("aliases", {})
    if not isinstance(raw, dict):
        raise FormatError(f"{path}: the {META_KEY!r} metadata's aliases are not a mapping")
    out: dict[str, str] = {}
    for alias, target in raw.items():
        spec = target if isinstance(target, dict) else {"of": target}
        canonical = spec.get("of")
        if alias in header:
            raise FormatError(f"{path}: the {META_KEY!r} metadata makes {alias!r} an alias of {canonical!r}, but the "
                              f"file stores {alias!r} itself: refused (readers would disagree on its value)")
        if not isinstance(canonical, str) or canonical not in header:
            raise FormatError(f"{path}: alias {alias!r} points to missing tensor {canonical!r}")
        entry = header[canonical]
        for field, want in (("dtype", entry["dtype"]), ("shape", entry["shape"])):
            if field in spec and spec[field] != want:
                raise FormatError(f"{path}: alias {alias!r} records {field} {spec[field]!r}, but {canonical!r} "
                                  f"is {want!r}: refused")
        out[alias] = canonical
    return out


def _ckptfix_meta(path: str, meta: dict[str, str]) -> dict:
    raw = meta.get(META_KEY)
    if raw is None:
        return {}
    try:
        extra = json.loads(raw)
    except (ValueError, RecursionError):
        raise FormatError(f"{path}: the {META_KEY!r} metadata entry is not valid JSON") from None
    return extra if isinstance(extra, dict) else {}


_ST_NAMES = {v: k for k, v in _DTYPES.items()}


def write(state_dict: Any, path: str, refs: dict | None = None) -> list[str]:
    """Write a flat state dict; returns notes for the report.

    Tied tensors (same storage, same view) are written once and recorded as aliases; other views
    are written as their own contiguous bytes. Tensors whose storage is in ``refs`` (a structure
    read) are copied from the source file's byte range; others are written from memory.
    """
    import torch

    from ..devices import storage_id

    refs = refs or {}
    notes: list[str] = []
    canonical: dict[tuple, str] = {}
    aliases: dict[str, dict] = {}
    tensors: list[tuple[str, Any]] = []
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ConversionError(
                f"{key!r} is a {type(t).__name__}, not a tensor: safetensors holds tensors only; "
                "write .pth instead (--format pth)"
            )
        if t.layout != torch.strided or t.is_quantized:
            raise ConversionError(f"{key!r}: {t.layout} tensors can't be stored in safetensors; write .pth instead")
        name = dtype_name(t.dtype)
        if name not in _ST_NAMES:
            raise ConversionError(f"{key!r}: dtype {name} has no safetensors equivalent; write .pth instead")
        sid = storage_id(t)
        if t.device.type == "meta" and sid not in refs:
            raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a file")
        view = (sid, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in canonical and t.numel() > 0:
            aliases[key] = {"of": canonical[view], "dtype": _ST_NAMES[name], "shape": list(t.shape)}
            continue
        canonical[view] = key
        if not t.is_contiguous():
            notes.append(f"{key!r} was not contiguous; written contiguous")
        tensors.append((key, t))

    check_expansion(tensors, refs, "")
    # Larger element sizes first keeps every tensor aligned to its element size (as safetensors does).
    tensors.sort(key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_NAMES[dtype_name(t.dtype)], "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    extra: dict[str, Any] = {"version": 1, "order": list(state_dict.keys())}
    if aliases:
        extra["aliases"] = aliases
        notes.append(f"{len(aliases)} tied tensor(s) written once: " + ", ".join(f"{a} -> {c['of']}" for a, c in aliases.items()))
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        try:
            extra["module_metadata"] = json.loads(json.dumps(meta))
            notes.append("_metadata kept in the ckptfix metadata entry (restored by ckptfix; other loaders ignore it)")
        except (TypeError, ValueError):
            notes.append("_metadata dropped: it holds values JSON can't represent")
    header["__metadata__"] = {"format": "pt", META_KEY: json.dumps(extra, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    _write_data(path, raw, tensors, refs)
    return notes


def _write_data(path: str, header: bytes, tensors: list[tuple[str, Any]], refs: dict) -> None:
    import torch

    from .. import rawcopy
    from ..devices import storage_id

    fds: dict[str, int] = {}
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            f.flush()
            pos = 8 + len(header)
            for _key, t in tensors:
                n = t.numel() * t.element_size()
                ref = refs.get(storage_id(t))
                segments = ref.segments() if isinstance(ref, PiecedRef) else None
                if segments is not None and t.is_contiguous() and t.storage_offset() == 0 and n == ref.nbytes:
                    for src, _offset, _n in segments:  # a tensor in chunks: copied chunk after chunk
                        if src not in fds:
                            fds[src] = os.open(src, os.O_RDONLY)
                    rawcopy.copy_segments([(fds[src], offset, k) for src, offset, k in segments], f.fileno(), pos)
                    pos += n
                    continue
                if isinstance(ref, CastRef):  # a dtype cast: computed now, one tensor in memory
                    t, ref = ref.materialize(), None
                elif isinstance(ref, PiecedRef):  # chunks to assemble (file-backed scratch), then t's view of them
                    t, ref = torch.empty(0, dtype=t.dtype).set_(
                        ref.materialize().untyped_storage(), t.storage_offset(), t.shape, t.stride()), None
                if ref is not None and t.is_contiguous():
                    if ref.path not in fds:
                        fds[ref.path] = os.open(ref.path, os.O_RDONLY)
                    rawcopy.copy_range(fds[ref.path], f.fileno(), ref.offset + t.storage_offset() * t.element_size(), pos, n)
                else:
                    if ref is not None:  # a non-contiguous view of a storage still in the source file
                        real = torch.empty(0, dtype=t.dtype)
                        real.set_(mapped(ref.path)[ref.offset : ref.offset + ref.nbytes], t.storage_offset(), t.shape, t.stride())
                        t = real
                    flat = t.detach().cpu().reshape(-1)
                    if flat.stride(0) != 1:  # contiguous() keeps a 1-element view's stride; view() needs 1
                        flat = flat.clone(memory_format=torch.contiguous_format)
                    data = flat.view(torch.uint8).numpy()
                    rawcopy.write_all(f.fileno(), memoryview(data), pos)
                pos += n
            f.seek(pos)
            f.truncate(pos)
    finally:
        for fd in fds.values():
            os.close(fd)
