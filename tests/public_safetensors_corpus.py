"""The safetensors project's own test files: every file content its tests write or embed, remade here.

Upstream (huggingface/safetensors): the Rust tests of ``safetensors/src/tensor.rs`` (crafted headers, byte
strings the serializer must produce), its fuzz targets (``fuzz_target_1``: any bytes; ``structured_roundtrip``:
every dtype, rank 0 to 4, sizes from 0), and the Python tests ``bindings/python/tests/test_simple.py``,
``test_pt_comparison.py`` and ``test_pt_model.py`` (files written by ``save_file``/``save_model``). Each case is
named after the upstream test it comes from, and its docstring cites it. The generators are ours: files the upstream
tests make with the library's ``save_file``/``save_model`` are made here with the same public calls on the same
tensors (seeded); headers the Rust tests spell out as bytes are reproduced as data, each naming its test.

Files that only a save refuses upstream (non-contiguous, shared, sparse, meta tensors) make no file and are not
here. ``CASES``: name → maker(tmp dir) → the file; ``MODELS``: the cases written by ``save_model`` or loaded with
``load_model`` upstream → the module class each is loaded into there (tests/formats/test_public_safetensors_corpus.py).
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file, save_model

Maker = Callable[[Path], Path]
CASES: dict[str, Maker] = {}
MODELS: dict[str, Callable[[], torch.nn.Module]] = {}
#: the cases the safetensors library refuses to read (safe_open, load_file); it reads every other one
REFUSED = frozenset({
    "rust-test_serialization_fp4_misaligned", "rust-test_serialization_fp4_invalid", "rust-test_json_attack",
    "rust-test_metadata_incomplete_buffer-extra", "rust-test_metadata_incomplete_buffer-short", "rust-test_header_too_large",
    "rust-test_header_too_small", "rust-test_invalid_header_length", "rust-test_invalid_header_non_utf8",
    "rust-test_invalid_header_not_json", "rust-test_invalid_info", "rust-test_validation_overflow-shape",
    "rust-test_validation_overflow-bytes", "rust-test_invalid_header_size_serialization", "rust-test_roundtrip-f6_e2m3",
    "rust-test_roundtrip-f6_e3m2",
})
#: cases of tens of MB of tensors or more: compared whole (torch.equal), never byte by byte in Python, and not
#: converted to every output format
BIG = {"rust-test_gpt2_tiny", "pt-LoadTestCase"}


def case(name: str) -> Callable[[Callable[[Path], Any]], Maker]:
    """Register ``make(path)`` as the case ``name``: it writes ``tmp/<name>.safetensors`` (bytes, if it returns them)."""
    def register(make: Callable[[Path], Any]) -> Maker:
        def maker(tmp: Path) -> Path:
            path = tmp / f"{name}.safetensors"
            data = make(path)
            if isinstance(data, bytes):
                path.write_bytes(data)
            return path
        maker.__doc__ = make.__doc__
        CASES[name] = maker
        return maker
    return register


def raw(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A file from its header text as given (no padding) and data; ``length`` overrides the 8-byte header length."""
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def padded(header: dict[str, Any], data: bytes = b"") -> bytes:
    """A file as safetensors' serializer lays one out: compact JSON, spaces to a multiple of 8, then the data."""
    text = json.dumps(header, separators=(",", ":")).encode()
    return raw(text + b" " * (-len(text) % 8), data)


def floats(*values: float, fmt: str = "f") -> bytes:
    return struct.pack(f"<{len(values)}{fmt}", *values)


# -- safetensors/src/tensor.rs ------------------------------------------------------------------------------------

@case("rust-test_serialization")
def _rust_serialization(path: Path) -> bytes:
    """tensor.rs test_serialization (and test_slicing): F32 [1,2,3] "attn.0" = 0..5, header padded to 64."""
    return padded({"attn.0": {"dtype": "F32", "shape": [1, 2, 3], "data_offsets": [0, 24]}}, floats(0, 1, 2, 3, 4, 5))


@case("rust-test_serialization_fp4")
def _rust_fp4(path: Path) -> bytes:
    """tensor.rs test_serialization_fp4: F4 [1,2] in one byte (torch: float4_e2m1fn_x2 [1,1])."""
    return padded({"attn.0": {"dtype": "F4", "shape": [1, 2], "data_offsets": [0, 1]}}, b"\x00")


