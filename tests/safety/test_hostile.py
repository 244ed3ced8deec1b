"""Hostile files that run no code but attack the reader: memory unsafety, uninitialised memory,
resource bombs, out-of-bounds views, metadata that contradicts the file.

Each is refused (one ``Error:`` line, exit 1; ``scan`` exit 3 where it is a finding) without a crash,
without an output file and within the limits (docs/security.md "Limits"). Cases that crash or leak under a
naive reader run in a child process, so a segfault fails the test instead of killing the run.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError, LimitError, UnsafeCheckpointError
from ckptfix.parse.legacy_tar import opens_as_tar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adversarial import LEGACY_MAGIC, call, glob, proto, tup, u, write_zip  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save deprecation


# -- pickle assembly ------------------------------------------------------------------------------------

def num(n: int) -> bytes:
    """The opcodes pickle writes for the int ``n``."""
    return pickle.dumps(n, protocol=2)[2:-1]


def pid(key: str, numel: int, storage: str = "FloatStorage", legacy: bool = False) -> bytes:
    """A torch storage persistent id: ('storage', torch.<storage>, key, 'cpu', numel) (a legacy file's
    has a sixth item, the view: None), BINPERSID."""
    return tup(u("storage"), glob("torch", storage), u(key), u("cpu"), num(numel), *([b"N"] if legacy else [])) + b"Q"


def rebuild(key: str, numel: int, offset: int, size: tuple, stride: tuple, storage: str = "FloatStorage",
            legacy: bool = False) -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""
    return call(glob("torch._utils", "_rebuild_tensor_v2"), pid(key, numel, storage, legacy), num(offset),
                tup(*map(num, size)), tup(*map(num, stride)), b"\x89", call(glob("collections", "OrderedDict")))


def latin1(raw: bytes) -> bytes:
    """Bytes as protocol 2 writes them: ``_codecs.encode(str, 'latin1')``."""
    return call(glob("_codecs", "encode"), u(raw.decode("latin1")), u("latin1"))


def state(**entries: bytes) -> bytes:
    """A protocol-2 pickle of ``{name: value}`` from each value's opcodes."""
    body = b"".join(u(k) + v + b"s" for k, v in entries.items())
    return proto(2) + b"}" + body + b"."


def torch_zip(path: Path, data_pkl: bytes, records: dict[str, bytes], method: int = 0) -> Path:
    members: list = [("archive/data.pkl", data_pkl, method), ("archive/byteorder", b"little")]
    members += [(f"archive/data/{k}", v) for k, v in records.items()] + [("archive/version", b"3\n")]
    write_zip(path, members)
    return path


