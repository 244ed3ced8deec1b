"""The torch-free describe path (``ckptfix.formats.describe``, each family's describer) against the torch path (``inspect``).

- ``ckptfix inspect --json`` (and the text) is the same through both, for every committed fixture,
  generated layouts, sharded directories and hypothesis-generated checkpoints of every dtype;
- every malformed, mutated or hostile file is refused by both with the same error class;
- DCP directories (real FSDP2 saves, with optimizer state: its hyper-parameters are bytes entries,
  torch.save zips in byte ranges of the ``.distcp`` files) are described from ``.metadata`` and those
  zips the same way, and malformed ``.metadata`` or bytes entries are refused by both with the same
  error class, running nothing;
- ``ckptfix inspect`` of a torch zip, a safetensors file or a DCP directory, ``scan`` of a
  torch zip or safetensors file, and ``import ckptfix`` leave torch unimported.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ckptfix
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.core.torch_free import NeedsTorch
from ckptfix.formats import DCP, describe, sniff
from tests import adversarial, hostile_files, malformed_files
from tests.describe_both import DESCRIBED, PROBE, assert_same, fixture_paths, outcome, save_both
from tests.strategies import checkpoints

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ROOT = FIXTURES.parent
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


# -- the committed fixtures and generated layouts ------------------------------------------------------

@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.name)
def test_fixture_described_the_same_without_torch(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = sniff(str(path))
    # mmengine (HistoryBuffer) and timm (argparse.Namespace) hold objects only torch's path builds
    expected = fmt in DESCRIBED and not any(n in path.name for n in ("mmengine", "timm"))
    assert_same(path, monkeypatch, described=expected)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory, train: Any) -> Path:
    out = tmp_path_factory.mktemp("generated")
    train.generate(out, "resnet18", ["single", "lightning", "safetensors"])
    sd = torch.load(out / "resnet18_single.pth", weights_only=True)
    for fmt, size in (("safetensors", "20MB"), ("pth", "20MB")):
        ckptfix.convert(out / "resnet18_single.pth", out / f"sharded_{fmt}", format=fmt, max_shard_size=size)
    tied = OrderedDict(sd)
    tied["head.weight"] = tied["fc.weight"]  # written once, restored as ckptfix's alias
    torch.save(tied, out / "tied.pth")
    ckptfix.convert(out / "tied.pth", out / "tied.safetensors", compact_ties=True)
    ckptfix.convert(out / "tied.pth", out / "tied_sharded", max_shard_size="10MB", compact_ties=True)
    return out


def test_generated_layouts_described_the_same(generated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = 0
    for path in sorted(generated.iterdir()):
        if path.suffix in (".pth", ".ckpt", ".safetensors", ".pt") or path.is_dir():
            assert_same(path, monkeypatch, described=sniff(str(path)) in DESCRIBED)
            seen += 1
    assert seen >= 7


# -- hypothesis: every dtype, views, shared storages, nesting ----------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(obj=checkpoints())
def test_random_checkpoints_described_the_same(obj: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("rand")
    sd = save_both(obj, d)
    with pytest.MonkeyPatch.context() as mp:
        for path in (d / "ckpt.pth", d / "ckpt.safetensors"):
            assert_same(path, mp, described=True)
        mp.setenv(ENV_SWITCH, "1")
        fast = ckptfix.describe(d / "ckpt.pth").state_dict
    for key, t in sd.items():  # each TensorInfo is the tensor's exact view
        info = fast[key]
        assert (info.dtype, info.shape, info.stride, info.storage_offset) == (
            str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride(), t.storage_offset()), key
        assert info.is_parameter == isinstance(t, torch.nn.Parameter)


# -- malformed, mutated and hostile files: the same refusal ----------------------------------------

def test_corpora_refused_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [c.path for c in adversarial.build_corpus(tmp_path / "corpus")]
    for case in hostile_files.CASES:
        if "nested" in case.name:
            continue  # only torch's own weights_only unpickler (not used here) crashes on these
        (tmp_path / case.name).mkdir()
        files.append(case.make(tmp_path / case.name))
    for name, (make, _says) in malformed_files.CASES.items():
        (tmp_path / f"malformed-{name}").write_bytes(make(tmp_path))
        files.append(tmp_path / f"malformed-{name}")
    for label, data in malformed_files.mutations(0, 60):
        (tmp_path / f"mutation-{label}.pth").write_bytes(data)
        files.append(tmp_path / f"mutation-{label}.pth")
    refused = 0
    for path in files:
        fast, slow = outcome(path, True, monkeypatch), outcome(path, False, monkeypatch)
        assert fast == slow, path
        refused += isinstance(fast, str)
    assert refused >= 40


# -- no torch -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["inspect", "scan"])
@pytest.mark.parametrize("name", ["mlp_ddp.pth", "mlp_lightning.ckpt", "mlp_safetensors.safetensors"])
def test_short_commands_import_no_torch(command: str, name: str) -> None:
    run = subprocess.run([sys.executable, "-c", PROBE, command, str(FIXTURES / name)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, ENV_SWITCH: "1"})
    assert run.returncode == 0, run.stderr
    assert "TORCH=False" in run.stderr, f"ckptfix {command} {name} imported torch"


def test_sharded_inspect_imports_no_torch(generated: Path) -> None:
    for name in ("sharded_safetensors", "sharded_pth"):
        run = subprocess.run([sys.executable, "-c", PROBE, "inspect", str(generated / name)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 0 and "TORCH=False" in run.stderr, (name, run.stderr)


def test_import_ckptfix_is_lazy() -> None:
    code = ("import sys, ckptfix\n"
            "assert 'torch' not in sys.modules and 'ckptfix.model.verify' not in sys.modules "
            "and 'ckptfix.ops.diff' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'ckptfix')))\n"
            "from ckptfix import VerifyReport, DiffReport\n"
            "import ckptfix.model.verify\n"
            "assert callable(ckptfix.verify) and ckptfix.verify.__name__ == 'verify', ckptfix.verify\n"
            "assert callable(ckptfix.diff) and ckptfix.diff.__name__ == 'diff', ckptfix.diff\n"
            "assert ckptfix.VerifyReport is VerifyReport and ckptfix.DiffReport is DiffReport\n"
            "assert 'torch' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_function_names_survive_any_import_order() -> None:
    import ckptfix.ops.diff
    import ckptfix.model.verify

    assert ckptfix.verify.__module__ == "ckptfix.model.verify" and callable(ckptfix.verify)
    assert ckptfix.diff.__module__ == "ckptfix.ops.diff" and callable(ckptfix.diff)


# -- TensorInfo ---------------------------------------------------------------------------------------

def test_tensor_info_byte_range_is_the_tensors_bytes(tmp_path: Path) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    torch.save({"w": w, "row": w[2], "col": w[:, 1]}, tmp_path / "v.pth")
    sd = describe(str(tmp_path / "v.pth"), "torch-zip").obj
    data = (tmp_path / "v.pth").read_bytes()
    start, end = sd["row"].byte_range
    assert torch.equal(torch.frombuffer(bytearray(data[start:end]), dtype=torch.float32), w[2])
    assert sd["col"].byte_range is None and sd["w"].storage is sd["row"].storage


def _with_attribute() -> torch.Tensor:
    t = torch.ones(2)
    t.note = "x"  # type: ignore[attr-defined]  # pickled through _rebuild_from_type_v2
    return t


EDGE_CASES: dict[str, tuple[Any, bool]] = {  # name → (what torch.save writes, described without torch)
    "parameter-requires-grad": (lambda: {"w": torch.nn.Parameter(torch.ones(3))}, True),
    "int-parameter": (lambda: {"w": torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)}, True),
    "tensor-requires-grad": (lambda: {"w": torch.ones(3, requires_grad=True)}, False),
    "tensor-with-attribute": (lambda: {"w": _with_attribute()}, False),
    "sparse": (lambda: {"w": torch.eye(3).to_sparse()}, False),
    "quantized": (lambda: {"w": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)}, False),
    "deepspeed-like": (lambda: {"module": {"w": torch.ones(2)}, "ds_config": {}, "ds_version": "0.19.8"}, False),
    "torch-size": (lambda: {"w": torch.ones(2), "shape": torch.Size([2])}, False),
    "empty-and-scalar": (lambda: {"e": torch.empty(0, 3), "s": torch.tensor(2.5), "b": torch.tensor(True)}, True),
    "dtype-value": (lambda: {"w": torch.ones(2), "dtype": torch.bfloat16, "nested": [{"a": (1, 2.0, None)}]}, True),
}


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning",
                            "ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases_fall_back_or_agree(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, described = EDGE_CASES[name]
    torch.save(make(), tmp_path / f"{name}.pth")
    assert_same(tmp_path / f"{name}.pth", monkeypatch, described=described)


# -- DCP directories: tensors described from .metadata, bytes entries from their torch.save zips ----------

@pytest.fixture(scope="module")
def fsdp2_model_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real 2-rank FSDP2 saves (rows, rows_bf16, cols) of the model alone: every entry a tensor."""
    from tests import fsdp2_dirs

    return fsdp2_dirs.make(tmp_path_factory.mktemp("fsdp2"), optim=False)


