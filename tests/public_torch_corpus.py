"""The checkpoint files PyTorch's own test/test_serialization.py saves or embeds, made again here.

Others' tests keep finding what our own generators miss, so this corpus takes its cases from torch's: each case
is named after the upstream test whose file it makes (its docstring names it), and writes one file with our
own code. The few byte strings of historical files (Python 2 / torch 0.3-0.4 era) that torch can no longer
write are reproduced as data, each with the upstream test it comes from; big-endian files are written by hand
(a torch zip whose ``byteorder`` record says ``big`` and whose storages are byte-swapped).

``CASES`` maps a name to ``make(tmp_dir) -> Path``. ``RISKY`` names the cases that hold something
``torch.load(weights_only=True)`` refuses by design (code-running reduces, classes outside its allow-list), so
``scan`` may report them; every other case is benign and ``scan`` must find nothing in it.
"""

from __future__ import annotations

import gzip
import io
import pickle
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tests import corpus_table

Make = corpus_table.Make
CASES, case = corpus_table.table()


def _save(obj: Any, path: Path, **kwargs: Any) -> Path:
    torch.save(obj, path, **kwargs)
    return path


_seed = corpus_table.seeded


# -- SerializationMixin._test_serialization_data and what the mixin's tests do with it --------------------

def _sharing_data() -> list[Any]:
    """Tensors sharing storages, a TypedStorage, storage views, an int tensor, a tuple of storages twice the same
    object and once equal, a storage that is a prefix view: the list every SerializationMixin test saves."""
    with _seed():
        a = [torch.randn(5, 5).float() for _ in range(2)]
    b: list[Any] = [a[i % 2] for i in range(4)]
    b += [a[0].storage(), a[0].reshape(-1)[1:4].storage(), torch.arange(1, 11).int()]
    t1 = torch.FloatTensor().set_(a[0].reshape(-1)[1:4].clone().storage(), 0, (3,), (1,))
    t2 = torch.FloatTensor().set_(a[0].reshape(-1)[1:4].clone().storage(), 0, (3,), (1,))
    b += [(t1.storage(), t1.storage(), t2.storage()), a[0].reshape(-1)[0:2].storage()]
    return b


@case("serialization-data-zip")
def _data_zip(tmp: Path) -> Path:
    """test_serialization_zipfile / test_serialization_safe (TestSerialization): the mixin's list, zip format."""
    return _save(_sharing_data(), tmp / "data.pt")


@case("serialization-data-legacy")
def _data_legacy(tmp: Path) -> Path:
    """test_serialization_safe (TestOldSerialization runs the mixin with _use_new_zipfile_serialization=False)."""
    return _save(_sharing_data(), tmp / "data_legacy.pt", _use_new_zipfile_serialization=False)


@case("serialization-gzip")
def _gzip(tmp: Path) -> Path:
    """test_serialization_gzip: the mixin's list saved, then gzipped (torch.load reads the gzip stream)."""
    raw = io.BytesIO()
    torch.save(_sharing_data(), raw, _use_new_zipfile_serialization=False)
    (tmp / "data.pt.gz").write_bytes(gzip.compress(raw.getvalue(), mtime=0))
    return tmp / "data.pt.gz"


@case("serialization-offset")
def _offset(tmp: Path) -> Path:
    """test_serialization_offset: a pickled int, then a legacy torch.save, in one file (torch.load at offset 0
    sees the int's pickle where the magic number should be)."""
    with open(tmp / "offset.pt", "wb") as f:
        pickle.dump(41, f)
        torch.save(torch.ones(5, 5), f, _use_new_zipfile_serialization=False)
        pickle.dump(43, f)
    return tmp / "offset.pt"


