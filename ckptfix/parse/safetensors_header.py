"""A safetensors file's header, validated without torch: the 8-byte length, the JSON entries (dtype, shape,
byte range; no overlaps), and ckptfix's own metadata (tied-weight aliases, key order, ``_metadata``).

Below both the scanner (:mod:`ckptfix.safety` checks a file with :func:`check_file`) and the reader
(:mod:`ckptfix.formats.safetensors`, which maps the tensors this header describes).
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from typing import Any

from .checkpoint_dirs import no_duplicate_keys
from ..errors import FormatError
from ..core.torch_tables import DTYPE_ITEMSIZE

META_KEY = "ckptfix"

DTYPES = {
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
    for key, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise FormatError(f"{path}: tensor {key!r}: header entry needs dtype, shape and data_offsets")
        if entry["dtype"] not in DTYPES:
            raise FormatError(f"{path}: tensor {key!r}: unknown dtype {entry['dtype']!r}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise FormatError(f"{path}: tensor {key!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1] <= data_len):
            raise FormatError(f"{path}: tensor {key!r}: data_offsets {offs!r} fall outside the data ({data_len} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = _itemsize(DTYPES[entry["dtype"]])
        if numel * itemsize != offs[1] - offs[0]:
            raise FormatError(
                f"{path}: tensor {key!r}: shape {shape} × {entry['dtype']} is {numel * itemsize} bytes "
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
    _aliases(path, ckptfix_meta(path, meta), header)


def _itemsize(dtype_name: str) -> int:
    return DTYPE_ITEMSIZE[dtype_name]  # frozen: validating a header needs no torch


def assemble(path: str, header: dict[str, dict], meta: dict[str, str], tensors: dict[str, Any]) -> OrderedDict:
    """The state dict from the stored ``tensors`` (tensors, or TensorInfo for the torch-free reader):
    ckptfix's tied-weight aliases, key order and ``_metadata`` restored."""
    extra = ckptfix_meta(path, meta)
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


def ckptfix_meta(path: str, meta: dict[str, str]) -> dict:
    """ckptfix's own metadata entry as a dict ({} when absent); FormatError when it is not valid JSON."""
    raw = meta.get(META_KEY)
    if raw is None:
        return {}
    try:
        extra = json.loads(raw)
    except (ValueError, RecursionError):
        raise FormatError(f"{path}: the {META_KEY!r} metadata entry is not valid JSON") from None
    return extra if isinstance(extra, dict) else {}
