"""A safetensors file's header, validated without torch as safetensors' own reader validates it (its Rust
``SafeTensors::read_metadata``: serde_json into ``usize`` fields, u64 arithmetic), and ckptfix's own metadata
(tied-weight aliases, key order, ``_metadata``).

A file is accepted when ``safetensors.safe_open(path, "pt")`` reads every tensor of it, and refused otherwise,
with one exception: a key given twice in the JSON (safetensors silently keeps one of the two).
``tests/parse/test_safetensors_header.py`` checks that against safetensors itself.

Below both the scanner (:mod:`ckptfix.safety` checks a file with :func:`check_file`) and the reader
(:mod:`ckptfix.formats.safetensors`, which maps the tensors this header describes).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import OrderedDict
from typing import Any

from ..core import locations
from .checkpoint_dirs import no_duplicate_keys
from ..errors import FormatError
from ..core.torch_tables import DTYPE_ITEMSIZE

META_KEY = "ckptfix"

#: safetensors' dtypes (its Rust ``Dtype``) → torch's. F4 holds two 4-bit values in each element of
#: torch's float4_e2m1fn_x2: the header's last dimension counts values, torch's counts bytes (``PACKED``).
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "C64": "complex64",
}
PACKED = {"F4": 2}
#: safetensors' dtypes torch has no dtype for, with their bits (a file holding one is refused, by name)
NO_TORCH_DTYPE = {"F6_E2M3": 6, "F6_E3M2": 6}

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
_MAX_DEPTH = 127  # serde_json's recursion limit: arrays and objects nested 128 deep are refused
_USIZE_END = 2**64  # safetensors' sizes and offsets are 64-bit usize; a product past it is refused
_INT64_END = 2**63  # torch's sizes and strides are int64
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = frozenset(_FIELDS)


def bits(st_dtype: str) -> int:
    """Bits per value of a safetensors dtype (4 for F4)."""
    if st_dtype in NO_TORCH_DTYPE:
        return NO_TORCH_DTYPE[st_dtype]
    return 8 * DTYPE_ITEMSIZE[DTYPES[st_dtype]] // PACKED.get(st_dtype, 1)


def torch_shape(entry: dict) -> tuple[int, ...]:
    """The torch shape of a header entry: its shape, with F4's last dimension in bytes (pairs of values)."""
    shape = list(entry["shape"])
    if shape:
        shape[-1] //= PACKED.get(entry["dtype"], 1)
    return tuple(shape)


def header_shape(st_dtype: str, shape: Any) -> list[int]:
    """The header's shape for a torch tensor of ``shape`` (F4: its last dimension counts values)."""
    out = list(shape)
    if out:
        out[-1] *= PACKED.get(st_dtype, 1)
    return out


def read_header(path: str) -> tuple[int, dict[str, dict], dict[str, str]]:
    """Validate and return ``(data_start, entries, metadata)``; every problem is a FormatError.

    Each entry is ``{"dtype", "shape", "data_offsets"}`` (the header's: F4 shapes count values, see
    :func:`torch_shape`), in the header's order.
    """
    with locations.opened(path) as source:  # (a remote file: two range reads, the header only)
        size = source.size
        raw_len = source.read(0, 8)
        if len(raw_len) < 8:
            raise FormatError(f"{path}: truncated safetensors file ({size} bytes)")
        n = struct.unpack("<Q", raw_len)[0]
        if n > MAX_HEADER_BYTES:
            raise FormatError(f"{path}: safetensors header length ({n} bytes) is over safetensors' limit "
                              f"({MAX_HEADER_BYTES} bytes): not a safetensors file, or a damaged one")
        if n + 8 > size:
            raise FormatError(f"{path}: safetensors header length ({n}) runs past the end of the file ({size} bytes)")
        raw = source.read(8, n)
    header = _parse_json(path, raw)
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path}: safetensors __metadata__ must map strings to strings")
    entries = {key: _entry(path, key, value) for key, value in header.items()}
    _check_layout(path, entries, size - 8 - n)
    return 8 + n, entries, meta


def _parse_json(path: str, raw: bytes) -> dict:
    """The header's JSON object, read as serde_json reads it: no NaN or Infinity, no number out of f64's
    range, ``-0`` and integers past 64 bits as floats (never a size), no lone surrogate, 127 levels at most."""
    bare = _JSON_STRING.sub(b"", raw)  # (the text between strings: numbers, constants, brackets)
    try:
        header = _parse_plain(raw, bare)
        if header is None:  # something only the strict hooks decide: read (or refuse) it that way
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys(f"{path}: safetensors header"),
                                parse_constant=_no_constant, parse_int=_serde_int, parse_float=_serde_float)
    except FormatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # only a \\u escape can make one (UTF-8 holds no surrogates)
        for key, value in header.items():
            if not _is_unicode(json.dumps([key, value], ensure_ascii=False)):
                what = "__metadata__" if key == "__metadata__" else f"tensor {key!r}"
                raise FormatError(f"{path}: {what}: the header holds a lone surrogate (a \\ud800-\\udfff escape "
                                  "that is no pair), which is not Unicode: refused, as safetensors refuses it")
    if _depth(bare) > _MAX_DEPTH:
        raise FormatError(f"{path}: the safetensors header nests arrays or objects more than {_MAX_DEPTH} deep: "
                          "refused, as safetensors refuses it")
    return header


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