@case("serialization-offset-gzip")
def _offset_gzip(tmp: Path) -> Path:
    """test_serialization_offset_gzip: the same, gzipped."""
    raw = io.BytesIO()
    pickle.dump(41, raw)
    torch.save(torch.ones(5, 5), raw, _use_new_zipfile_serialization=False)
    (tmp / "offset.pt.gz").write_bytes(gzip.compress(raw.getvalue(), mtime=0))
    return tmp / "offset.pt.gz"


def _fake_zip_tensor() -> torch.Tensor:
    return torch.tensor([ord("P"), ord("K"), 5, 6] + [0] * 100, dtype=torch.uint8)


@case("fake-zip-legacy")
def _fake_zip_legacy(tmp: Path) -> Path:
    """test_serialization_fake_zip (TestOldSerialization): a legacy file whose storage holds an end-of-central-
    directory signature, so Python's zipfile calls it a zip and torch's own check does not."""
    return _save(_fake_zip_tensor(), tmp / "fake_zip.pt", _use_new_zipfile_serialization=False)


@case("fake-zip")
def _fake_zip(tmp: Path) -> Path:
    """test_serialization_fake_zip (TestSerialization): the same tensor in a zip."""
    return _save(_fake_zip_tensor(), tmp / "fake_zip_zip.pt")


@case("filelike")
def _filelike(tmp: Path) -> Path:
    """test_serialization_filelike_missing_attrs / _uses_readinto: a plain tensor saved through a file object."""
    buf = io.BytesIO()
    with _seed():
        torch.save(torch.randn(3, 10), buf)
    (tmp / "filelike.pt").write_bytes(buf.getvalue())
    return tmp / "filelike.pt"


# -- sparse layouts ---------------------------------------------------------------------------------------

def _sparse_source() -> torch.Tensor:
    x = torch.zeros(3, 3)
    x[1][1] = 1
    return x


_LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "coo": lambda x: x.to_sparse(), "csr": lambda x: x.to_sparse_csr(), "csc": lambda x: x.to_sparse_csc(),
    "bsr": lambda x: x.to_sparse_bsr((1, 1)), "bsc": lambda x: x.to_sparse_bsc((1, 1)),
}


def _sparse(layout: str) -> Make:
    def make(tmp: Path) -> Path:
        """test_serialization_sparse_safe: {"tensor": a 3x3 sparse tensor} in one layout."""
        return _save({"tensor": _LAYOUTS[layout](_sparse_source())}, tmp / f"sparse_{layout}.pt")
    return make


class _SparseSpoofer:
    """Pickles as ``torch._utils._rebuild_sparse_tensor(layout, data)`` with ``data`` given: what the upstream
    test's TensorSerializationSpoofer writes to smuggle invalid indices past torch.save's own checks."""

    def __init__(self, layout: torch.layout, data: tuple) -> None:
        self.layout, self.data = layout, data

    def __reduce_ex__(self, proto: int) -> tuple:
        return torch._utils._rebuild_sparse_tensor, (self.layout, self.data)


def _sparse_invalid(layout: str) -> Make:
    def make(tmp: Path) -> Path:
        """test_serialization_sparse_invalid / _sparse_{csr,csc,bsr,bsc}_invalid: indices out of range
        (torch.load validates them and refuses)."""
        x = _LAYOUTS[layout](_sparse_source())
        if layout == "coo":
            bad = x._indices().clone()
            bad[0][0] = 3
            data: tuple = (bad, x._values(), x.size())
        else:
            compressed = x.crow_indices() if layout in ("csr", "bsr") else x.ccol_indices()
            plain = x.col_indices() if layout in ("csr", "bsr") else x.row_indices()
            bad = compressed.clone()
            bad[0] = 3
            data = (bad, plain, x.values(), x.size())
        return _save({"spoofed": _SparseSpoofer(x.layout, data)}, tmp / f"sparse_{layout}_invalid.pt")
    return make


for _layout in _LAYOUTS:
    case(f"sparse-{_layout}")(_sparse(_layout))
    case(f"sparse-{_layout}-invalid")(_sparse_invalid(_layout))