@case("rust-test_serialization_fp4_misaligned")
def _rust_fp4_misaligned(path: Path) -> bytes:
    """tensor.rs test_serialization_fp4_misaligned: F4 [1,3] (12 bits, no whole byte) over 2 bytes: MisalignedSlice."""
    return padded({"attn.0": {"dtype": "F4", "shape": [1, 3], "data_offsets": [0, 2]}}, b"\x00\x01")


@case("rust-test_serialization_fp4_invalid")
def _rust_fp4_invalid(path: Path) -> bytes:
    """tensor.rs test_serialization_fp4_invalid: F4 [1,2] (one byte) over 2 bytes: InvalidTensorView."""
    return padded({"attn.0": {"dtype": "F4", "shape": [1, 2], "data_offsets": [0, 2]}}, b"\x00\x01")


@case("rust-test_empty")
def _rust_empty(path: Path) -> bytes:
    """tensor.rs test_empty: no tensors, ``{}`` and six spaces (the bytes the test asserts)."""
    return b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "


@case("rust-test_empty-metadata")
def _rust_empty_metadata(path: Path) -> bytes:
    """tensor.rs test_empty, second half: no tensors, ``__metadata__`` {"framework": "pt"} (asserted bytes)."""
    return b'(\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{"framework":"pt"}}     '


@case("rust-test_serialization_forced_alignement")
def _rust_forced_alignment(path: Path) -> bytes:
    """tensor.rs test_serialization_forced_alignement: "attn0" F32 [1,1,2,3], header padded with 7 spaces to 72."""
    return padded({"attn0": {"dtype": "F32", "shape": [1, 1, 2, 3], "data_offsets": [0, 24]}}, floats(0, 1, 2, 3, 4, 5))


@case("rust-test_gpt2_tiny")
def _rust_gpt2_tiny(path: Path) -> None:
    """tensor.rs test_gpt2_tiny (gpt2_like(6)): GPT-2's 82 F32 tensors, zeros (350 MB, written sparse), laid out by
    the serializer's order (dtype, then name)."""
    shapes = {"wte": [50257, 768], "wpe": [1024, 768], "ln_f.weight": [768], "ln_f.bias": [768]}
    for i in range(6):
        shapes.update({f"h.{i}.ln_1.weight": [768], f"h.{i}.ln_1.bias": [768], f"h.{i}.attn.bias": [1, 1, 1024, 1024],
                       f"h.{i}.attn.c_attn.weight": [768, 2304], f"h.{i}.attn.c_attn.bias": [2304],
                       f"h.{i}.attn.c_proj.weight": [768, 768], f"h.{i}.attn.c_proj.bias": [768],
                       f"h.{i}.ln_2.weight": [768], f"h.{i}.ln_2.bias": [768], f"h.{i}.mlp.c_fc.weight": [768, 3072],
                       f"h.{i}.mlp.c_fc.bias": [3072], f"h.{i}.mlp.c_proj.weight": [3072, 768],
                       f"h.{i}.mlp.c_proj.bias": [768]})
    header, end = {}, 0
    for name in sorted(shapes):
        n = 4 * int(np.prod(shapes[name]))
        header[name] = {"dtype": "F32", "shape": shapes[name], "data_offsets": [end, end + n]}
        end += n
    head = padded(header)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + end)


@case("rust-test_serialize_to_file_same_path_with_active_mmap")
def _rust_same_path(path: Path) -> None:
    """tensor.rs test_serialize_to_file_same_path_with_active_mmap: "w" F32 [3] = 1, 2, 3, re-saved over itself
    while mapped (the result must be those values, not zeros)."""
    save_file({"w": torch.tensor([1.0, 2.0, 3.0])}, path)
    from safetensors.torch import load_file

    save_file(load_file(path), path)


# the Rust tests' crafted headers, as their byte strings (data: zeros unless said)
_I32_2X2 = b'{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'


@case("rust-test_empty_shapes_allowed")
def _rust_empty_shapes(path: Path) -> bytes:
    """tensor.rs test_empty_shapes_allowed: I32 shape [] (a scalar) over 4 bytes."""
    return raw(b'{"test":{"dtype":"I32","shape":[],"data_offsets":[0,4]}}', bytes(4))