@pytest.fixture(scope="module")
def fsdp2_with_optim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real 2-rank FSDP2 saves of model and Adam state: the hyper-parameters are bytes entries."""
    from tests import fsdp2_dirs

    return fsdp2_dirs.make(tmp_path_factory.mktemp("fsdp2-optim"), optim=True)


def _bytes_entries(path: Path) -> dict[str, Any]:
    """fqn → storage info of every bytes entry of the DCP directory (its metadata read by torch)."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = pickle.loads((path / ".metadata").read_bytes())  # the test's own saves
    return {i.fqn: info for i, info in meta.storage_data.items()
            if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata)}


def test_dcp_described_the_same(fsdp2_model_only: dict[str, Path], fsdp2_with_optim: dict[str, Path],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(fsdp2_model_only) == set(fsdp2_with_optim) == {"rows", "rows_bf16", "cols"}
    for path in [*fsdp2_model_only.values(), *fsdp2_with_optim.values(), FIXTURES / "mlp_fsdp2"]:
        assert_same(path, monkeypatch, described=True)
    for path in [*fsdp2_with_optim.values(), FIXTURES / "mlp_fsdp2"]:
        assert _bytes_entries(path), path  # optimizer hyper-parameters: bytes entries
        monkeypatch.setenv(ENV_SWITCH, "1")
        group = describe(str(path), DCP).obj["optim"]["param_groups"][0]
        first = "0.weight" if path.name == "mlp_fsdp2" else "body.0.weight"
        assert group["betas"] == (0.9, 0.999) and group["params"][0] == first, group


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_tensor_in_a_bytes_entry_has_its_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value DCP torch.saves holding tensors (a tuple of views of one tensor): each TensorInfo's storage is
    its record's bytes in the .distcp file; torch.load of the bytes gives every reference its own storage."""
    import torch.distributed.checkpoint as dcp

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save({"model": {"w": w.clone(), "b": torch.ones(4)}, "extra": {"lr": 0.5, "pair": (w, w[1])}},
             checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert set(_bytes_entries(tmp_path / "d")) == {"extra.lr", "extra.pair"}
    assert_same(tmp_path / "d", monkeypatch, described=True)
    whole, row = describe(str(tmp_path / "d"), DCP).obj["extra"]["pair"]
    assert whole.storage.path == str(tmp_path / "d" / "__0_0.distcp") and whole.storage is not row.storage
    data = (tmp_path / "d" / "__0_0.distcp").read_bytes()
    for info, t in ((whole, w), (row, w[1])):
        start, end = info.byte_range
        assert torch.equal(torch.frombuffer(bytearray(data[start:end]), dtype=torch.float32), t.reshape(-1))


@pytest.mark.parametrize("which", ["fixture", "model-only", "with-optim"])
def test_dcp_inspect_imports_no_torch(which: str, fsdp2_model_only: dict[str, Path],
                                      fsdp2_with_optim: dict[str, Path]) -> None:
    path = {"fixture": FIXTURES / "mlp_fsdp2", "model-only": fsdp2_model_only["cols"],
            "with-optim": fsdp2_with_optim["rows"]}[which]
    run = subprocess.run([sys.executable, "-c", PROBE, "inspect", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ,
                                                                                   ENV_SWITCH: "1"})
    assert run.returncode == 0 and "TORCH=False" in run.stderr, run.stderr


def _meta_edits() -> dict[str, Any]:
    """Named edits of a loaded DCP ``Metadata`` (real torch objects), each re-pickled as torch pickles it."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def sharded(meta: Any) -> tuple[str, Any]:
        return next((k, v) for k, v in meta.state_dict_metadata.items() if len(v.chunks) > 1)

    def drop_chunk(meta: Any) -> None:
        sharded(meta)[1].chunks.pop()

    def grow_chunk(meta: Any) -> None:
        md = sharded(meta)[1]
        c = md.chunks[0]
        md.chunks[0] = ChunkStorageMetadata(c.offsets, torch.Size([c.sizes[0] + 100, *c.sizes[1:]]))

    def negative_offset(meta: Any) -> None:
        md = sharded(meta)[1]
        c = md.chunks[-1]
        md.chunks[-1] = ChunkStorageMetadata(torch.Size([-1, *c.offsets[1:]]), c.sizes)

    def drop_record(meta: Any) -> None:
        meta.storage_data.pop(next(iter(meta.storage_data)))

    def absolute_file(meta: Any) -> None:
        next(iter(meta.storage_data.values())).relative_path = "/etc/passwd"

    def transforms(meta: Any) -> None:
        next(iter(meta.storage_data.values())).transform_descriptors = ["zstd"]

    def bad_planner_path(meta: Any) -> None:
        meta.planner_data[next(iter(meta.planner_data))] = ("model", 3.5)

    def into_a_value(meta: Any) -> None:
        keys = list(meta.planner_data)
        meta.planner_data[keys[1]] = (*meta.planner_data[keys[0]], "x")

    def quantized_dtype(meta: Any) -> None:
        sharded(meta)[1].properties.dtype = torch.qint8

    def no_storage_data(meta: Any) -> None:
        meta.storage_data = None

    def a_dict(meta: Any) -> Any:
        return {"state_dict_metadata": meta.state_dict_metadata}

    return {f.__name__: f for f in (drop_chunk, grow_chunk, negative_offset, drop_record, absolute_file, transforms,
                                     bad_planner_path, into_a_value, quantized_dtype, no_storage_data, a_dict)}


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")
def test_dcp_malformed_metadata_refused_the_same_way(fsdp2_model_only: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle
    import shutil

    source = fsdp2_model_only["cols"]
    original = (source / ".metadata").read_bytes()
    cases: dict[str, bytes] = {"truncated": original[: len(original) // 2],
                               "unknown-class": original.replace(b"MetadataIndex", b"MetadataIndeX", 1),
                               "os-global": original.replace(b"\x8c\x05torch\x94\x8c\x04Size",
                                                             b"\x8c\x05posix\x94\x8c\x04Size", 1)}
    for name, edit in _meta_edits().items():
        meta = pickle.loads(original)  # written by this test's own dcp.save
        replaced = edit(meta)
        cases[name] = pickle.dumps(meta if replaced is None else replaced, protocol=4)
    refused = 0
    for name, data in cases.items():
        assert data != original, name
        path = Path(shutil.copytree(source, tmp_path / name))
        (path / ".metadata").write_bytes(data)
        fast, slow = outcome(path, True, monkeypatch), outcome(path, False, monkeypatch)
        assert fast == slow, name
        refused += isinstance(fast, str)
    assert refused >= len(cases) - 1  # all but the quantized dtype, which torch describes


def _saved(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def _zip_of(members: list) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        adversarial.write_zip(Path(d) / "z", members)
        return (Path(d) / "z").read_bytes()


def _bytes_entry_edits(canary: Path) -> dict[str, Any]:
    """Named edits of a DCP directory's bytes entry ``optim.param_groups.0.lr``: ``edit(info, distcp_bytes)``
    changes its storage info in place and returns the .distcp file's new bytes (a new record goes at its end)."""
    from tests.adversarial import as_weight, benign_zip_members, call, glob, proto, u, with_data_pkl, zip64_two_directories

    payload = call(glob("posix", "system"), u(f"touch {canary}"))
    hostile = proto(2) + payload + b"."
    tensor_zip = _saved({"w": torch.arange(4.0)})
    pkl = next(d for n, d in benign_zip_members() if n.endswith("data.pkl"))

    def record(data: bytes) -> Any:
        def edit(info: Any, distcp: bytes) -> bytes:
            info.offset, info.length = len(distcp), len(data)
            return distcp + data
        return edit

    def truncated(info: Any, distcp: bytes) -> bytes:
        return distcp[: info.offset + info.length // 2]

    def past_the_end(info: Any, distcp: bytes) -> bytes:
        info.offset = len(distcp) - info.length // 2
        return distcp

    def cut(info: Any, distcp: bytes) -> bytes:
        info.length -= 30  # inside the file, the zip's end cut off
        return distcp

    def negative(info: Any, distcp: bytes) -> bytes:
        info.offset = -1
        return distcp

    def transformed(info: Any, distcp: bytes) -> bytes:
        info.transform_descriptors = ["zstd"]
        return distcp

    def overlapping(info: Any, distcp: bytes) -> bytes:  # the next entry's record read as this one too
        info.offset += 5
        return distcp

    return {
        "truncated": truncated, "past-the-end": past_the_end, "cut": cut, "negative-offset": negative,
        "overlapping": overlapping, "transforms": transformed,
        "os-system": record(_zip_of(with_data_pkl(hostile))),
        "os-system-in-other-member": record(_zip_of([*benign_zip_members(), ("archive/x.pkl", hostile)])),
        "readers-disagree": record(zip64_two_directories(
            benign_zip_members(), with_data_pkl(hostile))),
        "torchscript": record(_zip_of([*benign_zip_members(), ("archive/constants.pkl", pkl)])),
        "legacy-torch-save": record(_saved(0.5, _use_new_zipfile_serialization=False)),
        "not-a-zip": record(hostile),
        "trailing-pickle": record(_zip_of(with_data_pkl(pkl[:-1] + b"." + hostile))),
        "record-size-mismatch": record(_zip_of([(n, d + b"\0" * 4 if n.endswith("data/0") else d)
                                               for n, d in benign_zip_members()])),
        "tensor-value": record(tensor_zip),
        "shared-record": record(_saved((torch.arange(4.0), torch.arange(4.0)[1:]))),
        "huge-record": record(_saved(torch.zeros(10_000))),  # over the max_pickle_bytes the test sets; its pickle not
        "weight-bytes": record(_zip_of(with_data_pkl(as_weight(u("w"))))),
        "no-version": record(_zip_of([(n, d) for n, d in benign_zip_members() if not n.endswith("version")])),
        "bad-alignment": record(_zip_of([(n, b"x" if n.endswith(".storage_alignment") else d)
                                         for n, d in benign_zip_members()])),
    }


@pytest.mark.filterwarnings("ignore:.*Duplicate name:UserWarning")
def test_dcp_malformed_bytes_entries_refused_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes entries truncated, out of range, overlapping, hostile, or zips that read two ways: the same
    outcome through both paths (torch's refusal, or the same description), and nothing run."""
    import pickle
    import shutil

    canary = tmp_path / "canary"
    source = FIXTURES / "mlp_fsdp2"
    original = (source / ".metadata").read_bytes()
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_BYTES", "30000")  # above .metadata's size, below huge-record's
    outcomes: dict[str, Any] = {}
    torch_free: list[str] = []
    for name, edit in _bytes_entry_edits(canary).items():
        path = Path(shutil.copytree(source, tmp_path / name))
        meta = pickle.loads(original)  # the committed fixture, written by dcp.save
        info = next(v for k, v in meta.storage_data.items() if k.fqn == "optim.param_groups.0.lr")
        distcp = path / info.relative_path
        distcp.write_bytes(edit(info, distcp.read_bytes()))
        (path / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
        with adversarial.audit_events() as events:
            fast, slow = outcome(path, True, monkeypatch), outcome(path, False, monkeypatch)
        assert fast == slow, name
        assert not events and not canary.exists(), name
        outcomes[name] = fast if isinstance(fast, str) else "described"
        try:
            describe(str(path), DCP)
            torch_free.append(name)
        except NeedsTorch:
            pass
    # described without torch where the record is a plain torch.save zip (os.system in it: an inert placeholder, which
    # every verb then refuses inside the state dict); the rest through torch's read
    assert torch_free == ["os-system", "tensor-value", "shared-record", "weight-bytes"]
    assert outcomes == {
        "truncated": "FormatError", "past-the-end": "FormatError", "cut": "FormatError",
        "negative-offset": "FormatError", "overlapping": "FormatError", "transforms": "FormatError",
        "os-system": "described", "os-system-in-other-member": "described",  # (an inert placeholder beside the model)
        "readers-disagree": "described", "torchscript": "UnsafeCheckpointError", "legacy-torch-save": "described",
        "not-a-zip": "UnsafeCheckpointError", "trailing-pickle": "described", "record-size-mismatch": "FormatError",
        "tensor-value": "described", "shared-record": "described", "huge-record": "LimitError",
        "weight-bytes": "described", "no-version": "FormatError", "bad-alignment": "FormatError",
    }