def legacy_file(path: Path, main: bytes, keys: list[str], storages: dict[str, bytes],
                sys_info: bytes | None = None) -> Path:
    """A legacy (non-zip) torch file: magic, protocol, sys_info, ``main``, the storage keys, then for
    each listed key its int64 element count and bytes (float32 elements)."""
    sys_info = sys_info or pickle.dumps({"protocol_version": 1001, "little_endian": True,
                                         "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    out = pickle.dumps(LEGACY_MAGIC, protocol=2) + pickle.dumps(1001, protocol=2) + sys_info + main
    out += pickle.dumps(keys, protocol=2)
    for key in keys:
        out += struct.pack("<q", len(storages[key]) // 4) + storages[key]
    path.write_bytes(out)
    return path


FOUR = struct.pack("<4f", 1, 2, 3, 4)
SECRET = b"SECRET-SECRET-16"


# -- the cases ------------------------------------------------------------------------------------------

@dataclass
class Hostile:
    name: str
    make: Callable[[Path], Path]
    error: type  # what loading raises
    says: str  # in the one-line message
    scan: str | None  # the scan finding kind, or None when scan has nothing to say (exit 0)


def _object_field_dtype() -> bytes:
    """The opcodes of numpy's pickle of ``dtype([('a', 'O')])`` with its flags (27: holds objects) set
    to 0: numpy's ``__setstate__`` takes them as given."""
    opcodes = pickle.dumps(np.dtype([("a", "O")]), protocol=2)[2:-1]
    at = opcodes.rindex(b"K\x1bt")
    return opcodes[:at] + b"K\x00t" + opcodes[at + 3 :]


def _numpy_object_dtype(tmp: Path) -> Path:
    """numpy's dtype state declares an object field while its flags claim no objects; the array's
    raw bytes (0x4141…) then become a PyObject pointer: a segfault under numpy's own __setstate__."""
    structured = _object_field_dtype()
    array = (call(glob("numpy._core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), tup(b"K\x00"), latin1(b"b"))
             + tup(b"K\x01", tup(b"K\x01"), structured, b"\x89", latin1(b"A" * 8)) + b"b")
    return torch_zip(tmp / "numpy.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), history=array), {"0": FOUR})


def _numpy_scalar_object(tmp: Path) -> Path:
    structured = _object_field_dtype()
    scalar = call(glob("numpy._core.multiarray", "scalar"), structured, latin1(b"A" * 8))
    return torch_zip(tmp / "scalar.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), step=scalar), {"0": FOUR})


def _uninitialised(constructor: bytes, args: bytes, op: bytes = b"R") -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        value = constructor + args + op
        return torch_zip(tmp / "uninit.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), leak=value), {"0": FOUR})

    return make


def _view(offset: int, size: tuple, stride: tuple) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        return torch_zip(tmp / "view.pth", state(w=rebuild("0", 4, offset, size, stride)), {"0": FOUR, "1": SECRET})

    return make


def _legacy_unfilled(tmp: Path) -> Path:
    main = state(w=rebuild("0", 4, 0, (4,), (1,), legacy=True), v=rebuild("1", 4, 0, (4,), (1,), legacy=True))
    return legacy_file(tmp / "unfilled.pth", main, ["0"], {"0": FOUR})


def _bytearray_bomb(tmp: Path) -> Path:
    return torch_zip(tmp / "bomb.pth", state(w=rebuild("0", 4, 0, (4,), (1,)),
                                             x=call(glob("builtins", "bytearray"), num(2_500_000_000))), {"0": FOUR})


def _sys_info_bomb(tmp: Path) -> Path:
    bomb = proto(2) + call(glob("builtins", "bytearray"), num(2_500_000_000)) + b"."
    return legacy_file(tmp / "sysinfo.pth", state(w=rebuild("0", 4, 0, (4,), (1,), legacy=True)), ["0"], {"0": FOUR},
                       bomb)


def _amplified_set(tmp: Path) -> Path:
    """A 300 KB pickle asking for 20,000 sets of one memoized 10,000-element list: 2·10^8 elements."""
    items = b"]q\x00(" + b"K\x01" * 10_000 + b"e"
    sets = b"](" + (glob("builtins", "set") + b"h\x00\x85R") * 20_000 + b"e"
    return torch_zip(tmp / "amplified.pth", proto(2) + b"}" + u("w") + rebuild("0", 4, 0, (4,), (1,)) + b"s"
                     + u("items") + items + b"s" + u("sets") + sets + b"s.", {"0": FOUR})


def _deflate_bomb(tmp: Path) -> Path:
    """data.pkl deflated: 200 KB of file inflating to 256 MiB (torch never compresses a member)."""
    path = tmp / "deflated.pth"
    torch_zip(path, state(w=rebuild("0", 4, 0, (4,), (1,))), {"0": FOUR})
    raw = bytearray(path.read_bytes())
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = bomb.compress(b"\x00" * (256 << 20)) + bomb.flush()
    write_zip(path, [("archive/data.pkl", payload, 0), ("archive/byteorder", b"little"), ("archive/data/0", FOUR),
                     ("archive/version", b"3\n")])
    raw = bytearray(path.read_bytes())
    for sig, method_at, size_at in ((b"PK\x03\x04", 8, 22), (b"PK\x01\x02", 10, 24)):  # mark it deflated
        at = raw.find(sig + (b"\x14\x00" if sig == b"PK\x03\x04" else b""))
        raw[at + method_at : at + method_at + 2] = b"\x08\x00"
        raw[at + size_at : at + size_at + 4] = struct.pack("<I", 256 << 20)
    path.write_bytes(bytes(raw))
    return path


def _deep(kind: str) -> Callable[[Path], Path]:
    """A million nested containers: tuples, or a tuple as a dict key (hashing it recurses in C)."""

    def make(tmp: Path) -> Path:
        deep = b"N" + b"\x85" * 1_000_000
        value = deep if kind == "tuples" else b"}" + deep + b"Ns"
        return torch_zip(tmp / "deep.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), deep=value), {"0": FOUR})

    return make


def _stride0_expansion(tmp: Path) -> Path:
    return torch_zip(tmp / "expand.pth", state(w=rebuild("0", 1, 0, (1 << 27,), (0,))), {"0": FOUR[:4]})


CASES = [
    Hostile("numpy-object-dtype-array", _numpy_object_dtype, UnsafeCheckpointError, "plain numeric", "unsafe-construct"),
    Hostile("numpy-object-dtype-scalar", _numpy_scalar_object, UnsafeCheckpointError, "plain numeric", "unsafe-construct"),
    Hostile("byte-tensor-uninitialised", _uninitialised(glob("torch", "ByteTensor"), tup(num(4096))),
            UnsafeCheckpointError, "uninitialised memory", "unsafe-construct"),
    Hostile("untyped-storage-uninitialised", _uninitialised(glob("torch.storage", "UntypedStorage"), tup(num(4096))),
            UnsafeCheckpointError, "uninitialised memory", "unsafe-construct"),
    Hostile("tensor-class-newobj", _uninitialised(glob("torch", "FloatTensor"), tup(num(1024)), b"\x81"),
            UnsafeCheckpointError, "FloatTensor", "unsafe-construct"),
    Hostile("view-past-storage", _view(0, (8,), (1,)), UnsafeCheckpointError, "out of bounds", "unsafe-construct"),
    Hostile("view-offset-past-storage", _view(6, (2,), (1,)), UnsafeCheckpointError, "out of bounds", "unsafe-construct"),
    Hostile("view-negative-stride", _view(3, (4,), (-1,)), UnsafeCheckpointError, "negative", "unsafe-construct"),
    Hostile("legacy-declared-never-filled", _legacy_unfilled, UnsafeCheckpointError, "uninitialised", "uninitialised"),
    Hostile("bytearray-bomb", _bytearray_bomb, UnsafeCheckpointError, "max_alloc_bytes", "unsafe-construct"),
    Hostile("legacy-sys-info-bomb", _sys_info_bomb, UnsafeCheckpointError, "max_alloc_bytes", "unsafe-construct"),
    Hostile("memoized-set-amplification", _amplified_set, LimitError, "max_alloc_bytes", None),
    Hostile("deflate-bomb", _deflate_bomb, UnsafeCheckpointError, "compressed", "resource-limit"),
    Hostile("million-nested-tuples", _deep("tuples"), UnsafeCheckpointError, "max_depth", "unsafe-construct"),
    Hostile("million-nested-dict-key", _deep("key"), UnsafeCheckpointError, "max_depth", "unsafe-construct"),
]
BY_NAME = {c.name: c for c in CASES}


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("name", list(BY_NAME))
def test_library_refuses_without_crashing(name: str, tmp_path: Path) -> None:
    case = BY_NAME[name]
    path = case.make(tmp_path)
    with pytest.raises(case.error, match=case.says):
        ckptfix.load(path)
    report = ckptfix.scan(path)
    if case.scan is None:
        assert report.ok
    else:
        assert not report.ok and case.scan in {f.kind for f in report.findings}, report.findings


@pytest.mark.parametrize("name", ["numpy-object-dtype-array", "numpy-object-dtype-scalar", "million-nested-tuples",
                                  "million-nested-dict-key", "view-past-storage", "legacy-declared-never-filled"])
@pytest.mark.parametrize("command", ["inspect", "convert", "scan"])
def test_cli_refuses_in_one_line_and_writes_nothing(name: str, command: str, tmp_path: Path) -> None:
    """A real process each: a segfault or a traceback fails here, not the test run."""
    path = BY_NAME[name].make(tmp_path)
    before = path.read_bytes()
    args = {"inspect": ["inspect", str(path)], "scan": ["scan", str(path)],
            "convert": ["convert", str(path), str(tmp_path / "out.safetensors")]}[command]
    out = _cli(*args)
    assert out.returncode == (3 if command == "scan" else 1), (out.returncode, out.stderr[-2000:])
    if command != "scan":
        assert out.stderr.startswith("Error: ") and out.stderr.count("\n") == 1 and out.stdout == "", out.stderr
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_out_of_bounds_view_never_copies_the_next_record(tmp_path: Path) -> None:
    path = _view(0, (8,), (1,))(tmp_path)
    for dst in ("o.pth", "o.safetensors"):
        with pytest.raises(UnsafeCheckpointError, match="out of bounds"):
            ckptfix.convert(path, tmp_path / dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_stride0_view_loads_but_is_not_expanded_into_gigabytes(tmp_path: Path, cli_runner) -> None:
    """A 4-byte storage seen as a 512 MiB tensor: loading keeps it a view, the .pth keeps the one
    element, safetensors (which can't store a stride) refuses beyond max_expand_bytes."""
    path = _stride0_expansion(tmp_path)
    t = ckptfix.load(path)["w"]
    assert t.shape == (1 << 27,) and t.stride() == (0,) and t.untyped_storage().nbytes() == 4
    assert ckptfix.scan(path).ok
    report = ckptfix.convert(path, tmp_path / "o.pth")
    assert (tmp_path / "o.pth").stat().st_size < 4096 and report.streamed
    assert torch.equal(ckptfix.load(tmp_path / "o.pth")["w"][:3], torch.ones(3))
    res = cli_runner.invoke(cli, ["convert", str(path), str(tmp_path / "o.safetensors")])
    assert res.exit_code == 1 and "max_expand_bytes" in res.stderr and "CKPTFIX_MAX_EXPAND_BYTES" in res.stderr
    assert not (tmp_path / "o.safetensors").exists() and not list(tmp_path.glob(".o.safetensors*"))
    with ckptfix.core.limits.override(max_expand_bytes=1 << 30):  # raised on purpose: written out in full
        ckptfix.convert(path, tmp_path / "o.safetensors")
    assert (tmp_path / "o.safetensors").stat().st_size > 1 << 29


def test_limits_are_documented_and_overridable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = (ROOT / "docs" / "security.md").read_text().split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    for name, var in ckptfix.core.limits.ENV.items():
        assert f"`{var}`" in docs and f"`{name}`" in docs, name
    path = _deep("tuples")(tmp_path)
    monkeypatch.setenv("CKPTFIX_MAX_DEPTH", "2000000")  # the user raises it: the file loads
    assert torch.equal(ckptfix.load(path)["w"], torch.tensor([1.0, 2, 3, 4]))
    monkeypatch.setenv("CKPTFIX_MAX_DEPTH", "deep")
    with pytest.raises(LimitError, match="CKPTFIX_MAX_DEPTH='deep' is not a whole number"):
        ckptfix.load(path)


def test_compressed_pickle_inflates_in_bounded_chunks(tmp_path: Path) -> None:
    from ckptfix.parse import zipcheck

    path = _deflate_bomb(tmp_path)
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        layout = zipcheck.check_zip(str(path), buf, len(buf), check_crc=False)
        member = layout.unique("archive/data.pkl")
        sizes = [len(chunk) for chunk in zipcheck.iter_member(member, buf)]
        assert sum(sizes) == 256 << 20 and max(sizes) <= 16 << 20
        with pytest.raises(LimitError, match="max_alloc_bytes"):
            zipcheck.read_member(member, buf)


# -- metadata that contradicts the file ----------------------------------------------------------------

def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("aliases, says", [
    ({"b": "a"}, "stores 'b' itself"),  # would override a tensor the file really holds
    ({"c": "missing"}, "missing tensor"),
    ({"c": {"of": "a", "dtype": "F32", "shape": [4]}}, "records shape"),
    ({"c": {"of": "a", "dtype": "F16", "shape": [2]}}, "records dtype"),
])
def test_safetensors_aliases_never_override_or_contradict(aliases: dict, says: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    meta = {"format": "pt", "ckptfix": json.dumps({"version": 1, "aliases": aliases})}
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, "__metadata__": meta}
    path = _safetensors(tmp_path / "x.safetensors", header, struct.pack("<4f", 1, 2, 3, 4))
    assert torch.equal(load_file(path)["b"], torch.tensor([3.0, 4.0]))  # what other readers see
    for fn in (ckptfix.load, ckptfix.inspect, ckptfix.scan):
        with pytest.raises(FormatError, match=says):
            fn(path)


def test_written_aliases_record_shape_and_dtype(tmp_path: Path) -> None:
    w = torch.randn(3, 2)
    torch.save({"enc.weight": w, "dec.weight": w}, tmp_path / "tied.pth")
    ckptfix.convert(tmp_path / "tied.pth", tmp_path / "tied.safetensors")
    from safetensors import safe_open

    with safe_open(tmp_path / "tied.safetensors", "pt") as f:
        extra = json.loads(f.metadata()["ckptfix"])
    assert extra["aliases"] == {"dec.weight": {"of": "enc.weight", "dtype": "F32", "shape": [3, 2]}}
    back = ckptfix.load(tmp_path / "tied.safetensors")
    assert back["dec.weight"] is back["enc.weight"] and torch.equal(back["dec.weight"], w)


def test_dcp_metadata_build_on_a_class_is_refused(fixtures_dir: Path, tmp_path: Path) -> None:
    """BUILD may give state only to instances the pickle made, never to an allowed class itself."""
    import argparse
    import shutil

    ckpt = Path(shutil.copytree(fixtures_dir / "mlp_fsdp2", tmp_path / "ckpt"))
    attack = proto(4) + glob("argparse", "Namespace") + b"N}" + u("__ckptfix_canary__") + b"\x88s\x86b" + b"0" + (
        ckpt / ".metadata").read_bytes()[2:]
    (ckpt / ".metadata").write_bytes(attack)
    with pytest.raises(UnsafeCheckpointError, match="BUILD on a"):
        ckptfix.inspect(ckpt)
    report = ckptfix.scan(ckpt)  # torch's own DCP loader unpickles .metadata with plain pickle
    assert not report.ok and any("modifies the global argparse.Namespace" in f.message for f in report.findings)
    assert "__ckptfix_canary__" not in vars(argparse.Namespace)


def test_dcp_directory_scan_walks_metadata_and_every_record(fixtures_dir: Path) -> None:
    report = ckptfix.scan(fixtures_dir / "mlp_fsdp2")
    assert report.ok and report.format == "dcp"
    assert report.pickles[0] == ".metadata" and sum(p.endswith("data.pkl") for p in report.pickles) >= 10
    dcp_classes = {g.name for g in report.globals if g.category == "allowed"}
    assert "torch.distributed.checkpoint.metadata.Metadata" in dcp_classes


def test_torchscript_archive_never_reaches_torch_jit_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.load without weights_only hands a TorchScript archive to torch.jit.load: ckptfix's loader
    asks torch's own reader first and refuses, whatever the caller thought the file was."""
    from ckptfix.formats.torchsave.torch_io import torch_load

    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    monkeypatch.setattr(torch.jit, "load", lambda *a, **k: pytest.fail("torch.jit.load ran"))
    with pytest.raises(UnsafeCheckpointError, match="TorchScript archive"):
        torch_load(str(path), "cpu", trust=False)


def test_tar_header_extension_is_never_read_past_the_limit(tmp_path: Path) -> None:
    """A first tar header announcing a 256 MiB GNU long name: tarfile (and torch.load's tar attempt)
    would read it whole; ckptfix calls the file a tar without reading it, and scans within the limit."""
    import tarfile

    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, 256 << 20
    path = tmp_path / "longname.pt"
    with open(path, "wb") as f:
        f.write(info.tobuf(format=tarfile.GNU_FORMAT)[:512])
        f.truncate(512 + (256 << 20) + 1024)  # sparse: no disk used
    with ckptfix.core.limits.override(max_pickle_bytes=1 << 20):
        assert opens_as_tar(str(path))
        report = ckptfix.scan(path)
        assert not report.ok and {"tar-format", "malformed"} <= {f.kind for f in report.findings}
        assert any("beyond the limit max_pickle_bytes" in f.message for f in report.findings)
        with pytest.raises(UnsafeCheckpointError, match="tar checkpoint"):
            ckptfix.load(path)


@pytest.mark.parametrize("index, ok", [(2, True), (5, False)])
def test_sparse_indices_are_checked_against_the_size(index: int, ok: bool, tmp_path: Path) -> None:
    """torch validates a loaded sparse tensor only under weights_only=True; ckptfix's loader always
    does: an index past the size would make to_dense() read and write out of bounds."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    torch.save({"w": sparse}, tmp_path / "ok.pth")
    raw = bytearray((tmp_path / "ok.pth").read_bytes())  # the indices record holds int64 0 and 2: make it 0, index
    import zipfile

    with zipfile.ZipFile(tmp_path / "ok.pth") as z:
        records = {i.filename: i for i in z.infolist() if "/data/" in i.filename}
        indices = next(n for n, i in records.items() if z.read(i) == struct.pack("<2q", 0, 2))
        at = raw.find(struct.pack("<2q", 0, 2), records[indices].header_offset)
    raw[at + 8 : at + 16] = struct.pack("<q", index)
    path = tmp_path / "sparse.pth"
    path.write_bytes(bytes(raw))
    if ok:
        assert torch.equal(ckptfix.load(path)["w"].to_dense(), torch.tensor([1.0, 0.0, 2.0]))
    else:
        with pytest.raises(UnsafeCheckpointError, match="indices do not fit its size"):
            ckptfix.load(path)
    assert ckptfix.inspect(path).state_dict["w"].device.type == "meta"  # structure only: nothing to check
    assert torch._utils._sparse_tensors_to_validate == []  # nothing left behind for a later load


# -- random pickles --------------------------------------------------------------------------------------

_FUZZ_GLOBALS = [
    "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_tensor", "torch._utils _rebuild_tensor_v3",
    "torch._utils _rebuild_parameter", "torch._utils _rebuild_qtensor", "torch._utils _rebuild_sparse_tensor",
    "torch._utils _rebuild_meta_tensor_no_storage", "torch._utils _rebuild_device_tensor_from_cpu_tensor",
    "torch._tensor _rebuild_from_type_v2", "collections OrderedDict", "collections Counter", "builtins set",
    "builtins complex", "builtins bytearray", "torch Size", "torch device", "torch.serialization _get_layout",
    "torch float32", "torch int64", "torch FloatStorage", "torch.nn.parameter Parameter", "argparse Namespace",
    "numpy dtype", "numpy._core.multiarray _reconstruct", "numpy._core.multiarray scalar", "numpy ndarray",
    "_codecs encode", "collections defaultdict", "collections deque", "datetime datetime", "pathlib PosixPath",
    "torch per_tensor_affine", "torch qint8", "torch sparse_coo", "torch.torch_version TorchVersion",
    "torch ByteTensor", "torch.storage UntypedStorage"]


def _fuzz_pickle(r: Any, depth: int = 0) -> bytes:
    """Random opcodes over the allowed globals: calls with random arguments, BUILDs, containers."""
    kind = r.randrange(12) if depth < 4 else 0
    if kind <= 3:
        atom = r.choice([num(r.choice([0, 1, 2, 4, -1, 64, 255, 2**31 - 1, 2**40, r.randrange(-999, 999)])), b"N",
                         b"\x88", b"\x89", b")", u(r.choice(["cpu", "meta", "0", "storage", "latin1", "f4", "b1", "O",
                                                             "<", "cuda:0"])), b"G" + struct.pack(">d", r.random()),
                         b"C\x08" + bytes(r.randrange(256) for _ in range(8))])
        return atom
    if kind <= 5:
        return b"(" + b"".join(_fuzz_pickle(r, depth + 1) for _ in range(r.randrange(8))) + b"t"
    if kind == 6:
        return b"](" + b"".join(_fuzz_pickle(r, depth + 1) for _ in range(r.randrange(4))) + b"e"
    if kind == 7:
        return b"}(" + b"".join(u("k") + _fuzz_pickle(r, depth + 1) for _ in range(r.randrange(3))) + b"u"
    if kind == 8:
        return pid("0", r.choice([0, 1, 4, 16]))
    module, name = r.choice(_FUZZ_GLOBALS).split()
    out = glob(module, name) + b"(" + b"".join(_fuzz_pickle(r, depth + 1) for _ in range(r.randrange(8))) + b"t"
    out += r.choice([b"R", b"R", b"\x81"])
    return out + (_fuzz_pickle(r, depth + 1) + b"b" if r.random() < 0.2 else b"")


def fuzz(seed: int, count: int) -> dict[str, int]:
    """Unpickle ``count`` random pickles with ckptfix's torch policy (storages of 4-byte floats)."""
    import collections
    import io
    import random

    from ckptfix.safety.guards import start_load, torch_policy
    from ckptfix.parse.unpickler import SafePickle

    def persistent_load(pid: tuple) -> Any:
        numel = pid[4] if isinstance(pid[4], int) and 0 <= pid[4] < 1 << 16 else 0
        storage = torch.UntypedStorage(numel * 4)
        storage.fill_(7)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)

    policy, rng, outcomes = torch_policy(), random.Random(seed), collections.Counter()
    for _ in range(count):
        unpickler = SafePickle(policy).Unpickler(io.BytesIO(proto(2) + _fuzz_pickle(rng) + b"."), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        start_load()
        try:
            policy.finish(unpickler.load())
            outcomes["loaded"] += 1
        except Exception as e:  # any exception is fine here; a crash is what is looked for
            outcomes[type(e).__name__] += 1
    return dict(outcomes)


def test_random_pickles_never_crash_the_unpickler() -> None:
    """2,000 random pickles over every allowed global, in a child process: a segfault (or a hang)
    fails the test; every pickle either loads or raises."""
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import test_hostile; "
            "print(json.dumps(test_hostile.fuzz(int(sys.argv[2]), int(sys.argv[3]))))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), "7", "2000"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    outcomes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(outcomes.values()) == 2000 and outcomes["loaded"] > 200 and outcomes["Refused"] > 200, outcomes
