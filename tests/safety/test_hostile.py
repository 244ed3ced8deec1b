"""Hostile files that run no code but attack the reader: memory unsafety, uninitialised memory,
resource bombs, out-of-bounds views, metadata that contradicts the file.

Each is refused (one ``Error:`` line, exit 1; ``scan`` exit 3 where it is a finding) without a crash,
without an output file and within the limits (docs/security.md "Limits"). Cases that crash or leak under a
naive reader run in a child process, so a segfault fails the test instead of killing the run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from typing import Any
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError, LimitError, UnsafeCheckpointError
from ckptfix.parse.legacy_tar import opens_as_tar
from tests.adversarial import glob, proto, u
from tests.hostile_files import BY_NAME, deep, deflate_bomb, num, pid, stride0_expansion, view

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script/save deprecation


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
    path = view(0, (8,), (1,))(tmp_path)
    for dst in ("o.pth", "o.safetensors"):
        with pytest.raises(UnsafeCheckpointError, match="out of bounds"):
            ckptfix.convert(path, tmp_path / dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_stride0_view_loads_but_is_not_expanded_into_gigabytes(tmp_path: Path, cli_runner) -> None:
    """A 4-byte storage seen as a 512 MiB tensor: loading keeps it a view, the .pth keeps the one
    element, safetensors (which can't store a stride) refuses beyond max_expand_bytes."""
    path = stride0_expansion(tmp_path)
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
    path = deep("tuples")(tmp_path)
    monkeypatch.setenv("CKPTFIX_MAX_DEPTH", "2000000")  # the user raises it: the file loads
    assert torch.equal(ckptfix.load(path)["w"], torch.tensor([1.0, 2, 3, 4]))
    monkeypatch.setenv("CKPTFIX_MAX_DEPTH", "deep")
    with pytest.raises(LimitError, match="CKPTFIX_MAX_DEPTH='deep' is not a whole number"):
        ckptfix.load(path)


def test_compressed_pickle_inflates_in_bounded_chunks(tmp_path: Path) -> None:
    from ckptfix.parse import zipcheck

    path = deflate_bomb(tmp_path)
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
    ckptfix.convert(tmp_path / "tied.pth", tmp_path / "tied.safetensors", compact_ties=True)
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
    """torch validates a loaded sparse tensor only under weights_only=True; ckptfix's readers always do, a structure
    read (meta) too: an index past the size would make to_dense() read and write out of bounds."""
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
        assert ckptfix.inspect(path).state_dict["w"].device.type == "meta"  # structure only: its indices read, no value
    else:
        for verb in (ckptfix.load, ckptfix.inspect):  # (a structure read reads the indices to check them)
            with pytest.raises(UnsafeCheckpointError, match="indices do not fit its size"):
                verb(path)
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
    code = ("import sys, json; from tests.safety.test_hostile import fuzz; "
            "print(json.dumps(fuzz(int(sys.argv[1]), int(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, "7", "2000"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    outcomes = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(outcomes.values()) == 2000 and outcomes["loaded"] > 200 and outcomes["Refused"] > 200, outcomes