#: what in a header's text between strings the plain parse might read otherwise than serde_json: a fraction or an
#: exponent, a constant (true, false, NaN, Infinity: only null is read alike), ``-0``, an integer of 19+ digits
_STRICT_ONLY = re.compile(rb"[.eEIN]|-0|\d{19}")


def _parse_plain(raw: bytes, bare: bytes) -> dict | None:
    """The header parsed by ``json`` without per-value hooks (5× faster on a header of 20,000 tensors), where that
    reads it exactly as the strict parse would: no number or constant the hooks treat apart (``bare``: ``raw``
    without its strings) and no key listed twice (the pairs the text holds, one per colon outside strings, are all
    in the objects, which are at most two levels deep); None where it can't tell."""
    if _STRICT_ONLY.search(bare):
        return None
    try:
        header = json.loads(raw.decode("utf-8"))  # (as the strict parse decodes it: json.loads(bytes) also takes UTF-16)
    except (ValueError, RecursionError):  # (UnicodeDecodeError too: the strict parse says what is wrong)
        return None
    if type(header) is not dict:
        return None
    pairs = len(header)
    for value in header.values():
        if type(value) is dict:
            pairs += len(value)
            for inner in value.values():
                if type(inner) is dict:
                    pairs += len(inner)
    return header if pairs == bare.count(b":") else None