# -- old tensor mechanisms and embedded historical files ---------------------------------------------------

class _OldTensorV1:
    """Pickles as ``torch.Tensor()`` then BUILD with (storage, offset, size, stride): pre-0.4 tensors."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> tuple:
        t = self.t
        return torch.Tensor, (), (t.storage(), t.storage_offset(), tuple(t.size()), t.stride())


class _OldTensorV2(_OldTensorV1):
    """Pickles as ``torch._utils._rebuild_tensor(storage, offset, size, stride)``."""

    def __reduce__(self) -> tuple:
        t = self.t
        return torch._utils._rebuild_tensor, (t.storage(), t.storage_offset(), tuple(t.size()), t.stride())


def _old_tensor(cls: type) -> Make:
    def make(tmp: Path) -> Path:
        """test_serialization_backwards_compat_safe: an old tensor pickling (as_strided view of 30 floats)."""
        with _seed():
            x = torch.randn(30).as_strided([2, 3], [9, 3], 2)
        return _save(cls(x), tmp / f"{cls.__name__.lower()}.pt", _use_new_zipfile_serialization=False)
    return make


case("backwards-compat-old-tensor-v1")(_old_tensor(_OldTensorV1))
case("backwards-compat-old-tensor-v2")(_old_tensor(_OldTensorV2))


# From test_serialization (SerializationMixin._test_serialization): [b'<utf-8 bytes>', torch.zeros(1), 2] as
# Python 2.7.12 with PyTorch 0.4.1 saved it (SHORT_BINSTRING text, a legacy file).
PY2_TORCH041 = (
    b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.'
    b'\x80\x02}q\x01(U\x10protocol_versionq\x02M\xe9\x03U\n'
    b'type_sizesq\x03}q\x04(U\x03intq\x05K\x04U\x05shortq\x06K\x02U'
    b'\x04longq\x07K\x04uU\rlittle_endianq\x08\x88u.\x80\x02]q'
    b'\x01(U\x0e\xc5\xbc\xc4\x85\xc4\x85\xc3\xb3\xc5\xbc\xc4\x85'
    b'\xc5\xbcq\x02ctorch._utils\n_rebuild_tensor_v2\nq\x03((U'
    b'\x07storageq\x04ctorch\nFloatStorage\nq\x05U\x0845640624q'
    b'\x06U\x03cpuq\x07\x8a\x01\x01NtQK\x00K\x01\x85K\x01\x85'
    b'\x89NtRq\x08K\x02e.\x80\x02]q\x01U\x0845640624q\x02a.\x01\x00'
    b'\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00'
)

# From test_load_nonexistent_device: torch.randn(2, device='cuda') saved by a legacy torch (location 'cuda:0').
CUDA_LEGACY = (
    b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9'
    b'\x03.\x80\x02}q\x00(X\x10\x00\x00\x00protocol_versionq'
    b'\x01M\xe9\x03X\r\x00\x00\x00little_endianq\x02\x88X\n'
    b'\x00\x00\x00type_sizesq\x03}q\x04(X\x05\x00\x00\x00shortq'
    b'\x05K\x02X\x03\x00\x00\x00intq\x06K\x04X\x04\x00\x00\x00'
    b'longq\x07K\x04uu.\x80\x02ctorch._utils\n_rebuild_tensor_v2'
    b'\nq\x00((X\x07\x00\x00\x00storageq\x01ctorch\nFloatStorage'
    b'\nq\x02X\x0e\x00\x00\x0094919395964320q\x03X\x06\x00\x00'
    b'\x00cuda:0q\x04K\x02Ntq\x05QK\x00K\x02\x85q\x06K\x01\x85q'
    b'\x07\x89Ntq\x08Rq\t.\x80\x02]q\x00X\x0e\x00\x00\x00'
    b'94919395964320q\x01a.\x02\x00\x00\x00\x00\x00\x00\x00\xbb'
    b'\x1f\x82\xbe\xea\x81\xd1>'
)

# From test_serialization_storage_slice: (s1, s2), two storage slices of torch.zeros(2), saved by PyTorch 0.3.1
# (each persistent id carries a view: (view key, offset, size)).
STORAGE_SLICE_031 = (
    b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03'
    b'.\x80\x02}q\x00(X\n\x00\x00\x00type_sizesq\x01}q\x02(X\x03'
    b'\x00\x00\x00intq\x03K\x04X\x05\x00\x00\x00shortq\x04K\x02X'
    b'\x04\x00\x00\x00longq\x05K\x04uX\x10\x00\x00\x00protocol_versionq'
    b'\x06M\xe9\x03X\r\x00\x00\x00little_endianq\x07\x88u.\x80\x02'
    b'(X\x07\x00\x00\x00storageq\x00ctorch\nFloatStorage\nq\x01X\x0e'
    b'\x00\x00\x0094279043900432q\x02X\x03\x00\x00\x00cpuq\x03K\x02'
    b'X\x0e\x00\x00\x0094279029750368q\x04K\x00K\x01\x87q\x05tq\x06'
    b'Q(h\x00h\x01X\x0e\x00\x00\x0094279043900432q\x07h\x03K\x02X'
    b'\x0e\x00\x00\x0094279029750432q\x08K\x01K\x01\x87q\ttq\nQ'
    b'\x86q\x0b.\x80\x02]q\x00X\x0e\x00\x00\x0094279043900432q'
    b'\x01a.\x02\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00'
    b'\x00\x00\x00\x00'
)


def _embedded(name: str, data: bytes) -> Make:
    def make(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name
    return make


case("python2-torch041-utf8-bytes")(_embedded("py2_utf8.pt", PY2_TORCH041))
case("load-nonexistent-device")(_embedded("cuda_legacy.pt", CUDA_LEGACY))
case("storage-slice-torch031")(_embedded("storage_slice.pt", STORAGE_SLICE_031))


# -- dtypes, storages of other dtypes, zero-size -------------------------------------------------------------

@case("save-different-dtype-unallocated")
def _different_dtype_unallocated(tmp: Path) -> Path:
    """test_save_different_dtype_unallocated: empty tensors and TypedStorages of other dtypes over one empty
    storage (torch allows it only because nothing is allocated)."""
    out: list[Any] = []
    for dtype, other in [(torch.float32, torch.int64), (torch.bool, torch.complex128), (torch.bfloat16, torch.half)]:
        a = torch.tensor([], dtype=dtype)
        out += [a, torch.TypedStorage(wrap_storage=a.storage().untyped(), dtype=other), torch.tensor([], dtype=other)]
    return _save(out, tmp / "unallocated.pt")


#: test_serialization_dtype's dtypes (float8s, complex32 upstream; the later revisions' uint16-64, bits, fnuz,
#: e8m0 and float4 too): each saved as {'x', 'even', 'odd'}, the last two views of the first.
DTYPES = ("float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu", "complex32",
          "uint16", "uint32", "uint64", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "float4_e2m1fn_x2")


def _dtype_case(name: str) -> Make:
    def make(tmp: Path) -> Path:
        """test_serialization_dtype: arange(100) in the dtype, with even/odd views sharing its storage."""
        dtype = getattr(torch, name)
        if name.startswith(("bits", "float4")) or name.startswith("uint") or name == "float8_e8m0fnu":
            size = {"bits16": 2, "uint16": 2, "uint32": 4, "uint64": 8}.get(name, 1)
            x = torch.arange(100 * size, dtype=torch.uint8).view(dtype)
        else:
            x = torch.arange(0.0, 100.0).to(dtype=dtype)
        return _save({"x": x, "even": x[0::2], "odd": x[1::2]}, tmp / f"dtype_{name}.pt")
    return make


for _dtype in DTYPES:
    case(f"dtype-{_dtype}")(_dtype_case(_dtype))


@case("serialization-math-bits")
def _math_bits(tmp: Path) -> Path:
    """test_serialization_math_bits: conj, neg and neg-of-conj views of a complex tensor (bits torch's rebuild
    sets again from the saved metadata)."""
    with _seed():
        t = torch.randn(3, dtype=torch.cfloat)
    return _save({"conj": torch.conj(t), "neg": torch._neg_view(t), "neg_conj": torch._neg_view(torch.conj(t)),
                  "plain": t}, tmp / "math_bits.pt")


@case("quantized-tensors")
def _quantized(tmp: Path) -> Path:
    """Quantized tensors (per-tensor affine qint8, per-channel quint8): the brief's list of rebuilds torch's
    weights_only honours (_rebuild_qtensor); test_serialization.py's quantization cousins live in test_quantization."""
    with _seed():
        x = torch.randn(4, 3)
    per_tensor = torch.quantize_per_tensor(x, 0.1, 3, torch.qint8)
    per_channel = torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.double),
                                             torch.tensor([0, 1, 2, 3]), 0, torch.quint8)
    return _save({"per_tensor": per_tensor, "per_channel": per_channel}, tmp / "quantized.pt")