@case("rust-test_deserialization")
def _rust_deserialization(path: Path) -> bytes:
    """tensor.rs test_deserialization (and test_lifetimes, test_simple.py test_deserialization): I32 [2,2], header of
    60 bytes, unpadded (the data starts at byte 68: not 8-aligned)."""
    return raw(_I32_2X2, bytes(16))


@case("rust-test_json_attack")
def _rust_json_attack(path: Path) -> bytes:
    """tensor.rs test_json_attack: ten F32 [2,2] tensors all at data_offsets [0,16] over 16 bytes: InvalidOffset."""
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return raw(json.dumps({f"weight_{i}": entry for i in range(10)}, separators=(",", ":")).encode(), bytes(16))


@case("rust-test_metadata_incomplete_buffer-extra")
def _rust_incomplete_extra(path: Path) -> bytes:
    """tensor.rs test_metadata_incomplete_buffer: bytes after the last tensor (a polyglot's): MetadataIncompleteBuffer."""
    return raw(_I32_2X2, bytes(16) + b"extra_bogus_data_for_polyglot_file")


@case("rust-test_metadata_incomplete_buffer-short")
def _rust_incomplete_short(path: Path) -> bytes:
    """tensor.rs test_metadata_incomplete_buffer, second half: the data two bytes short."""
    return raw(_I32_2X2, bytes(14))


@case("rust-test_header_too_large")
def _rust_header_too_large(path: Path) -> bytes:
    """tensor.rs test_header_too_large: the header length's top bytes 0xff (far over 100 MB): HeaderTooLarge."""
    return b"<\x00\x00\x00\x00\xff\xff\xff" + _I32_2X2 + bytes(16)


@case("rust-test_header_too_small")
def _rust_header_too_small(path: Path) -> bytes:
    """tensor.rs test_header_too_small (and fuzz_target_1's empty input): an empty file."""
    return b""


@case("rust-test_invalid_header_length")
def _rust_invalid_header_length(path: Path) -> bytes:
    """tensor.rs test_invalid_header_length: a header length of 60 and nothing after it."""
    return b"<\x00\x00\x00\x00\x00\x00\x00"


@case("rust-test_invalid_header_non_utf8")
def _rust_non_utf8(path: Path) -> bytes:
    """tensor.rs test_invalid_header_non_utf8: a one-byte header 0xff."""
    return b"\x01\x00\x00\x00\x00\x00\x00\x00\xff"


@case("rust-test_invalid_header_not_json")
def _rust_not_json(path: Path) -> bytes:
    """tensor.rs test_invalid_header_not_json: a one-byte header ``{``."""
    return b"\x01\x00\x00\x00\x00\x00\x00\x00{"


@case("rust-test_whitespace_padded_header")
def _rust_trailing_whitespace(path: Path) -> bytes:
    """tensor.rs test_whitespace_padded_header: ``{}`` then CR, space, tab, LF (all JSON whitespace)."""
    return b"\x06\x00\x00\x00\x00\x00\x00\x00{}\x0d\x20\x09\x0a"


@case("rust-test_whitespace_leading_padded_header")
def _rust_leading_whitespace(path: Path) -> bytes:
    """tensor.rs test_whitespace_leading_padded_header (0.7's test_whitespace_start_padded_header_is_not_allowed,
    commented out there): tab, LF, ``{}``, CR, space."""
    return b"\x06\x00\x00\x00\x00\x00\x00\x00\x09\x0a{}\x0d\x20"


@case("rust-test_zero_sized_tensor")
def _rust_zero_sized(path: Path) -> bytes:
    """tensor.rs test_zero_sized_tensor: I32 [2,0] at data_offsets [0, 0] (with a space), no data."""
    return raw(b'{"test":{"dtype":"I32","shape":[2,0],"data_offsets":[0, 0]}}')


@case("rust-test_invalid_info")
def _rust_invalid_info(path: Path) -> bytes:
    """tensor.rs test_invalid_info: I32 [2,2] (16 bytes) at data_offsets [0, 4], no data: TensorInvalidInfo."""
    return raw(b'{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0, 4]}}')


