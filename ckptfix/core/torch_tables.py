"""torch's own tables, frozen: what ckptfix must know of torch without importing it (2–3 s, 280 MiB).

``TORCH_SAFE_GLOBALS`` is torch's ``weights_only`` allow-list (``_get_allowed_globals()``) per torch
release series, so ``ckptfix scan`` and ``ckptfix inspect`` can class a pickle's globals without torch.
For a torch series not listed (before 2.13), :func:`torch_safe_names` returns None and callers ask torch
itself (correct, but it imports torch). ``tests/core/test_torch_tables.py`` compares every table here with the
installed torch and says what to add or remove when an upgrade changes one; ``make test`` runs it with
torch 2.14.1 and, in a second venv, with 2.13.0.
"""

from __future__ import annotations

import functools
import re
import sys

#: torch.serialization's weights_only defaults (names as pickled), per torch release series
TORCH_SAFE_GLOBALS: dict[str, frozenset[str]] = {
    "2.14": frozenset({
        "_codecs.encode", "builtins.bytearray", "builtins.complex", "builtins.set", "collections.Counter",
        "collections.OrderedDict", "torch.BFloat16Storage", "torch.BFloat16Tensor", "torch.BoolStorage",
        "torch.BoolTensor", "torch.ByteStorage", "torch.ByteTensor", "torch.CharStorage", "torch.CharTensor",
        "torch.ComplexDoubleStorage", "torch.ComplexFloatStorage", "torch.DoubleStorage", "torch.DoubleTensor",
        "torch.FloatStorage", "torch.FloatTensor", "torch.HalfStorage", "torch.HalfTensor", "torch.IntStorage",
        "torch.IntTensor", "torch.LongStorage", "torch.LongTensor", "torch.QInt32Storage", "torch.QInt8Storage",
        "torch.QUInt2x4Storage", "torch.QUInt4x2Storage", "torch.QUInt8Storage", "torch.ShortStorage",
        "torch.ShortTensor", "torch.Size", "torch.Tensor", "torch._tensor._rebuild_from_type_v2",
        "torch._utils._rebuild_device_tensor_from_cpu_tensor", "torch._utils._rebuild_device_tensor_from_numpy",
        "torch._utils._rebuild_meta_tensor_no_storage", "torch._utils._rebuild_nested_tensor",
        "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_qtensor", "torch._utils._rebuild_sparse_tensor", "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_wrapper_subclass", "torch.bcomplex32", "torch.bfloat16", "torch.bits16",
        "torch.bits1x8", "torch.bits2x4", "torch.bits4x2", "torch.bits8", "torch.bool", "torch.complex128",
        "torch.complex32", "torch.complex64", "torch.cuda.BFloat16Storage", "torch.cuda.BFloat16Tensor",
        "torch.cuda.BoolStorage", "torch.cuda.BoolTensor", "torch.cuda.ByteStorage", "torch.cuda.ByteTensor",
        "torch.cuda.CharStorage", "torch.cuda.CharTensor", "torch.cuda.ComplexDoubleStorage",
        "torch.cuda.ComplexFloatStorage", "torch.cuda.DoubleStorage", "torch.cuda.DoubleTensor",
        "torch.cuda.FloatStorage", "torch.cuda.FloatTensor", "torch.cuda.HalfStorage", "torch.cuda.HalfTensor",
        "torch.cuda.IntStorage", "torch.cuda.IntTensor", "torch.cuda.LongStorage", "torch.cuda.LongTensor",
        "torch.cuda.ShortStorage", "torch.cuda.ShortTensor", "torch.cuda.sparse.BFloat16Tensor",
        "torch.cuda.sparse.ByteTensor", "torch.cuda.sparse.CharTensor", "torch.cuda.sparse.DoubleTensor",
        "torch.cuda.sparse.FloatTensor", "torch.cuda.sparse.HalfTensor", "torch.cuda.sparse.IntTensor",
        "torch.cuda.sparse.LongTensor", "torch.cuda.sparse.ShortTensor", "torch.device", "torch.float16",
        "torch.float32", "torch.float4_e2m1fn_x2", "torch.float64", "torch.float8_e4m3fn", "torch.float8_e4m3fnuz",
        "torch.float8_e5m2", "torch.float8_e5m2fnuz", "torch.float8_e8m0fnu", "torch.int1", "torch.int16",
        "torch.int2", "torch.int3", "torch.int32", "torch.int4", "torch.int5", "torch.int6", "torch.int64",
        "torch.int7", "torch.int8", "torch.nn.parameter.Parameter", "torch.per_channel_affine",
        "torch.per_channel_affine_float_qparams", "torch.per_channel_symmetric", "torch.per_tensor_affine",
        "torch.per_tensor_symmetric", "torch.qint32", "torch.qint8", "torch.quint2x4", "torch.quint4x2",
        "torch.quint8", "torch.serialization._get_layout", "torch.sparse.BFloat16Tensor", "torch.sparse.ByteTensor",
        "torch.sparse.CharTensor", "torch.sparse.DoubleTensor", "torch.sparse.FloatTensor",
        "torch.sparse.HalfTensor", "torch.sparse.IntTensor", "torch.sparse.LongTensor", "torch.sparse.ShortTensor",
        "torch.storage.TypedStorage", "torch.storage.UntypedStorage", "torch.uint1", "torch.uint16", "torch.uint2",
        "torch.uint3", "torch.uint32", "torch.uint4", "torch.uint5", "torch.uint6", "torch.uint64", "torch.uint7",
        "torch.uint8",
    }),
}
TORCH_SAFE_GLOBALS["2.13"] = TORCH_SAFE_GLOBALS["2.14"] - {"torch.bcomplex32"}  # bcomplex32 is new in 2.14

#: bytes per element (``torch._utils._element_size``) of the dtypes a structure read describes
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,  # two 4-bit values per element
}

#: elements per byte of the sub-byte quantized dtypes (one element per byte of ``itemsize``): torch bounds a view
#: of them by ``ceil(elements / per_byte)`` bytes of its storage
PACKED_PER_BYTE: dict[str, int] = {"quint4x2": 2, "quint2x4": 4}

#: dtypes that may require grad (floating point or complex)
DIFFERENTIABLE = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn",
                            "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"})

#: legacy storage classes (``torch.FloatStorage`` …) → the dtype of their elements
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
    "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "QInt8Storage": "qint8", "QInt32Storage": "qint32", "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}


@functools.lru_cache(maxsize=1)
def torch_series() -> str | None:
    """The installed torch's release series (``"2.14"``), read from ``torch/version.py`` without
    importing torch (``importlib.metadata`` alone costs ~60 ms)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    if version is None:
        import importlib.util
        import os

        spec = importlib.util.find_spec("torch")
        where = spec.submodule_search_locations if spec is not None else None
        if not where:
            return None
        try:
            with open(os.path.join(list(where)[0], "version.py"), encoding="utf-8") as f:
                found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            return None
        version = found.group(1) if found else None
    m = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return f"{m.group(1)}.{m.group(2)}" if m else None


def torch_safe_names() -> frozenset[str] | None:
    """torch's weights_only allow-list for the installed torch, or None when this table lacks its series."""
    series = torch_series()
    return TORCH_SAFE_GLOBALS.get(series) if series is not None else None