# -- modules' state dicts, parameters, attributes ------------------------------------------------------------

@case("new-format-old-format-compat-zip")
def _compat_zip(tmp: Path) -> Path:
    """test_serialization_new_format_old_format_compat: a list of ones tensors, zip (upstream: 30 of 200x200)."""
    return _save([torch.ones(20, 20) for _ in range(3)], tmp / "compat_new.pt")


@case("new-format-old-format-compat-legacy")
def _compat_legacy(tmp: Path) -> Path:
    """test_serialization_new_format_old_format_compat: the same list, legacy format."""
    return _save([torch.ones(20, 20) for _ in range(3)], tmp / "compat_old.pt", _use_new_zipfile_serialization=False)


@case("pathlike-serialization")
def _pathlike(tmp: Path) -> Path:
    """test_pathlike_serialization: a Conv2d's state dict (upstream Conv2d(20, 3200, 3))."""
    with _seed():
        return _save(torch.nn.Conv2d(2, 32, kernel_size=3).state_dict(), tmp / "conv.pt")


@case("meta-serialization")
def _meta(tmp: Path) -> Path:
    """test_meta_serialization: a state dict of meta tensors (storages tagged 'meta', no bytes)."""
    return _save(torch.nn.Conv2d(20, 320, kernel_size=3, device="meta").state_dict(), tmp / "meta.pt")


