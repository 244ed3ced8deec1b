"""Differential tests: ckptfix's readers see what torch's own readers see.

- ``ckptfix.parse.zipdir`` (the zip directory as torch's miniz reads it) against ``torch._C.PyTorchFileReader``
  on every committed fixture, the adversarial corpus and a few hundred seeded mutations of a real
  archive: wherever torch reads an archive, ckptfix lists the same records at the same offsets.
- ckptfix's restricted unpickler against ``torch.load``: random state dicts and training extras load
  to the same objects (bit-exact tensors, same views and sharing) as torch's full unpickler gives for
  files this test wrote itself; and every file torch's ``weights_only`` unpickler refuses, ckptfix
  refuses too (it is stricter, never looser).
"""

from __future__ import annotations

import argparse
import copy
import collections
import io
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.core.devices import DevicePlan, NeedsValues
from ckptfix.core.torch_free import NeedsTorch
from ckptfix.errors import CkptfixError
from ckptfix.formats.torchsave import records
from ckptfix.parse.format_registry import TORCH_ZIP
from ckptfix.safety import scanner
from ckptfix.parse.zipdir import ZipFormatError, data_start, read_directory
from tests import adversarial, hostile_files, public_torch_corpus
from tests.compare import raw_bytes, torch_refuses
from tests.describe_both import fixture_paths
from tests.malformed_files import mutations
from tests.strategies import state_dicts

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


def torch_view(data: bytes) -> dict[str, int] | None:
    """Record name (under the root) → data offset, as torch's reader gives them; None if it refuses."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        return {name: reader.get_record_offset(name) for name in reader.get_all_records()}
    except (RuntimeError, ValueError):
        return None


def ckptfix_view(data: bytes) -> dict[str, set[int]] | None:
    """Record name → every offset ckptfix's reader could give for it (names equal but for case count
    as one, as torch looks them up); None if it refuses."""
    try:
        directory = read_directory(data, len(data))
        out: dict[str, set[int]] = {}
        root = directory.root + "/"
        for entry in directory.entries:
            if entry.name.startswith(root):
                for candidate in directory.lookup(entry.name):
                    out.setdefault(entry.name[len(root):], set()).add(data_start(data, len(data), candidate)[0])
        return out
    except (ZipFormatError, ValueError, IndexError):
        return None


def assert_same_view(data: bytes, label: str) -> None:
    theirs, ours = torch_view(data), ckptfix_view(data)
    if theirs is None:
        return  # torch checks more than the directory (a version record, one root): it may refuse more
    assert ours is not None, f"{label}: torch reads it, ckptfix's zip reader refuses it"
    assert set(theirs) == set(ours), f"{label}: records differ"
    for name, offset in theirs.items():
        assert offset in ours[name], f"{label}: {name} at {offset} for torch, {ours[name]} for ckptfix"


def _zips() -> list[Path]:
    return sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.suffix != ".distcp"
                  and p.read_bytes()[:4] == b"PK\x03\x04")


@pytest.mark.parametrize("path", _zips(), ids=lambda p: p.name)
def test_zip_reader_agrees_with_torch_on_fixtures(path: Path) -> None:
    assert_same_view(path.read_bytes(), path.name)
    assert torch_view(path.read_bytes()) is not None


def test_zip_reader_agrees_with_torch_on_the_corpus(tmp_path: Path) -> None:
    checked = 0
    for case in adversarial.build_corpus(tmp_path):
        data = case.path.read_bytes()
        if data[:4] == b"PK\x03\x04":
            assert_same_view(data, case.name)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("seed", range(4))
def test_zip_reader_agrees_with_torch_on_damaged_archives(seed: int) -> None:
    agreed = 0
    for label, data in mutations(seed, 100):
        assert_same_view(data, label)
        agreed += torch_view(data) is not None
    assert agreed >= 10  # enough mutations that torch still reads, for the comparison to mean something


# -- the unpickler ----------------------------------------------------------------------------------------

def same(a: Any, b: Any, path: str = "") -> None:
    """Structural equality: types, tensors bit for bit (dtype, shape, stride), numpy arrays and dtypes."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset()), path
        assert torch.equal(raw_bytes(a), raw_bytes(b)), path  # bit for bit: NaN payloads and -0.0 included
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple, collections.deque)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, argparse.Namespace) or type(a).__eq__ is object.__eq__ and isinstance(getattr(a, "__dict__", None), dict):
        same(vars(a), vars(b), path)  # (an object without its own equality, a stand-in say: by its attributes)
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def _sharing(sd: dict) -> list[tuple[str, str]]:
    keys = [k for k, v in sd.items() if isinstance(v, torch.Tensor)]
    return [(x, y) for x in keys for y in keys if x < y and sd[x].untyped_storage().data_ptr()
            == sd[y].untyped_storage().data_ptr() and sd[x].untyped_storage().nbytes() > 0]