@case("rust-test_validation_overflow-shape")
def _rust_overflow_shape(path: Path) -> bytes:
    """tensor.rs test_validation_overflow: shape [2, 2**64-2]: the element count overflows u64."""
    return raw(b'{"test":{"dtype":"I32","shape":[2,18446744073709551614],"data_offsets":[0,16]}}', bytes(16))


@case("rust-test_validation_overflow-bytes")
def _rust_overflow_bytes(path: Path) -> bytes:
    """tensor.rs test_validation_overflow, second half: shape [2, 2**63-1]: elements × 4 bytes overflows u64."""
    return raw(b'{"test":{"dtype":"I32","shape":[2,9223372036854775807],"data_offsets":[0,16]}}', bytes(16))


@case("rust-test_invalid_header_size_serialization")
def _rust_header_size(path: Path) -> bytes:
    """tensor.rs test_invalid_header_size_serialization: metadata of 100,000,000 "a"s, which the serializer refuses
    (HeaderTooLarge); the file it would have written, which readers refuse too."""
    return padded({"__metadata__": {"very_large_metadata": "a" * 100_000_000}})


#: the dtypes of tensor.rs arbitrary_dtype (test_indexing, test_roundtrip) and fuzz structured_roundtrip's, in the
#: order of safetensors' Rust ``Dtype`` enum (its serializer writes the last first)
_ROUNDTRIP_DTYPES = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
                     "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
_BITS = {"BOOL": 8, "F4": 4, "F6_E3M2": 6, "F6_E2M3": 6, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "F16": 16,
         "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}


def _roundtrip(tensors: list[tuple[str, str, list[int]]]) -> bytes:
    """A file laid out as the serializer lays one out (by dtype, the enum's last first, then by name), its data the bytes
    0, 1, 2 … of the whole data section, as test_roundtrip fills it (BOOL: 0 and 1 only, which torch reads)."""
    order = sorted(tensors, key=lambda t: (-_ROUNDTRIP_DTYPES.index(t[1]), t[0]))
    header, data = {}, b""
    for name, dtype, shape in order:
        n = int(np.prod(shape)) * _BITS.get(dtype, 8) // 8
        chunk = bytes((len(data) + i) % (2 if dtype == "BOOL" else 256) for i in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += chunk
    return padded(header, data)


@case("rust-test_roundtrip-every-dtype")
def _rust_roundtrip(path: Path) -> bytes:
    """tensor.rs test_roundtrip / test_indexing and fuzz structured_roundtrip: one tensor of each dtype torch has
    (F8 as 0x00…, which every float8 reads), shapes [2,4]."""
    dtypes = [d for d in _ROUNDTRIP_DTYPES if not d.startswith("F6")]
    return _roundtrip([(f"t.{i}", d, [2, 4]) for i, d in enumerate(dtypes)])


@case("fuzz-structured_roundtrip-ranks")
def _fuzz_ranks(path: Path) -> bytes:
    """fuzz structured_roundtrip arbitrary_shape: ranks 0 to 4, sizes 0 to 8 (zero-size tensors between others)."""
    return _roundtrip([("tensor_0", "F32", []), ("tensor_1", "I16", [0]), ("tensor_2", "U8", [3, 0, 2]),
                       ("tensor_3", "F64", [8, 1, 2, 1]), ("tensor_4", "F4", [2, 0]), ("tensor_5", "BF16", [1, 2, 3]),
                       ("tensor_6", "BOOL", [5])])


@case("rust-test_roundtrip-f6_e2m3")
def _rust_f6_e2m3(path: Path) -> bytes:
    """tensor.rs test_roundtrip: F6_E2M3 [4] (24 bits), a dtype torch lacks."""
    return _roundtrip([("t.0", "F6_E2M3", [4])])


@case("rust-test_roundtrip-f6_e3m2")
def _rust_f6_e3m2(path: Path) -> bytes:
    """tensor.rs test_roundtrip: F6_E3M2 [2,4] (48 bits) beside an F32, a dtype torch lacks."""
    return _roundtrip([("t.0", "F32", [2]), ("t.1", "F6_E3M2", [2, 4])])


# -- bindings/python/tests/test_simple.py -------------------------------------------------------------------------

@case("simple-test_serialization")
def _simple_serialization(path: Path) -> None:
    """test_simple.py test_serialization: numpy I32 [2,2] with [1,1] = 1, header padded to 64."""
    data = np.zeros((2, 2), dtype=np.int32)
    data[1, 1] = 1
    save_numpy({"test": data}, str(path))


@case("simple-test_deserialization_metadata")
def _simple_deserialization_metadata(path: Path) -> bytes:
    """test_simple.py test_deserialization_metadata: ``__metadata__`` {"framework": "pt"} first, "test1" I32 [2,2],
    seven spaces of padding (header 102 bytes)."""
    return raw(b'{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'
               b"       ", bytes(16))


@case("simple-test_serialization_forces_alignment")
def _simple_alignment(path: Path) -> None:
    """test_simple.py test_serialization_order_invariant / _forces_alignment: I32 [2,2] and F16 [2,2] (values here)."""
    save_numpy({"test2": np.arange(4, dtype=np.float16).reshape(2, 2) - 1.5,
                "test1": np.arange(4, dtype=np.int32).reshape(2, 2) - 2}, str(path))


@case("simple-test_serialization_no_big_endian")
def _simple_big_endian(path: Path) -> None:
    """test_simple.py test_serialization_metadata / _no_big_endian: a big-endian ``>i4`` [2,2] written little-endian,
    ``metadata={"framework": "pt"}`` (values here, so byte order shows)."""
    save_numpy({"test1": np.array([[1, -2], [3, 2**30]], dtype=">i4")}, str(path), metadata={"framework": "pt"})


@case("simple-test_numpy_example")
def _simple_numpy(path: Path) -> None:
    """test_simple.py test_numpy_example (test_handle.py too): F64 [2,2] and U8 [2,3] zeros."""
    save_numpy({"a": np.zeros((2, 2)), "b": np.zeros((2, 3), dtype=np.uint8)}, str(path))


@case("simple-test_numpy_bool")
def _simple_bool(path: Path) -> None:
    """test_simple.py test_numpy_bool: a 0-dim BOOL False."""
    save_numpy({"a": np.asarray(False)}, str(path))


@case("simple-test_torch_example")
def _simple_torch(path: Path) -> None:
    """test_simple.py test_torch_example / test_accept_path: F32 [2,2] randn and U8 [2,3] randint (seeded)."""
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn((2, 2), generator=g), "b": torch.randint(0, 128, (2, 3), dtype=torch.uint8, generator=g)},
              path)