def _depth(bare: bytes) -> int:
    """How deep a valid JSON text nests arrays and objects (``bare``: the text without its strings), at most
    ``_MAX_DEPTH + 1``: each pass removes the innermost pairs, in C (a header of 100,000 tensors takes milliseconds)."""
    brackets = bare.translate(_BRACKETS, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= _MAX_DEPTH:
        brackets = brackets.replace(b"[]", b"")
        depth += 1
    return depth


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _serde_int(text: str) -> Any:
    if text == "-0":
        return -0.0  # serde_json reads -0 as a float
    value = int(text)
    if -(2**63) <= value < _USIZE_END:
        return value
    return _serde_float(text)  # as serde_json: a float, never a size


def _serde_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _are_sizes(values: Any) -> bool:
    """A list of usize values (ints, not bools, from 0 to 2**64-1)."""
    if type(values) is not list:
        return False
    for v in values:  # (a loop: a header's lists are short, and this runs twice per tensor)
        if type(v) is not int or not 0 <= v < _USIZE_END:
            return False
    return True


def _entry(path: str, key: str, value: Any) -> dict:
    """One tensor's entry, as safetensors' serde reads it (a struct from a JSON object, or from the list of
    its three fields; the dtype as a name, or a one-entry ``{"F32": null}``)."""
    if type(value) is dict and len(value) == 3:  # the common form, checked in one pass
        dtype, shape, offs = value.get("dtype"), value.get("shape"), value.get("data_offsets", ())
        if type(dtype) is str and dtype in DTYPES and _are_sizes(shape) and _are_sizes(offs) and len(offs) == 2:
            return {"dtype": dtype, "shape": shape, "data_offsets": offs}
    if isinstance(value, list) and len(value) == len(_FIELDS):
        value = dict(zip(_FIELDS, value))
    if not isinstance(value, dict) or not value.keys() >= _FIELD_SET:
        raise FormatError(f"{path}: tensor {key!r}: header entry needs dtype, shape and data_offsets")
    dtype, shape, offs = value["dtype"], value["shape"], value["data_offsets"]
    if isinstance(dtype, dict) and len(dtype) == 1 and list(dtype.values()) == [None]:
        dtype = next(iter(dtype))
    if not isinstance(dtype, str) or dtype not in DTYPES:
        if isinstance(dtype, str) and dtype in NO_TORCH_DTYPE:
            raise FormatError(f"{path}: tensor {key!r}: dtype {dtype!r} has no torch dtype: neither ckptfix nor "
                              "safetensors' torch reader can read it")
        raise FormatError(f"{path}: tensor {key!r}: unknown dtype {dtype!r}")
    if not _are_sizes(shape):
        raise FormatError(f"{path}: tensor {key!r}: shape {shape!r} is not a list of sizes (integers from 0 to 2**64-1)")
    if not (_are_sizes(offs) and len(offs) == 2):
        raise FormatError(f"{path}: tensor {key!r}: data_offsets {offs!r} are not two byte offsets (integers from 0 "
                          "to 2**64-1)")
    return {"dtype": dtype, "shape": shape, "data_offsets": offs}


def _check_layout(path: str, entries: dict[str, dict], data_len: int) -> None:
    """safetensors' own rules: the tensors lie back to back from the start of the data to its end, in the
    order of their offsets, each as long as its shape and dtype say (computed in u64, refused past it),
    a whole number of bytes; and torch can hold each shape."""
    end = 0
    last = None
    for key, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"]):
        b, e_end = e["data_offsets"]
        if b != end or e_end < b:
            where = f"the previous tensor {last!r} ends at {end}" if last is not None else "the data starts at 0"
            raise FormatError(f"{path}: tensor {key!r}: data_offsets {[b, e_end]} are not where {where}: safetensors "
                              "stores tensors back to back, without gaps or overlaps")
        if e_end > data_len:
            raise FormatError(f"{path}: tensor {key!r}: data_offsets {[b, e_end]} fall outside the data "
                              f"({data_len} bytes)")
        end, last = e_end, key
        nbits = _product_below([*e["shape"], bits(e["dtype"])], _USIZE_END)
        if nbits is None:
            raise FormatError(f"{path}: tensor {key!r}: shape {e['shape']} × {e['dtype']} overflows safetensors' "
                              "64-bit sizes")
        if nbits % 8:
            raise FormatError(f"{path}: tensor {key!r}: shape {e['shape']} × {e['dtype']} is {nbits} bits, not a whole "
                              "number of bytes")
        if nbits // 8 != e_end - b:
            raise FormatError(f"{path}: tensor {key!r}: shape {e['shape']} × {e['dtype']} is {nbits // 8} bytes "
                              f"but its byte range holds {e_end - b}")
        if nbits == 0 or e["dtype"] in PACKED:  # a tensor with data is within torch's limits already
            _check_torch_shape(path, key, e)
    if end != data_len:
        raise FormatError(f"{path}: {data_len - end} bytes of data lie past the last tensor ({last!r}): safetensors "
                          "refuses such a file (truncated or padded)")


def _product_below(factors: Any, limit: int) -> int | None:
    """The product of ``factors`` from the left, or None once a step reaches ``limit`` (u64 for safetensors,
    int64 for torch: both check each step, so ``[2**40, 2**40, 0]`` overflows and ``[0, 2**40, 2**40]`` does not)."""
    out = 1
    for x in factors:
        out *= x
        if out >= limit:
            return None
    return out


def _check_torch_shape(path: str, key: str, entry: dict) -> None:
    """The shape as torch holds it: each size an int64, and the contiguous strides ``torch.empty`` computes
    (products of the later sizes, in int64); F4 needs whole pairs of values in its last dimension. (torch's
    storage-size check, in u64, is the one safetensors made already.)"""
    dtype = entry["dtype"]
    if dtype in PACKED and entry["shape"][-1] % PACKED[dtype]:
        raise FormatError(f"{path}: tensor {key!r}: an {dtype} shape's last dimension must be even (torch's "
                          f"{DTYPES[dtype]} holds pairs of values); it is {entry['shape']}")
    shape = torch_shape(entry)
    if any(d >= _INT64_END for d in shape) or _product_below([max(d, 1) for d in reversed(shape[1:])], _INT64_END) is None:
        raise FormatError(f"{path}: tensor {key!r}: shape {list(shape)} overflows torch's 64-bit sizes or strides")


def check_file(path: str) -> None:
    """Validate the header and ckptfix's own metadata (aliases) without reading tensor data; every
    problem is a FormatError. For ``scan``: a file ckptfix would read differently from other readers
    is not passed as clean."""
    _start, header, meta = read_header(path)
    _aliases(path, ckptfix_meta(path, meta), header)


def assemble(path: str, header: dict[str, dict], meta: dict[str, str], tensors: dict[str, Any]) -> OrderedDict:
    """The state dict from the stored ``tensors`` (tensors, or TensorInfo for the torch-free reader):
    ckptfix's tied-weight aliases, key order and ``_metadata`` restored."""
    extra = ckptfix_meta(path, meta)
    aliases = _aliases(path, extra, header)
    order = [k for k in extra.get("order", []) if k in tensors or k in aliases]
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


def json_object(path: str, what: str, raw: str | bytes | None) -> dict | None:
    """``raw`` (a metadata entry or record ckptfix writes) as a JSON object; None where absent; FormatError naming
    ``what`` where it is not valid JSON or not an object."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise FormatError(f"{path}: {what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: {what} is a JSON {type(value).__name__}, not an object")
    return value


def ckptfix_meta(path: str, meta: dict[str, str]) -> dict:
    """ckptfix's own metadata entry as a dict ({} when absent); FormatError when it is not valid JSON, not an
    object, or its key ``order`` is not a list of key names (what ckptfix writes)."""
    extra = json_object(path, f"the {META_KEY!r} metadata entry", meta.get(META_KEY))
    if extra is None:
        return {}
    order = extra.get("order", [])
    if not isinstance(order, list) or not all(isinstance(k, str) for k in order):
        raise FormatError(f"{path}: the {META_KEY!r} metadata's order is not a list of key names")
    return extra