@case("lr-scheduler-serialization")
def _lr_scheduler(tmp: Path) -> Path:
    """test_lr_scheduler_serialization: a OneCycleLR's state dict (plain numbers, strings, lists)."""
    sgd = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1, momentum=0.9)
    return _save(torch.optim.lr_scheduler.OneCycleLR(sgd, 6.0, total_steps=10).state_dict(), tmp / "sched.pt")


def _with_attrs(t: torch.Tensor) -> torch.Tensor:
    t.foo = "foo"  # type: ignore[attr-defined]
    t.pi = 3.14  # type: ignore[attr-defined]
    return t


@case("serialization-python-attr")
def _python_attr(tmp: Path) -> Path:
    """test_serialization_python_attr: a tensor with Python attributes (.foo, .pi) in its __dict__."""
    return _save(_with_attrs(torch.zeros(3, 3)), tmp / "attr_tensor.pt")


@case("serialization-python-attr-parameter")
def _python_attr_param(tmp: Path) -> Path:
    """test_serialization_python_attr: a Parameter with Python attributes."""
    return _save(_with_attrs(torch.nn.Parameter(torch.zeros(3, 3))), tmp / "attr_param.pt")


@case("parameter-requires-grad")
def _parameter(tmp: Path) -> Path:
    """test_cloned_deepcopy / test_serialization_save_warnings: a Parameter and a requires_grad tensor."""
    return _save({"p": torch.nn.Parameter(torch.ones(2)), "g": torch.ones(2, requires_grad=True),
                  "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}, tmp / "param.pt")


@case("serialization-byteorder-mark")
def _lstm(tmp: Path) -> Path:
    """test_serialization_byteorder_mark: an LSTM's state dict (its _metadata too), with the byteorder record."""
    with _seed():
        return _save(torch.nn.LSTM(3, 3).state_dict(), tmp / "lstm.pt")


@case("mmap-loading")
def _mmap(tmp: Path) -> Path:
    """test_serialization_mmap_loading: a two-Linear model's state dict (upstream loads it with mmap=True)."""
    with _seed():
        m = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Linear(64, 5))
    return _save(m.state_dict(), tmp / "mmap.pt")


@case("safe-load-basic-types")
def _basic(tmp: Path) -> Path:
    """test_safe_load_basic_types: a dict of an int, a str, a float and a bool."""
    return _save({"int": 123, "str": "world", "float": 3.14, "bool": False}, tmp / "basic.pt")


def _protocol(n: int, zip_format: bool) -> Make:
    def make(tmp: Path) -> Path:
        """Pickle protocols torch.save takes (pickle_protocol=2..5; upstream saves with the default, 2, and its
        legacy tests' files carry protocol 2 pickles): a small state dict, shared storage included."""
        with _seed():
            w = torch.randn(4, 4)
        sd = {"w": w, "t": w.t(), "b": torch.arange(4), "step": 7, "name": "x"}
        kind = "zip" if zip_format else "legacy"
        return _save(sd, tmp / f"proto{n}_{kind}.pt", pickle_protocol=n, _use_new_zipfile_serialization=zip_format)
    return make


for _n in (2, 3, 4, 5):
    case(f"pickle-protocol-{_n}")(_protocol(_n, True))
    case(f"pickle-protocol-{_n}-legacy")(_protocol(_n, False))


# -- save options: CRC-32, alignment, skip_data -------------------------------------------------------------

@case("crc32-disabled")
def _no_crc(tmp: Path) -> Path:
    """torch.serialization.set_crc32_options(False) (test_crc32_options): records written with no CRC-32."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with _seed():
            return _save({"w": torch.randn(8, 8), "b": torch.zeros(8)}, tmp / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(before)


@case("storage-alignment-4096")
def _alignment(tmp: Path) -> Path:
    """config.save.storage_alignment (test_storage_alignment): storages aligned to 4096 bytes, not 64."""
    from torch.utils.serialization import config

    before = config.save.storage_alignment
    config.save.storage_alignment = 4096
    try:
        with _seed():
            return _save({"w": torch.randn(8, 8), "b": torch.zeros(3)}, tmp / "aligned.pt")
    finally:
        config.save.storage_alignment = before


@case("skip-data")
def _skip_data(tmp: Path) -> Path:
    """torch.serialization.skip_data() (test_skip_data_serialization): the structure written, each storage's
    record reserved but never filled (zeros)."""
    with torch.serialization.skip_data():
        return _save({"w": torch.ones(4, 4), "b": torch.ones(4)}, tmp / "skip.pt")


@case("fake-tensor-save")
def _fake(tmp: Path) -> Path:
    """skip_data(materialize_fake_tensors=True) (test_skip_data_serialization's FakeTensorMode branch): a state
    dict of fake tensors saved as structure, each storage's record reserved (zeros)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        sd = torch.nn.Linear(3, 2).state_dict()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(sd, tmp / "fake.pt")
    return tmp / "fake.pt"


# -- big-endian and byteorder-less files (test_serialization_load_bom_data*) --------------------------------

BOM_DTYPES = ("lstm", "float64", "float32", "int64", "int32", "int16", "int8", "uint8", "bool", "bfloat16",
              "complex128", "complex64")


def _bom_object(name: str) -> Any:
    with _seed():
        if name == "lstm":
            return torch.nn.LSTM(3, 3).state_dict()
        dtype = getattr(torch, name)
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(2, 2, dtype=dtype)
        if dtype is torch.bool:
            return torch.randint(0, 2, [4, 4]).bool()
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), [4, 4], dtype=dtype)


