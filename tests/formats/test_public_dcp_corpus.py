"""ckptfix against DCP's own loader on the checkpoints torch's own DCP tests write (tests/public_dcp_corpus.py).

- each DCP directory ``ckptfix.read`` reads gives what DCP's own reading of the whole checkpoint gives
  (``dcp_to_torch_save``, whose planner builds every entry from ``.metadata``, then ``torch.load``), bit for bit:
  the same nesting, keys (ckptfix keeps the saved order), plain values, each tensor's dtype, shape and bytes;
  its tensors are those ``dcp.load(no_dist=True)`` puts into a state dict of the right shapes; the torch-free description
  (``ckptfix.describe``) gives each tensor's dtype and shape; ``scan`` finds nothing in a benign one;
- what ckptfix refuses by design (``REFUSED``) DCP reads, and ckptfix refuses it in one line (a CkptfixError; exit 1
  and one ``Error:`` line from the CLI), never a traceback; a bytes entry DCP unpickles with ``weights_only=False``
  (``RISKY``: a BytesIO, a dataclass) is read as an inert placeholder, as a torch file's own pickle is: refused in one
  line where the selected state dict holds it, the model's state dict beside it read (torchtitan's TrainState), and
  the whole read as DCP reads it with ``trust=True``;
- served from a URL (``mem://``), each reads as it does locally;
- ``HuggingFaceStorageWriter``'s directories (``HF``) load as the ``safetensors`` library loads their files.

The DCP cases of dense tensors are converted to every output format in tests/ops/test_plain_loadable.py, the
others to ``.pth`` and DCP here.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.devices import DevicePlan
from ckptfix.core.tensorinfo import TensorInfo
from ckptfix.errors import CkptfixError, NeedsLocalCopy, UnsafeCheckpointError
from ckptfix.formats import DCP, read as formats_read
from tests import public_dcp_corpus as corpus
from tests.memory_backend import MemoryBackend, registered

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:TypedStorage is deprecated")

DCP_CASES = sorted(set(corpus.CASES) - corpus.HF - set(corpus.REFUSED))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return dict(corpus.build(tmp_path_factory.mktemp("public_dcp")))


def dcp_reads(path: Path, weights_only: bool = True) -> Any:
    """DCP's own reading of every entry: ``dcp_to_torch_save`` (bytes entries unpickled with ``weights_only=False``
    there), then ``torch.load`` of what it wrote."""
    out = path.with_name(path.name + ".dcp_to_torch_save.pt")
    if not out.exists():
        dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=weights_only)


def zeroed(obj: Any) -> Any:
    """``obj`` with each tensor a new zero tensor of its dtype and shape: a state dict to ``dcp.load`` into."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return type(obj)((k, zeroed(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [zeroed(v) for v in obj]
    return obj