extras = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8),
              st.binary(max_size=8), st.complex_numbers(allow_nan=False),
              st.sampled_from([np.float32(0.5), np.int64(-3), np.dtype("float16"), np.arange(3, dtype=np.uint8),
                               np.zeros((2, 2), dtype=">f8", order="F"), argparse.Namespace(lr=0.1)])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3),
                            st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=4), inner, max_size=2)),
                            st.builds(lambda xs: collections.deque(xs, maxlen=5), st.lists(inner, max_size=3)),
                            st.frozensets(st.integers(), max_size=3).map(set)),
    max_leaves=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(sd=state_dicts(), extra=extras, legacy=st.booleans(), protocol=st.sampled_from([2, 4]))
def test_unpickler_loads_what_torch_loads(sd: Any, extra: Any, legacy: bool, protocol: int, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    torch.save({"model": sd, "extra": extra}, path, _use_new_zipfile_serialization=not legacy,
               pickle_protocol=protocol)
    truth = torch.load(path, weights_only=False)  # this test wrote the file: full unpickling is its ground truth
    ours = ckptfix.read(path)
    same(ours.raw, truth)
    assert _sharing(ours.raw["model"]) == _sharing(truth["model"])
    if not legacy:  # the read a GPU load takes (every storage read through staging windows), here onto the CPU
        staged = records.read_onto(str(path), DevicePlan("cpu"), staged=lambda _dev: True)
        if staged is None:  # (no storage with bytes to read: torch's reader serves)
            assert all(t.untyped_storage().nbytes() == 0 for _k, t in _flat(truth))
        else:
            same(staged.obj, truth)
            assert _sharing(staged.obj["model"]) == _sharing(truth["model"])
    meta = ckptfix.inspect(path)  # the structure-only reader (on meta) sees the same shapes and strides
    for k, t in truth["model"].items():
        got = meta.state_dict[k]
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (t.dtype, t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("path", [p for p in fixture_paths() if p.is_file() and zipfile.is_zipfile(p)],
                         ids=lambda p: p.name)
def test_the_staged_read_gives_what_torchs_reader_gives(path: Path) -> None:
    """Every committed torch zip read as a GPU load reads it (each storage through staging windows; here onto the
    CPU): the objects ``torch.load`` builds through ckptfix's reader, ties kept; or a fall-back to it (NeedsValues,
    NeedsTorch: quantized, nested, big-endian), or the same refusal."""
    try:
        want = ckptfix.read(path).raw
    except CkptfixError:
        with pytest.raises(CkptfixError):  # (read_file scans the file first, as before any structure read)
            scanner.ensure_safe(str(path), TORCH_ZIP, unpickled_by_caller="data.pkl", placeholders=True)
            records.read_onto(str(path), DevicePlan("cpu"), staged=lambda _dev: True)
        return
    try:
        got = records.read_onto(str(path), DevicePlan("cpu"), staged=lambda _dev: True)
    except (NeedsValues, NeedsTorch):
        return  # (read_file falls back to torch.load's path)
    assert got is not None
    same(got.obj, want)
    tensors = [(k, v) for k, v in _flat(want)]
    assert _sharing(dict(_flat(got.obj))) == _sharing(dict(tensors))


def test_a_staged_read_maps_the_storages_it_does_not_stage(tmp_path: Path) -> None:
    """Storages bound for a device that isn't staged are slices of the file's mapping (as torch.load(mmap=True)
    makes them), beside staged ones: here every other storage, onto the CPU; ties and views kept."""
    w = torch.randn(40, 30)
    sd = {"w": w, "tied": w, "view": w[3:7], "b": torch.randn(500).bfloat16(), "i": torch.arange(9),
          "x": torch.randn(3, 3, dtype=torch.float64), "empty": torch.empty(0)}
    torch.save(sd, tmp_path / "m.pth")
    calls = iter([True] + [n % 2 == 0 for n in range(100)])  # (the first: "is anything staged?")
    got = records.read_onto(str(tmp_path / "m.pth"), DevicePlan("cpu"), staged=lambda _dev: next(calls))
    assert got is not None
    same(got.obj, torch.load(tmp_path / "m.pth", weights_only=True))
    assert _sharing(got.obj) == _sharing(sd)
    mapped = [k for k, v in got.obj.items() if v.untyped_storage().nbytes() and _mapped(v)]
    assert mapped and len(mapped) < 6  # (some storages mapped, some filled)


def _mapped(t: torch.Tensor) -> bool:
    """The tensor's bytes lie in a file mapping (a MAP_PRIVATE file page), as /proc/self/maps says."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, _perms, _off, _dev, inode, *path = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return inode != "0" and bool(path)
    return False


def _flat(obj: Any, where: str = "") -> list[tuple[str, Any]]:
    """Every tensor in ``obj`` with its path."""
    if isinstance(obj, torch.Tensor):
        return [(where, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _flat(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _flat(v, f"{where}[{i}]")]
    return []


def test_ckptfix_refuses_everything_torchs_weights_only_refuses(tmp_path: Path) -> None:
    files = [(c.path, False) for c in adversarial.build_corpus(tmp_path / "corpus")]
    for case in hostile_files.CASES:
        (tmp_path / case.name).mkdir()
        files.append((case.make(tmp_path / case.name), "nested" in case.name))
    refused_by_torch = 0
    for path, crashes_torch in files:
        if not torch_refuses(path, in_child=crashes_torch):
            continue
        refused_by_torch += 1
        with pytest.raises(CkptfixError):
            ckptfix.load(path)
    assert refused_by_torch >= 30


def test_torchs_own_unpickler_crashes_on_a_deep_dict_key(tmp_path: Path) -> None:
    """Why ckptfix bounds the depth of what it hashes: torch's weights_only unpickler dies on this file."""
    path = hostile_files.BY_NAME["million-nested-dict-key"].make(tmp_path)
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=True)"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert out.returncode < 0  # killed by a signal (SIGSEGV), not an exception
    with pytest.raises(CkptfixError, match="max_depth"):
        ckptfix.load(path)


# -- torch's own test_serialization files ------------------------------------------------------------------------

def _same_loaded(a: Any, b: Any, path: str = "") -> None:
    """``same``, and what torch's rebuilds set beyond a dense tensor's bytes: layout (sparse parts), quantizer,
    conj/neg bits, Python attributes, meta tensors' metadata, storages (type, dtype, bytes)."""
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.layout == b.layout and a.is_quantized == b.is_quantized, (path, a, b)
        assert (a.is_conj(), a.is_neg(), a.requires_grad, a.device.type) == (b.is_conj(), b.is_neg(), b.requires_grad,
                                                                           b.device.type), path
        _same_loaded(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}), f"{path}.__dict__")
        if a.is_sparse:
            _same_loaded((a._indices(), a._values(), a.shape), (b._indices(), b._values(), b.shape), path)
        elif a.layout != torch.strided:
            _same_loaded((a.values(), a.shape), (b.values(), b.shape), path)
            for parts in ("crow_indices", "col_indices") if a.layout in (torch.sparse_csr, torch.sparse_bsr) else \
                    ("ccol_indices", "row_indices"):
                _same_loaded(getattr(a, parts)(), getattr(b, parts)(), f"{path}.{parts}")
        elif a.is_quantized:
            assert a.qscheme() == b.qscheme(), path
            _same_loaded(a.int_repr(), b.int_repr(), path)
            if a.qscheme() == torch.per_tensor_affine:
                assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()), path
            else:
                _same_loaded((a.q_per_channel_scales(), a.q_per_channel_zero_points()),
                             (b.q_per_channel_scales(), b.q_per_channel_zero_points()), path)
        elif a.device.type == "meta":
            assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        else:
            same(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg(), path)
            assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), path
    elif isinstance(a, (torch.storage.TypedStorage, torch.UntypedStorage)):
        assert type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None), (path, a, b)
        assert a.device.type == b.device.type and a.nbytes() == b.nbytes(), path
        if a.device.type != "meta":
            assert bytes(a.untyped() if isinstance(a, torch.storage.TypedStorage) else a) == \
                bytes(b.untyped() if isinstance(b, torch.storage.TypedStorage) else b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            _same_loaded(a[k], b[k], f"{path}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_loaded(x, y, f"{path}[{i}]")
    else:
        same(a, b, path)


def _storages(obj: Any, where: str = "") -> list[tuple[str, Any]]:
    """Every tensor's and storage's root storage in ``obj``, by path (sparse and quantized tensors' left out)."""
    if isinstance(obj, torch.Tensor):
        dense = obj.layout == torch.strided and not obj.is_quantized and obj.device.type != "meta"
        return [(where, obj.untyped_storage())] if dense else []
    if isinstance(obj, torch.storage.TypedStorage):
        return [(where, obj.untyped())] if obj.device.type != "meta" else []
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in _storages(v, f"{where}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _storages(v, f"{where}[{i}]")]
    return []


def _shared(obj: Any) -> list[tuple[str, str, int]]:
    """Which paths share storage memory, and at what byte distance (views of one storage, slices of a root)."""
    found = [(p, s.data_ptr(), s.nbytes()) for p, s in _storages(obj) if s.nbytes()]
    return [(x, y, py - px) for x, px, nx in found for y, py, ny in found
            if x < y and (px <= py < px + nx or py <= px < py + ny)]


#: where torch's two loaders disagree with each other, and ckptfix's mapped read gives what torch.load(mmap=True) gives
MMAP_DIFFERS = {"save-different-dtype-unallocated": "a zero-byte TypedStorage over an empty tensor's storage takes "
                                                    "that tensor's dtype under mmap=True, its own without"}


@pytest.mark.parametrize("name", list(public_torch_corpus.CASES))
def test_torchs_own_test_files_read_as_torch_loads_them(name: str, tmp_path: Path) -> None:
    """Each file torch's test/test_serialization.py saves or embeds (tests/public_torch_corpus.py): ``ckptfix.read``
    gives what ``torch.load(weights_only=True)`` gives, bit for bit, with the same sharing; what torch refuses,
    ckptfix refuses in one CkptfixError; ``scan`` finds nothing in a benign file. (Files with FRAME opcodes, which
    torch's weights_only unpickler lacks: against its full unpickler, this test having written them; where torch's
    mapped and unmapped loads disagree, :data:`MMAP_DIFFERS`: against the mapped one, which ckptfix's read is.)"""
    path = public_torch_corpus.CASES[name](tmp_path)
    weights_only = name not in public_torch_corpus.FRAMED
    if name in MMAP_DIFFERS:  # (still so: else this entry goes)
        with pytest.raises(AssertionError):
            _same_loaded(torch.load(path, weights_only=True, mmap=True), torch.load(path, weights_only=True), name)
    try:
        truth = torch.load(path, weights_only=weights_only, map_location="cpu", mmap=name in MMAP_DIFFERS)
    except Exception:  # any refusal or failure counts, as in torch_refuses
        truth = refused = None
    else:
        refused = False
    if name in public_torch_corpus.FRAMED:
        with pytest.raises(Exception, match="Unsupported operand 149"):  # FRAME: torch's weights_only can't
            torch.load(path, weights_only=True)
    if refused is None:
        with pytest.raises(CkptfixError) as e:
            ckptfix.read(path)
        assert "\n" not in str(e.value).strip() and "a bug in ckptfix" not in str(e.value)
    else:
        ours = ckptfix.read(path, map_location="cpu").raw
        _same_loaded(ours, truth, name)
        assert _shared(ours) == _shared(truth), name
    if name not in public_torch_corpus.RISKY:
        try:
            report = ckptfix.scan(path)
        except CkptfixError:  # not a checkpoint (a pickle then a torch file; gzip): refused in one line
            assert refused is None, name
        else:
            assert not report.findings, (name, report.findings)


def test_a_torch_031_storage_slice_is_described(tmp_path: Path) -> None:
    """torch's legacy loader can't slice a root storage on meta ("Not available for 'meta' device type"): a structure
    read of a torch <= 0.3 file with storage views reads its values on the CPU instead of refusing the file."""
    path = public_torch_corpus.CASES["storage-slice-torch031"](tmp_path)
    truth = torch.load(path, weights_only=True)
    for verb in (ckptfix.describe, ckptfix.inspect):
        _same_loaded(verb(path).raw, truth, verb.__name__)


def _devices(obj: Any) -> list[str]:
    """Every tensor's and storage's device type in ``obj``, in order."""
    if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
        return [obj.device.type]
    if isinstance(obj, dict):
        return [d for v in obj.values() for d in _devices(v)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in _devices(v)]
    return []


def _cpu(obj: Any) -> Any:
    """``obj`` with every tensor and storage copied to the CPU (containers rebuilt, ``_metadata`` kept; meta's kept)."""
    if isinstance(obj, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
        return obj if obj.device.type == "meta" else obj.cpu()
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _cpu(v)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_cpu(v) for v in obj]
        return type(obj)(items) if type(obj) in (list, tuple) else obj
    return obj


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(public_torch_corpus.CASES) - public_torch_corpus.FRAMED - set(MMAP_DIFFERS)))
def test_torchs_own_test_files_read_onto_a_gpu_as_torch_loads_them(name: str, tmp_path: Path) -> None:
    """``map_location="cuda"``: a torch zip's storages read through staging windows (``records.read_onto``), a legacy
    file through torch.load: what ``torch.load(weights_only=True, map_location="cuda")`` gives, on the same devices,
    bit for bit; what torch refuses, one CkptfixError."""
    path = public_torch_corpus.CASES[name](tmp_path)
    try:
        truth = torch.load(path, weights_only=True, map_location="cuda")
    except Exception:  # any refusal or failure counts, as in torch_refuses
        with pytest.raises(CkptfixError):
            ckptfix.read(path, map_location="cuda")
        return
    ours = ckptfix.read(path, map_location="cuda").raw
    assert _devices(ours) == _devices(truth), name
    _same_loaded(_cpu(ours), _cpu(truth), name)