def _big_endian(src: Path, out: Path, bom: bool) -> Path:
    """``src``'s records rewritten by torch's zip writer as a big-endian machine saves them: every storage
    byte-swapped by its element size, the byteorder record 'big' (or none)."""
    with zipfile.ZipFile(src) as z:
        records = {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}
    obj = torch.load(src, weights_only=True)
    sizes = {_storage_key(t, src): t.element_size() // (2 if t.is_complex() else 1)  # (each part of a complex)
             for t in (obj.values() if isinstance(obj, dict) else [obj])}
    writer = torch._C.PyTorchFileWriter(str(out))
    for name, data in records.items():
        if name == "byteorder":
            if bom:
                writer.write_record(name, b"big", 3)
            continue
        if name.startswith("data/") and sizes.get(name[5:], 1) > 1:
            data = _swap(data, sizes[name[5:]])
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return out


def _storage_key(t: torch.Tensor, src: Path) -> str:
    """The record key of ``t``'s storage: saved in dict order, keys '0', '1', ...; found by matching bytes."""
    data = bytes(t.untyped_storage())
    with zipfile.ZipFile(src) as z:
        for info in z.infolist():
            if "/data/" in info.filename and z.read(info) == data:
                return info.filename.rsplit("/", 1)[1]
    raise KeyError(src)