@case("simple-test_torch_slice")
def _simple_slice(path: Path) -> None:
    """test_simple.py test_torch_slice / test_numpy_slice: F32 [10,5] randn (seeded)."""
    save_file({"a": torch.randn((10, 5), generator=torch.Generator().manual_seed(1))}, path)


# -- bindings/python/tests/test_pt_comparison.py ------------------------------------------------------------------

@case("pt-test_serialization-bf16")
def _pt_bf16(path: Path) -> None:
    """test_pt_comparison.py test_serialization, last file: BF16 [2,2] ones with [0,0] = 2.25."""
    data = torch.ones((2, 2), dtype=torch.bfloat16)
    data[0, 0] = 2.25
    save_file({"test": data}, path)


@case("pt-test_odd_dtype")
def _pt_odd(path: Path) -> None:
    """test_pt_comparison.py test_odd_dtype: BF16, F16 randn, BOOL with one True, C64 zeros, all [2,2]."""
    g = torch.Generator().manual_seed(2)
    flags = torch.zeros((2, 2), dtype=torch.bool)
    flags[0, 0] = True
    save_file({"test": torch.randn((2, 2), generator=g).bfloat16(), "test2": torch.randn((2, 2), generator=g).half(),
               "test3": flags, "test4": torch.zeros((2, 2), dtype=torch.complex64)}, path)


@case("pt-test_complex")
def _pt_complex(path: Path) -> None:
    """test_pt_comparison.py test_complex: C64 [2,2] zeros with [1][1] = -1+1j."""
    data = torch.zeros((2, 2), dtype=torch.complex64)
    data[1][1] = torch.complex(torch.tensor([-1.0]), torch.tensor([1.0]))
    save_file({"test": data}, path)


