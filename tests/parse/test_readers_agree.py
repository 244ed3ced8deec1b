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
from tests import adversarial, hostile_files
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