def tensors(obj: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor (or TensorInfo) in ``obj`` with its path."""
    if isinstance(obj, (torch.Tensor, TensorInfo)):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{where}[{i}]")


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """dtype, shape and every byte (NaN payloads, -0.0, 0-dim and empty tensors too)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    a, b = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (got, want))
    return bool(torch.equal(a, b))


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` and ``want`` differ: container types (an OrderedDict is a dict), keys, plain
    values by type and value, tensors bit for bit."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and same_bits(got, want)
        return [] if ok else [f"{where}: {_brief(got)} != {_brief(want)}"]
    if isinstance(want, dict) or isinstance(got, dict):
        if not (isinstance(got, dict) and isinstance(want, dict)):
            return [f"{where}: {type(got).__name__} != {type(want).__name__}"]
        if set(got) != set(want):  # (order aside: ckptfix keeps the saved order, dcp_to_torch_save the metadata's)
            return [f"{where}: keys {list(got)} != {list(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}[{k!r}]")]
    if isinstance(want, (list, tuple)) or isinstance(got, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{where}: {_brief(got)} != {_brief(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        if type(got) is not type(want):
            return [f"{where}: {_brief(got)} != {_brief(want)}"]
        return [d for f in dataclasses.fields(want)
                for d in differences(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")]
    if isinstance(want, io.BytesIO) and isinstance(got, io.BytesIO):
        return [] if got.getvalue() == want.getvalue() else [f"{where}: BytesIO contents differ"]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {_brief(got)} != {_brief(want)}"]
    return []


def _brief(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {v.dtype} {list(v.shape)}"
    return f"{type(v).__name__} {v!r}"[:120]


def one_line(e: BaseException) -> None:
    message = str(e)
    assert message.strip() and "\n" not in message.strip() and "a bug in ckptfix" not in message, message


@pytest.mark.parametrize("name", DCP_CASES)
def test_dcp_directories_read_as_dcp_loads_them(name: str, made: dict[str, Path]) -> None:
    path = made[name]
    risky = name in corpus.RISKY
    truth = dcp_reads(path, weights_only=not risky)
    if risky:  # read as inert placeholders, refused in one line where the state dict holds them; trusted: as DCP reads it
        with pytest.raises(UnsafeCheckpointError) as e:
            ckptfix.read(path)
        one_line(e.value)
        assert str(path) in str(e.value) and "inert placeholders" in str(e.value)
        if "model" in truth:  # a TrainState's BytesIO beside the model (torchtitan's): the model's state dict reads
            assert not differences(ckptfix.read(path, select="model").raw["model"], truth["model"])
        ours = formats_read(str(path), DCP, DevicePlan("cpu"), trust=True).obj  # (the DCP reader: no state dict chosen)
    else:
        ours = ckptfix.read(path).raw
        report = ckptfix.scan(path)
        assert not report.findings, report.findings
    assert not differences(ours, truth), differences(ours, truth)
    # dcp.load in place into a state dict of the right shapes gives the same tensors
    target = zeroed(truth)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    got, loaded = dict(tensors(ours)), dict(tensors(target))
    assert got.keys() == loaded.keys()
    assert not [k for k in got if not same_bits(got[k], loaded[k])]


@pytest.mark.parametrize("name", DCP_CASES)
def test_torch_free_description_agrees(name: str, made: dict[str, Path]) -> None:
    """``ckptfix.describe`` (torch-free where it can be) gives each tensor DCP reads, with its dtype and shape."""
    path = made[name]
    risky = name in corpus.RISKY
    try:
        described = ckptfix.describe(path).raw
    except CkptfixError as e:
        assert risky, (name, str(e))
        one_line(e)
        return
    truth = dict(tensors(dcp_reads(path, weights_only=not risky)))
    got = dict(tensors(described))
    assert risky or got.keys() == truth.keys(), (name, sorted(got), sorted(truth))
    for k in got.keys() & truth.keys():
        info = got[k]
        dtype = info.dtype if isinstance(info, torch.Tensor) else getattr(torch, info.dtype)
        assert (dtype, list(info.shape)) == (truth[k].dtype, list(truth[k].shape)), k


@pytest.mark.parametrize("name", sorted(set(DCP_CASES) - corpus.RISKY))
def test_from_a_url_each_directory_reads_as_it_does_locally(name: str, made: dict[str, Path]) -> None:
    """The same directory served as ``mem://`` (its chunks read by ranged fetches): ``read`` gives the local read, bit
    for bit; ``describe`` gives the local description, or asks for a local copy where torch describes it."""
    path = made[name]
    with registered(MemoryBackend()) as mem:
        url = mem.put_tree(path, name)
        assert not differences(ckptfix.read(url).raw, ckptfix.read(path).raw)
        assert not ckptfix.scan(url).findings
        try:
            remote = dict(tensors(ckptfix.describe(url).raw))
        except NeedsLocalCopy as e:  # (a bytes entry's pickle only torch reads: b"..." is _codecs.encode)
            one_line(e)
            return
    local = dict(tensors(ckptfix.describe(path).raw))
    assert described(remote) == described(local)


def described(infos: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype name, shape), a TensorInfo's or a meta tensor's alike."""
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in infos.items()}


@pytest.mark.parametrize("name", sorted(set(DCP_CASES) - corpus.CONVERTS))
def test_the_other_cases_convert_to_what_plain_loaders_take_or_are_refused_in_one_line(name: str, made: dict[str, Path],
                                                                                        tmp_path: Path) -> None:
    """The cases tests/ops/test_plain_loadable.py leaves out (plain values beside the tensors, several state dicts, a
    bytes entry weights_only refuses): ``convert`` to ``.pth`` and to DCP writes what ``torch.load(weights_only=True)``
    and DCP's own reading load, each tensor of the state dict ckptfix reads bit for bit, or refuses in one line."""
    src = made[name]
    try:
        want = dict(ckptfix.read(src).state_dict)
    except CkptfixError as e:  # (no state dict to choose, or a bytes entry refused)
        one_line(e)
        want = None
    for out, kwargs in ((tmp_path / "out.pth", {}), (tmp_path / "dcp", {"format": "dcp"})):
        try:
            ckptfix.convert(src, out, to="keep", progress=False, **kwargs)
        except CkptfixError as e:
            one_line(e)
            continue
        assert want is not None, (name, out.name)
        got = dcp_reads(out) if out.is_dir() else torch.load(out, weights_only=True)
        assert not [k for k, v in want.items() if isinstance(v, torch.Tensor) and not same_bits(got[k], v)], (name, out.name)


def dcp_reads_with(name: str, path: Path) -> dict[str, Any]:
    """DCP's own reading of a case ckptfix refuses, with the reader its writer needs (the extension registry that
    knows Rot13; the HF reader of the sharded safetensors), every entry built from the metadata."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.testing._internal.distributed.checkpoint_utils import get_test_extension_registry

    reader = (dcp.HuggingFaceStorageReader(str(path)) if name.startswith("2ranks-hf")
              else dcp.FileSystemReader(path, _extension_registry=get_test_extension_registry()))
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # (as dcp_to_torch_save)
    return state


@pytest.mark.parametrize("name", sorted(corpus.REFUSED))
def test_what_ckptfix_refuses_by_design_dcp_reads_and_ckptfix_refuses_in_one_line(name: str, made: dict[str, Path],
                                                                                   cli_runner: Any) -> None:
    path = made[name]
    assert dict(tensors(dcp_reads_with(name, path)))  # DCP reads it, tensors and all
    for verb in (ckptfix.read, ckptfix.load, ckptfix.describe, ckptfix.scan):
        with pytest.raises(CkptfixError) as info:
            verb(path)
        one_line(info.value)
        assert str(path) in str(info.value)
    for command in ("inspect", "scan"):
        res = cli_runner.invoke(cli, [command, str(path)])
        assert res.exit_code == 1, (command, res.output)
        assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, (command, res.stderr)


@pytest.mark.parametrize("name", sorted(corpus.HF))
def test_hf_writer_directories_load_as_safetensors_loads_them(name: str, made: dict[str, Path], cli_runner: Any) -> None:
    path = made[name]
    want: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        part = load_file(file)
        assert not set(part) & set(want)
        want.update(part)
    got = ckptfix.load(path, to="keep")
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not same_bits(got[k], want[k])]
    res = cli_runner.invoke(cli, ["scan", str(path)])
    assert res.exit_code == 0, res.output


def test_the_tables_say_what_happens(made: dict[str, Path]) -> None:
    """``RISKY`` is exactly the cases whose entries torch's weights-only loader refuses once DCP has read them (so
    the tests above compare what they mean to), and each table names cases of the corpus."""
    risky = set()
    for name in DCP_CASES:
        try:
            dcp_reads(made[name], weights_only=True)
        except Exception:  # the weights-only unpickler's refusal
            risky.add(name)
    assert risky == corpus.RISKY
    assert set(corpus.REFUSED) | corpus.HF | corpus.CONVERTS <= set(corpus.CASES)
    assert not corpus.CONVERTS & (corpus.RISKY | set(corpus.REFUSED) | corpus.HF)


def test_a_train_state_beside_the_model_loads_the_model(made: dict[str, Path]) -> None:
    """The e2e checkpoint (model, optimizer, a Stateful, a TrainState whose BytesIO is an inert placeholder): load_into
    takes the state dict that fits the model, as DCP's own load fills it, the BytesIO never unpickled."""
    path = made["e2e-model-optimizer-train-state"]
    model = corpus.DummyModel()
    report = ckptfix.load_into(model, path)
    assert report.state_dict_key == "model" and any("inert _io.BytesIO" in n for n in report.notes), report.notes
    want = {"model": corpus.DummyModel().state_dict()}
    dcp.load(want, checkpoint_id=str(path), no_dist=True)
    assert not [k for k, v in model.state_dict().items() if not same_bits(v, want["model"][k])]