def _swap(data: bytes, size: int) -> bytes:
    return b"".join(data[i : i + size][::-1] for i in range(0, len(data), size))


def _bom(name: str, big: bool, bom: bool) -> Make:
    def make(tmp: Path) -> Path:
        """test_serialization_load_bom_data[_<dtype>]: a little- or big-endian file, with or without its
        byteorder record (a big-endian one without it torch reads as little-endian)."""
        label = f"{name}.{'BE' if big else 'LE'}{'.BOM' if bom else ''}"
        le = _save(_bom_object(name), tmp / f"{label}.le.pt", _disable_byteorder_record=not bom)
        if not big:
            return le
        return _big_endian(le, tmp / f"{label}.pt", bom)
    return make


for _name in BOM_DTYPES:
    for _big in (False, True):
        for _bom_record in (False, True):
            case(f"bom-{_name}-{'be' if _big else 'le'}{'-bom' if _bom_record else ''}")(_bom(_name, _big, _bom_record))


# -- what weights_only refuses: code, modules, subclasses, custom classes -----------------------------------

class _HelloWorld:
    def __reduce__(self) -> tuple:
        return print, ("Hello World!",)


@case("weights-only-assert")
def _hello(tmp: Path) -> Path:
    """test_weights_only_assert: a reduce to print('Hello World!')."""
    return _save(_HelloWorld(), tmp / "hello.pt")


class Net(torch.nn.Module):
    """A whole module saved: test_serialization_container's network1.Net."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(10, 20)


@case("serialization-container")
def _container(tmp: Path) -> Path:
    """test_serialization_container: torch.save(module.Net()), the whole module pickled."""
    return _save(Net(), tmp / "net.pt")


@case("serialization-save-warnings")
def _linear_module(tmp: Path) -> Path:
    """test_serialization_save_warnings: torch.save(torch.nn.Linear(2, 3)), a whole torch module."""
    return _save(torch.nn.Linear(2, 3), tmp / "linear_module.pt")


class WrapperSubclass(torch.Tensor):
    """test_serialization's TestWrapperSubclass: a meta wrapper holding the real tensor in ``elem``."""
    elem: torch.Tensor
    __slots__ = ["elem", "other"]

    @staticmethod
    def __new__(cls, elem: torch.Tensor, *args: Any, **kwargs: Any) -> WrapperSubclass:
        r = torch.Tensor._make_subclass(cls, elem.to("meta"), elem.requires_grad)
        r.elem = elem
        return r  # type: ignore[no-any-return]