@case("pt-test_odd_dtype_fp8")
def _pt_fp8(path: Path) -> None:
    """test_pt_comparison.py test_odd_dtype_fp8_e4m3fn / _e5m2 / _e8m0 / _fnuz: -0.5 (e4m3fn, e5m2), 0.5 (e8m0,
    fnuz), one file."""
    save_file({"e4m3fn": torch.tensor([-0.5], dtype=torch.float8_e4m3fn),
               "e5m2": torch.tensor([-0.5], dtype=torch.float8_e5m2),
               "e8m0": torch.tensor([0.5], dtype=torch.float8_e8m0fnu),
               "e4m3fnuz": torch.tensor([0.5], dtype=torch.float8_e4m3fnuz),
               "e5m2fnuz": torch.tensor([0.5], dtype=torch.float8_e5m2fnuz)}, path)


@case("pt-test_odd_dtype_fp4")
def _pt_fp4(path: Path) -> None:
    """test_pt_comparison.py test_odd_dtype_fp4: F8_E8M0 [1] 0.0 (its 2**-127) and F4 [2,2] torch (header [2,4]),
    bytes set here (upstream: torch.empty)."""
    packed = torch.tensor([[0x12, 0x34], [0x56, 0xF7]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"test1": torch.tensor([0.0], dtype=torch.float8_e8m0fnu), "test2": packed}, path)


@case("pt-test_mps_fp4")
def _pt_mps_fp4(path: Path) -> None:
    """test_pt_comparison.py test_mps_fp4: F4 torch [2,4] (header [2,8])."""
    packed = torch.arange(8, dtype=torch.uint8).reshape(2, 4).mul(37).view(torch.float4_e2m1fn_x2)
    save_file({"packed": packed}, path)


@case("pt-test_zero_sized")
def _pt_zero_sized(path: Path) -> None:
    """test_pt_comparison.py test_zero_sized: F32 [2,0]."""
    save_file({"test": torch.zeros((2, 0))}, path)


@case("pt-test_multiple_zero_sized")
def _pt_multiple_zero_sized(path: Path) -> None:
    """test_pt_comparison.py test_multiple_zero_sized: two F32 [2,0], both at data_offsets [0,0]."""
    save_file({"test": torch.zeros((2, 0)), "test2": torch.zeros((2, 0))}, path)


@case("pt-test_disjoint_tensors_shared_storage")
def _pt_disjoint(path: Path) -> None:
    """test_pt_comparison.py test_disjoint_tensors_shared_storage: A[1:] and A[:1] of one [10,10] storage (values
    here)."""
    a = torch.arange(100.0).reshape(10, 10)
    save_file({"test": a[1:], "test2": a[:1]}, path)


@case("pt-test_in_memory")
def _pt_in_memory(path: Path) -> bytes:
    """test_pt_comparison.py test_in_memory: F32 [2,2] zeros (the asserted bytes)."""
    return (b'@\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}    '
            + bytes(16))


@case("pt-test_gpu")
def _pt_gpu(path: Path) -> None:
    """test_pt_comparison.py test_gpu / test_gpu_default_device: I64 arange(4) [2,2] (saved from the CPU here)."""
    save_file({"test": torch.arange(4).view((2, 2))}, path)


@case("pt-test_mps")
def _pt_mps(path: Path) -> None:
    """test_pt_comparison.py test_mps: F32 [4,4], F16 [2,4] aranges, BOOL [4], and an empty F32 [0,4]."""
    save_file({"test1": torch.arange(16, dtype=torch.float32).reshape(4, 4),
               "test2": torch.arange(8, dtype=torch.float16).reshape(2, 4),
               "test3": torch.tensor([True, False, True, False]), "empty": torch.empty((0, 4))}, path)


@case("pt-test_npu")
def _pt_npu(path: Path) -> None:
    """test_pt_comparison.py test_npu / test_hpu / test_anonymous_accelerator: F32 and F16 [2,2] zeros."""
    save_file({"test1": torch.zeros((2, 2)), "test2": torch.zeros((2, 2), dtype=torch.float16)}, path)


@case("pt-LoadTestCase")
def _pt_load(path: Path) -> None:
    """test_pt_comparison.py LoadTestCase: three F32 [1024,1024] (12 MB; values here, upstream zeros)."""
    save_file({name: torch.full((1024, 1024), float(i)) for i, name in enumerate(("test", "test2", "test3"))}, path)


