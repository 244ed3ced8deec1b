"""The torch-free reader (``ckptfix.formats.describe``) against torch's own readers, directly.

tests/formats/test_fast_path.py compares the torch-free reader with ckptfix's torch path, and
tests/parse/test_readers_agree.py compares that path with torch; this file leaves ckptfix's torch path out. For
every committed fixture, hypothesis-generated checkpoints, the adversarial, hostile, malformed and mutation
corpora, and the files torch's and safetensors' own tests write (tests/public_torch_corpus.py,
tests/public_safetensors_corpus.py):

- whatever ``torch.load(path, weights_only=True)`` refuses (for safetensors files: whatever the
  ``safetensors`` library's ``safe_open`` refuses), the torch-free reader refuses or hands back
  (NeedsTorch), and ``ckptfix.describe`` then refuses too;
- whatever the torch-free reader describes, torch (or the ``safetensors`` library) loads, and the two agree
  on the nesting (container types, keys and their order, plain values bit for bit), each tensor's dtype,
  shape, stride, storage offset, ``requires_grad``, Parameter-ness and saved device, which keys share a
  storage, and the bytes: the file's bytes at each TensorInfo's storage are torch's storage bytes, and the
  view they give through ``storage_offset``/``stride`` (and ``byte_range``) is torch's tensor, byte for byte;
- where ckptfix is deliberately stricter (or, for three fixtures, describes what ``weights_only`` refuses),
  the cases are listed below with the reason, and the list is exactly what happens.

The one disagreement this test found when written, fixed since: ``TensorInfo.is_contiguous()`` (hence
``byte_range``) of a tensor without elements (torch calls it contiguous whatever its strides). The public corpora
found one more: sparse tensors whose indices don't fit their size, described on meta (their indices now read and
checked there too). Directory
fixtures (DCP) have no ``torch.load`` reference and are only listed here.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from safetensors import safe_open

import ckptfix
from ckptfix.parse import inert
from ckptfix.errors import CkptfixError
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.core.torch_free import NeedsTorch
from ckptfix.formats import SAFETENSORS, describe, sniff
from ckptfix.formats.torchsave import zip_describer
from ckptfix.core.tensorinfo import TensorInfo
from tests import adversarial, hostile_files, malformed_files, public_safetensors_corpus, public_torch_corpus
from tests.compare import raw_bytes, torch_refuses
from tests.describe_both import fixture_paths, save_both
from tests.strategies import checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol", "ignore:TypedStorage is deprecated",
                                        "ignore:'torch.load' received a zip file that looks like a TorchScript")

DESCRIBED = "described and agree"
REFUSED = "refused by both"
FALLBACK = "handed to torch, which loads it, and ckptfix's torch path describes it"
STRICTER = "ckptfix refuses what the reference loads"
LOOSER = "ckptfix describes (through its torch path) what the reference refuses"


# -- the two sides ------------------------------------------------------------------------------------------

def torch_free(path: Path) -> tuple[str | None, Any]:
    """(sniffed format, the torch-free reader's object) or (format or None, the exception it raised).

    Only NeedsTorch and ckptfix errors may come out of it; anything else fails the test."""
    fmt = None
    try:
        fmt = sniff(str(path))
        obj = describe(str(path), fmt).obj
        if inert.find(obj):  # placeholders: what ckptfix gives depends on the state dict found (refused inside it)
            ckptfix.describe(str(path))
        return fmt, obj
    except (NeedsTorch, CkptfixError) as e:
        return fmt, e


def torch_load(path: Path, in_child: bool = False) -> tuple[Any, dict[int, str]] | None:
    """``torch.load(path, weights_only=True)`` and the location tag torch read for each storage (by its
    StorageImpl), or None where torch refuses or fails (as ``torch_refuses``; in a child process for
    files that crash torch's own unpickler). The storages stay on the CPU: cuda-tagged fixtures load here."""
    if in_child:
        assert torch_refuses(path, in_child=True), f"{path}: loads in a child process; compare it in-process"
        return None
    locations: dict[int, str] = {}

    def where(storage: Any, location: str) -> Any:
        locations[storage._cdata] = location
        return storage

    try:
        return torch.load(path, weights_only=True, map_location=where), locations
    except Exception:  # any refusal or failure counts, as in torch_refuses
        return None


def safetensors_load(path: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor the ``safetensors`` library reads from ``path`` (its own key order), or None if it refuses."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # safe_open is not a mapping
    except BaseException as e:  # a Rust panic is a BaseException (pyo3's PanicException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None


# -- agreement ----------------------------------------------------------------------------------------------

def _storage_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.untyped_storage())


def _view_from_file(stored: bytes, info: TensorInfo) -> bytes:
    """The tensor's bytes in row-major order, from the storage's bytes and the TensorInfo's view alone."""
    if info.numel() == 0:
        return b""
    size = info.element_size()
    elements = np.frombuffer(stored, dtype=np.dtype(f"V{size}"))[info.storage_offset:]
    view = np.lib.stride_tricks.as_strided(elements, shape=info.shape, strides=[s * size for s in info.stride],
                                           writeable=False)
    return view.tobytes()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return raw_bytes(t).numpy().tobytes()


class Ties:
    """Tensors and storages seen so far: a TensorInfo (or its storage) is shared exactly where torch's is."""

    def __init__(self) -> None:
        self.storage: dict[int, int] = {}  # id(StorageInfo) -> StorageImpl
        self.storage_back: dict[int, int] = {}
        self.tensor: dict[int, int] = {}  # id(TensorInfo) -> id(tensor)
        self.tensor_back: dict[int, int] = {}
        self.keep: list[Any] = []  # keep the objects alive, so ids stay unique

    def see(self, info: TensorInfo, t: torch.Tensor, where: str) -> None:
        self.keep += [info, t]
        impl = t.untyped_storage()._cdata
        assert self.storage.setdefault(id(info.storage), impl) == impl, f"{where}: storage shared in ckptfix only"
        assert self.storage_back.setdefault(impl, id(info.storage)) == id(info.storage), \
            f"{where}: storage shared in torch only"
        assert self.tensor.setdefault(id(info), id(t)) == id(t), f"{where}: the same TensorInfo, two torch tensors"
        assert self.tensor_back.setdefault(id(t), id(info)) == id(info), f"{where}: one torch tensor, two TensorInfo"


def assert_tensor(info: TensorInfo, t: torch.Tensor, where: str, data: bytes, locations: dict[int, str] | None) -> None:
    assert isinstance(t, torch.Tensor), (where, type(t))
    assert (info.dtype, info.shape, info.stride, info.storage_offset) == (
        str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset()), where
    assert info.requires_grad == t.requires_grad, where
    assert info.is_contiguous() == t.is_contiguous() == (info.byte_range is not None), where
    assert info.is_parameter == isinstance(t, torch.nn.Parameter), where
    storage = t.untyped_storage()
    if locations is not None:  # torch's own reading of the saved device tag
        assert info.storage.location == locations[storage._cdata], where
    else:
        assert info.storage.location == "cpu", where
    assert info.storage.nbytes == storage.nbytes(), where
    stored = data[info.storage.offset : info.storage.offset + info.storage.nbytes]
    assert stored == _storage_bytes(t), f"{where}: the storage's bytes differ"
    assert _view_from_file(stored, info) == _tensor_bytes(t), f"{where}: the view's bytes differ"
    if info.byte_range is not None:
        start, end = info.byte_range
        assert data[start:end] == _tensor_bytes(t), f"{where}: byte_range is not the tensor's bytes"


def _same_plain(ours: Any, theirs: Any, where: str) -> None:
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(ours, float):
        assert struct.pack("<d", ours) == struct.pack("<d", theirs), (where, ours, theirs)  # bit for bit
    elif isinstance(ours, complex):
        _same_plain(ours.real, theirs.real, where)
        _same_plain(ours.imag, theirs.imag, where)
    else:
        assert ours == theirs, (where, ours, theirs)


def assert_agree(ours: Any, theirs: Any, where: str, data: bytes, locations: dict[int, str], ties: Ties) -> None:
    """The torch-free reader's object is torch's, container by container and tensor by tensor."""
    if isinstance(ours, TensorInfo):
        assert_tensor(ours, theirs, where, data, locations)
        ties.see(ours, theirs, where)
    elif isinstance(ours, zip_describer.dtype):
        assert theirs is getattr(torch, ours.name), (where, ours, theirs)
    elif type(ours) in (dict, OrderedDict):
        assert type(theirs) is type(ours), (where, type(ours), type(theirs))
        assert list(ours) == list(theirs), f"{where}: keys or their order differ"
        for (k, v), k2 in zip(ours.items(), theirs):
            _same_plain(k, k2, f"{where}/{k!r}")
            assert_agree(v, theirs[k2], f"{where}/{k!r}", data, locations, ties)
        assert getattr(ours, "_metadata", None) == getattr(theirs, "_metadata", None), f"{where}: _metadata"
    elif type(ours) in (list, tuple):
        assert type(theirs) is type(ours) and len(ours) == len(theirs), (where, type(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_agree(a, b, f"{where}[{i}]", data, locations, ties)
    elif type(ours) is set:
        assert type(theirs) is set and ours == theirs, (where, ours, theirs)
    else:
        _same_plain(ours, theirs, where)


def assert_agree_safetensors(ours: Any, theirs: dict[str, torch.Tensor], path: Path, data: bytes) -> None:
    """Every stored tensor as the safetensors library reads it; ckptfix's extra keys are its recorded aliases
    (the same TensorInfo as a stored key's). Key order is not compared: the library lists keys sorted."""
    assert set(theirs) <= set(ours), f"{path}: stored tensors the torch-free reader lacks"
    stored = {id(ours[k].storage) for k in theirs}
    assert len(stored) == len(theirs), f"{path}: two stored tensors share a storage"
    for k in set(ours) - set(theirs):
        assert any(ours[k] is ours[s] for s in theirs), f"{path}: {k!r} is neither stored nor an alias"
    for k, t in theirs.items():
        info = ours[k]
        assert info.storage.key == k, (path, k)
        assert_tensor(info, t, f"{path}/{k}", data, None)


# -- one input, both sides ---------------------------------------------------------------------------------

def verdict(path: Path, monkeypatch: pytest.MonkeyPatch, crashes_torch: bool = False) -> str:
    """Compare the torch-free reader with the reference reader on ``path``; fail on a disagreement, else
    say which of the allowed outcomes it was (DESCRIBED, REFUSED, FALLBACK, STRICTER, LOOSER)."""
    fmt, ours = torch_free(path)
    if fmt == SAFETENSORS:
        ref: Any = safetensors_load(path)
    elif fmt is None:  # sniffing refused it: if either reader reads it, ckptfix is stricter
        ref = torch_load(path, crashes_torch) or safetensors_load(path)
    else:
        ref = torch_load(path, crashes_torch)
    if not isinstance(ours, BaseException):
        assert ref is not None, f"{path}: the torch-free reader describes what the reference refuses"
        data = path.read_bytes()
        if fmt == SAFETENSORS:
            assert_agree_safetensors(ours, ref, path, data)
        else:
            assert_agree(ours, ref[0], str(path.name), data, ref[1], Ties())
        return DESCRIBED
    ref_refused = ref is None
    del ref  # (what torch built from a bomb: 2.5 GB)
    return _after_refusal(path, ours, monkeypatch, ref_refused)


def _after_refusal(path: Path, ours: BaseException, monkeypatch: pytest.MonkeyPatch, ref_refused: bool) -> str:
    if isinstance(ours, NeedsTorch):  # handed back to torch: what does ckptfix then do?
        monkeypatch.setenv(ENV_SWITCH, "1")
        try:
            ckptfix.describe(path)
        except CkptfixError:
            return REFUSED if ref_refused else STRICTER
        return LOOSER if ref_refused else FALLBACK
    return REFUSED if ref_refused else STRICTER


# -- the committed fixtures ----------------------------------------------------------------------------------

FIXTURE_VERDICTS = {  # every file fixture whose verdict is not DESCRIBED; the others are described and agree
    "mlp_legacy.pth": FALLBACK,  # the legacy (non-zip) format is torch's path by design
    # weights_only refuses these; the torch-free reader hands them back (NeedsTorch) and ckptfix's own
    # torch path describes them: its allow-list rebuilds mmengine's HistoryBuffer and timm's argparse.Namespace
    # as inert data, and it reads a TorchScript archive's tensors without running its code
    "mlp_mmengine.pth": LOOSER,
    "mlp_timm.pth.tar": LOOSER,
    "mlp_torchscript.pt": LOOSER,
}


@pytest.mark.parametrize("path", [p for p in fixture_paths() if p.is_file()], ids=lambda p: p.name)
def test_fixture_read_as_torch_reads_it(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert verdict(path, monkeypatch) == FIXTURE_VERDICTS.get(path.name, DESCRIBED)


def test_directory_fixtures_have_no_torch_load_reference() -> None:
    """Directories are not torch.load inputs (DCP directories are compared with ckptfix's torch path in
    tests/formats/test_fast_path.py); this only pins which they are, so a new kind of fixture can't go unnoticed."""
    dirs = [p for p in fixture_paths() if p.is_dir()]
    assert [(p.name, sniff(str(p))) for p in dirs] == [("mlp_fsdp2", "dcp")]
    assert all(torch_load(p) is None for p in dirs)


def test_every_fixture_kind_is_covered() -> None:
    files = [p for p in fixture_paths() if p.is_file()]
    formats = {sniff(str(p)) for p in files if p.name not in FIXTURE_VERDICTS}
    assert formats == {"torch-zip", "safetensors"}
    assert len(files) - len(FIXTURE_VERDICTS) >= 12
    assert {"mlp_cuda0.pth", "mlp_cuda1.pth"} <= {p.name for p in files}  # saved device tags compared


@pytest.mark.parametrize("shape,stride", [((0, 0), None), ((3, 0), None), ((2, 0, 3), None), ((3, 0), (7, 9))])
def test_empty_tensors_are_contiguous_as_torch_says(shape: tuple[int, ...], stride: tuple[int, ...] | None,
                                                     tmp_path: Path) -> None:
    """torch calls a tensor without elements contiguous whatever its strides (torch.save writes stride 1
    after a 0-size dimension); TensorInfo once expected stride 0 there and gave no byte_range."""
    e = torch.empty(shape) if stride is None else torch.empty(0).as_strided(shape, stride)
    torch.save({"e": e}, tmp_path / "e.pth")
    info, t = describe(str(tmp_path / "e.pth"), "torch-zip").obj["e"], torch.load(tmp_path / "e.pth")["e"]
    assert (info.shape, info.stride) == (tuple(t.shape), t.stride())
    assert info.is_contiguous() == t.is_contiguous() is True
    assert info.byte_range is not None and info.byte_range[0] == info.byte_range[1]


# -- hypothesis: every dtype, views, shared storages, Parameters, nesting -----------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(obj=checkpoints())
def test_random_checkpoints_read_as_torch_reads_them(obj: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("rand")
    save_both(obj, d)
    with pytest.MonkeyPatch.context() as mp:
        assert verdict(d / "ckpt.pth", mp) == DESCRIBED
        assert verdict(d / "ckpt.safetensors", mp) == DESCRIBED


def test_safetensors_aliases_are_the_stored_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --compact-ties ckptfix writes a tied weight once and records the other key as an alias: the library sees one tensor,
    the torch-free reader both keys, on the one stored tensor's bytes."""
    w = torch.randn(4, 3)
    torch.save(OrderedDict([("embed.weight", w), ("head.weight", w), ("head.bias", torch.zeros(4))]), tmp_path / "t.pth")
    ckptfix.convert(tmp_path / "t.pth", tmp_path / "t.safetensors", compact_ties=True)
    assert verdict(tmp_path / "t.safetensors", monkeypatch) == DESCRIBED
    ours, theirs = torch_free(tmp_path / "t.safetensors")[1], safetensors_load(tmp_path / "t.safetensors")
    assert theirs is not None and len(theirs) == 2 and list(ours) == ["embed.weight", "head.weight", "head.bias"]
    assert ours["embed.weight"] is ours["head.weight"]


# -- malformed, hostile, adversarial and mutated files ---------------------------------------------------------

Corpus = Iterator[tuple[str, Path, bool]]  # (name, file, crashes torch's own unpickler)


def _adversarial(tmp: Path) -> Corpus:
    for case in adversarial.build_corpus(tmp / "corpus"):
        yield case.name, case.path, False


def _hostile(tmp: Path) -> Corpus:
    for case in hostile_files.CASES:
        (tmp / case.name).mkdir()
        yield case.name, case.make(tmp / case.name), case.name == "million-nested-dict-key"


def _malformed(tmp: Path) -> Corpus:
    for name, (make, _says) in malformed_files.CASES.items():
        (tmp / f"malformed-{name}").write_bytes(make(tmp))
        yield f"malformed-{name}", tmp / f"malformed-{name}", False


def _mutated(tmp: Path) -> Corpus:
    for label, data in malformed_files.mutations(0, 60):
        (tmp / f"mutation-{label}.pth").write_bytes(data)
        yield f"mutation-{label}", tmp / f"mutation-{label}.pth", False


def _public_safetensors(tmp: Path) -> Corpus:
    """The files safetensors' own tests write or embed (tests/public_safetensors_corpus.py), but the big ones (their
    bytes compared with torch.equal in tests/formats/test_public_safetensors_corpus.py)."""
    for name, make in public_safetensors_corpus.CASES.items():
        if name not in public_safetensors_corpus.BIG:
            yield name, make(tmp), False


def _public_torch(tmp: Path) -> Corpus:
    """The files torch's own test/test_serialization.py saves or embeds (tests/public_torch_corpus.py); those with
    FRAME opcodes, which torch's weights_only unpickler lacks, are compared in tests/parse/test_readers_agree.py."""
    for name, path in public_torch_corpus.build(tmp):
        if name not in public_torch_corpus.FRAMED:
            yield name, path, False


CORPORA = {"adversarial": _adversarial, "hostile": _hostile, "malformed": _malformed, "mutations": _mutated,
           "public-safetensors": _public_safetensors, "public-torch": _public_torch}

_AFTER = "bytes after the end of the archive (a polyglot's hiding place); torch's reader ignores them"
_NAMES = "a local header names its member differently from the central directory: zip readers disagree"
#: Every corpus file the reference reads that ckptfix refuses, with why: ckptfix's deliberate stricter policy.
#: (No corpus file goes the other way, and the torch-free reader itself describes none of them.)
STRICTER_CASES = {
    # adversarial: archives whose readers disagree, or that carry a pickle torch never unpickles
    "legacy-after-storages": "a pickle after the legacy file's storages, which torch never reads",
    "zip-extra-member": "a pickle (os.system) in a member torch never reads",
    "zip-duplicate-data-pkl-first": "two members named archive/data.pkl: readers disagree on which is read",
    "zip-local-name-mismatch": _NAMES,
    "zip-hidden-between-members": "bytes hidden between members",
    "zip-after-archive": _AFTER,
    "zip-second-pickle-in-data-pkl": "a second pickle after data.pkl's STOP, which torch never unpickles",
    # hostile: torch loads them, hands back uninitialised memory or spends the memory asked for
    "byte-tensor-uninitialised": "torch.ByteTensor(4096): uninitialised memory",
    "untyped-storage-uninitialised": "UntypedStorage(4096): uninitialised memory",
    "tensor-class-newobj": "FloatTensor.__new__(1024): uninitialised memory",
    "legacy-declared-never-filled": "a legacy storage declared but never written: torch gives uninitialised memory",
    "bytearray-bomb": "bytearray(2.5e9): over max_alloc_bytes (torch allocates 2.5 GB)",
    "legacy-sys-info-bomb": "bytearray(2.5e9) in the legacy sys_info pickle: over max_alloc_bytes",
    "memoized-set-amplification": "20,000 sets of a 10,000-item list: over max_alloc_bytes",
    "million-nested-tuples": "a million nested tuples: over max_depth",
    # malformed: the safetensors library takes the last of two equal JSON keys; ckptfix refuses the ambiguity
    "malformed-safetensors-duplicate-key": "duplicate key 'a' in the safetensors header",
    # mutations of a real torch.save archive (seed 0): torch's reader still reads them
    **{f"mutation-append-{i}": _AFTER for i in (18, 19, 21, 22, 24, 36, 44, 48, 51, 54, 56, 58)},
    **{f"mutation-{label}": _NAMES for label in ("local-17", "local-50", "directory-41", "swap-32", "swap-37")},
    "mutation-local-6": "two members overlap: readers disagree on where one ends",
    "mutation-end-55": "the end record's comment runs past the end of the file",
}
#: (public-torch: gzip/offset files (3), code and unlisted classes (7), sparse indices that don't fit their size (5))
REFUSED_AT_LEAST = {"adversarial": 40, "hostile": 7, "malformed": 16, "mutations": 25, "public-safetensors": 16,
                    "public-torch": 15}


@pytest.mark.parametrize("corpus", list(CORPORA))
def test_corpus_refused_where_torch_refuses(corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdicts = {name: verdict(path, monkeypatch, crashes) for name, path, crashes in CORPORA[corpus](tmp_path)}
    stricter = {name for name, v in verdicts.items() if v == STRICTER}
    assert stricter == set(STRICTER_CASES) & set(verdicts), "ckptfix's deliberate refusals changed"
    assert not [name for name, v in verdicts.items() if v == LOOSER]
    assert sum(v == REFUSED for v in verdicts.values()) >= REFUSED_AT_LEAST[corpus]
    if corpus == "mutations":  # enough damaged archives still read, for the byte comparison to mean something
        assert sum(v == DESCRIBED for v in verdicts.values()) >= 10
    if corpus == "public-safetensors":  # each read by the torch-free reader as the library reads it, or refused by both
        assert set(verdicts.values()) == {DESCRIBED, REFUSED}, verdicts