class EmptySubclass(torch.Tensor):
    """test_serialization's TestEmptySubclass."""


@case("tensor-subclass-wrapper")
def _wrapper(tmp: Path) -> Path:
    """test_tensor_subclass_wrapper_serialization: a wrapper subclass with a .foo attribute."""
    t = WrapperSubclass(torch.ones(2))
    t.foo = "bar"  # type: ignore[attr-defined]
    return _save(t, tmp / "wrapper.pt")


@case("empty-class-serialization")
def _empty_subclass(tmp: Path) -> Path:
    """test_empty_class_serialization: a plain subclass of torch.Tensor."""
    return _save(EmptySubclass([1.0]), tmp / "empty_subclass.pt")


class BuildClass:
    """A class restored with BUILD (test_weights_only_safe_globals_build's ClassThatUsesBuildInstruction)."""

    def __init__(self, num: int) -> None:
        self.num = num

    def __reduce_ex__(self, proto: int) -> tuple:
        return BuildClass, (0,), {"num": self.num}


class NewobjClass:
    """A class made by NEWOBJ (test_weights_only_safe_globals_newobj's Point-like class)."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __getnewargs__(self) -> tuple:
        return (self.x,)

    def __new__(cls, x: int = 0) -> NewobjClass:
        return super().__new__(cls)


@case("safe-globals-build")
def _build(tmp: Path) -> Path:
    """test_weights_only_safe_globals_build: refused unless add_safe_globals names the class."""
    return _save({"w": torch.ones(2), "obj": BuildClass(3)}, tmp / "build.pt")


@case("safe-globals-newobj")
def _newobj(tmp: Path) -> Path:
    """test_weights_only_safe_globals_newobj: refused unless add_safe_globals names the class."""
    return _save({"w": torch.ones(2), "obj": NewobjClass(3)}, tmp / "newobj.pt", pickle_protocol=4)


#: The cases with what weights_only refuses by design: scan may report them.
RISKY = {"weights-only-assert", "serialization-container", "serialization-save-warnings", "tensor-subclass-wrapper",
         "empty-class-serialization", "safe-globals-build", "safe-globals-newobj"}


def build(tmp: Path) -> Iterator[tuple[str, Path]]:
    """Every case's file, each made in its own folder under ``tmp``."""
    for name, make in CASES.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        yield name, make(tmp / name)


#: Files torch.save writes with pickle_protocol 4 or 5: their FRAME opcode is one torch's weights_only unpickler
#: does not implement ("Unsupported operand 149"), so it refuses files torch itself wrote; ckptfix reads them
#: (framing is no code). tests/formats/test_public_torch_corpus.py compares them with torch's full unpickler.
FRAMED = {f"pickle-protocol-{n}{kind}" for n in (4, 5) for kind in ("", "-legacy")}

#: The cases whose file is a dict of dense tensors ckptfix reads (convert's input); one dtype's byteorder variants
#: stand for the rest (tests/ops/test_plain_loadable.py converts each to every output format).
CONVERTS = {"pathlike-serialization", "mmap-loading", "serialization-byteorder-mark", "parameter-requires-grad",
            "crc32-disabled", "storage-alignment-4096", "skip-data", "fake-tensor-save",
            *(f"bom-lstm-{v}" for v in ("le", "le-bom", "be", "be-bom")),
            *(f"dtype-{name}" for name in DTYPES if not name.startswith(("bits", "float4", "complex")))}