@case("pt-SliceTestCase")
def _pt_slice(path: Path) -> None:
    """test_pt_comparison.py SliceTestCase: F32 arange(6) [1,2,3], no metadata."""
    save_file({"test": torch.arange(6, dtype=torch.float32).reshape((1, 2, 3))}, path)


@case("pt-test_deserialization_metadata")
def _pt_metadata(path: Path) -> None:
    """test_pt_comparison.py SliceTestCase.test_deserialization_metadata: the same, ``metadata={"Something": "more"}``."""
    save_file({"test": torch.arange(6, dtype=torch.float32).reshape((1, 2, 3))}, path, metadata={"Something": "more"})


# -- bindings/python/tests/test_pt_model.py -----------------------------------------------------------------------

class OnesModel(torch.nn.Module):
    """test_pt_model.py OnesModel: a Linear(4, 4) of ones, reachable as ``a`` and ``b`` (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.a.weight = torch.nn.Parameter(torch.ones((4, 4)))
        self.a.bias = torch.nn.Parameter(torch.ones((4,)))
        self.b = self.a


class TiedModel(torch.nn.Module):
    """test_pt_model.py Model: one Linear(100, 100) as ``a`` and ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(100, 100)
        self.b = self.a


class NonContiguousModel(torch.nn.Module):
    """test_pt_model.py NonContiguousModel: ``a.weight`` a transposed (non-contiguous) Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(100, 100)
        self.a.weight = torch.nn.Parameter(torch.arange(10_000.0).reshape(100, 100).transpose(0, 1))


class CopyModel(torch.nn.Module):
    """test_pt_model.py CopyModel: ``b`` a deep copy of ``a`` (equal values, no shared storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(100, 100)
        self.b = copy.deepcopy(self.a)


class NoSharedModel(torch.nn.Module):
    """test_pt_model.py NoSharedModel: two independent Linear(100, 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(100, 100)
        self.b = torch.nn.Linear(100, 100)


def _saved_model(name: str, build: Callable[[], torch.nn.Module], load_as: Callable[[], torch.nn.Module],
                 doc: str) -> None:
    """Register ``save_model(build())`` (seeded) as ``name``, loaded upstream into ``load_as()``."""
    def make(path: Path) -> None:
        torch.manual_seed(3)
        save_model(build(), str(path))
    make.__doc__ = doc
    case(name)(make)
    MODELS[name] = load_as


_saved_model("model-test_save", OnesModel, OnesModel, "test_pt_model.py test_save: save_model(OnesModel): a.* stored, "
             '__metadata__ {"b.bias": "a.bias", "b.weight": "a.weight"}.')
_saved_model("model-test_workaround", TiedModel, TiedModel, "test_pt_model.py test_workaround: save_model(Model), "
             "b.* dropped as a.*'s duplicates.")
_saved_model("model-test_workaround_non_contiguous", NonContiguousModel, NonContiguousModel,
             "test_pt_model.py test_workaround_non_contiguous: save_model(..., force_contiguous=True).")
_saved_model("model-test_workaround_copy", CopyModel, CopyModel, "test_pt_model.py test_workaround_copy: "
             "save_model(CopyModel): all four tensors stored.")
_saved_model("model-test_difference_with_torch", TiedModel, NoSharedModel, "test_pt_model.py "
             "test_difference_with_torch: save_model(Model) loaded into NoSharedModel: b.* missing, load_model refuses.")
_saved_model("model-test_difference_torch_odd", NoSharedModel, TiedModel, "test_pt_model.py "
             "test_difference_torch_odd: save_model(NoSharedModel) loaded into Model: b.* unexpected, load_model refuses.")


@case("model-test_workaround_works_with_different_on_file_names")
def _model_other_names(path: Path) -> None:
    """test_pt_model.py test_workaround_works_with_different_on_file_names: Model's state dict without a.*, by
    save_file: only b.weight and b.bias stored, no metadata."""
    torch.manual_seed(4)
    sd = TiedModel().state_dict()
    del sd["a.weight"], sd["a.bias"]
    save_file(sd, path)


MODELS["model-test_workaround_works_with_different_on_file_names"] = TiedModel
