"""The torch-free convert path (``ckptfix.formats.plan_write``) against the torch path (``CKPTFIX_TORCH_FREE=0``).

- for every committed fixture the torch-free reader describes, and hypothesis-generated checkpoints
  (views, shared storages, offsets, non-contiguous tensors, every dtype, Parameters, ``_metadata``,
  nested training dicts with ``keep_extra``), both paths write the same output: safetensors files
  byte for byte, torch zips member for member (``data.pkl`` included; only the ``serialization_id``
  differs: each writer hashes the records its own way) and loading to the same objects under ``torch.load(weights_only=True)``;
- the same for sharded output (``max_shard_size``): the same shard files, each as above, and the same
  index JSON byte for byte;
- ``ckptfix convert a.pth b.pth`` / ``b.safetensors`` / ``--max-shard-size`` into a directory leaves
  torch unimported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.ops.convert import steps as conversion
from ckptfix.errors import UnsafeCheckpointError
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.formats import describe, sniff
from tests import quant_files
from tests.compare import raw_bytes
from tests.describe_both import DESCRIBED, PROBE, safetensors_copy, save_both
from tests.strategies import checkpoints

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ROOT = FIXTURES.parent
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


def _convert(src: Path, dst: Path, torch_free: bool, mp: pytest.MonkeyPatch, **options: Any) -> Any:
    """``convert`` through one path: (whether the torch-free writer wrote it, the report), or the error class."""
    mp.setenv(ENV_SWITCH, "1" if torch_free else "0")
    took: list[bool] = []
    real = conversion.write_torch_free

    def spy(*args: Any, **kwargs: Any) -> Any:
        notes = real(*args, **kwargs)
        took.append(True)
        return notes

    mp.setattr(conversion, "write_torch_free", spy)
    try:
        report = ckptfix.convert(src, dst, force=True, **options)
    except ckptfix.CkptfixError as e:
        return type(e).__name__
    finally:
        mp.setattr(conversion, "write_torch_free", real)
    return bool(took), report


def assert_same_output(fast: Path, slow: Path, loads: bool) -> None:
    if slow.is_dir():  # sharded: the same files, each the same
        names = sorted(p.name for p in slow.iterdir())
        assert sorted(p.name for p in fast.iterdir()) == names
        for name in names:
            assert_same_output(fast / name, slow / name, loads)
        return
    if fast.suffix in (".safetensors", ".json"):
        assert fast.read_bytes() == slow.read_bytes()
        return
    with zipfile.ZipFile(fast) as zf, zipfile.ZipFile(slow) as zs:
        names_f, names_s = zf.namelist(), zs.namelist()
        assert [n.split("/", 1)[1] for n in names_f] == [n.split("/", 1)[1] for n in names_s]
        for nf, ns in zip(names_f, names_s):
            if not nf.endswith("serialization_id"):
                assert zf.read(nf) == zs.read(ns), nf
    if not loads:  # torch's own output of objects weights_only refuses (mmengine's, with keep_extra)
        return
    got = torch.load(fast, weights_only=True, map_location="cpu")
    want = torch.load(slow, weights_only=True, map_location="cpu")
    storages_f: list[int] = []
    storages_s: list[int] = []
    assert_same_objects(got, want, storages_f, storages_s)
    # the same storage sharing: equal partitions of the tensors by storage
    assert [storages_f.index(p) for p in storages_f] == [storages_s.index(p) for p in storages_s]


def assert_same_objects(got: Any, want: Any, storages_f: list[int], storages_s: list[int]) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.requires_grad) == \
            (want.dtype, want.shape, want.stride(), want.storage_offset(), want.requires_grad)
        assert torch.equal(raw_bytes(got), raw_bytes(want))
        storages_f.append(got.untyped_storage().data_ptr())
        storages_s.append(want.untyped_storage().data_ptr())
    elif isinstance(want, dict):
        assert list(got) == list(want)
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None)
        for k in want:
            assert_same_objects(got[k], want[k], storages_f, storages_s)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_objects(g, w, storages_f, storages_s)
    else:
        assert got == want


def assert_same_convert(src: Path, out: Path, mp: pytest.MonkeyPatch, suffix: str, **options: Any) -> bool:
    """Convert ``src`` both ways; the outputs agree. Returns whether the torch-free writer was taken."""
    fast_dst, slow_dst = out / f"fast{suffix}", out / f"slow{suffix}"
    fast = _convert(src, fast_dst, True, mp, **options)
    slow = _convert(src, slow_dst, False, mp, **options)
    if isinstance(slow, str) or isinstance(fast, str):
        assert fast == slow, src
        return False
    assert slow[0] is False
    took, report = fast
    assert report.to_dict() | {"seconds": 0, "peak_rss": 0, "dst": ""} == \
        slow[1].to_dict() | {"seconds": 0, "peak_rss": 0, "dst": ""}
    assert_same_output(fast_dst, slow_dst, loads=took)
    return took


# -- the committed fixtures ---------------------------------------------------------------------------

def _describable_fixtures() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir() if (p.is_file() or p.is_dir() and not p.name.startswith(("_", ".")))
                  and p.suffix != ".py" and p.name != "manifest.json" and p != quant_files.QUANT
                  and sniff(str(p)) in DESCRIBED)


@pytest.mark.parametrize("suffix,options", [(".pth", {}), (".safetensors", {}), (".pth", {"keep_extra": True}),
                                            (".pth", {"to": "ddp", "rename": ["(.*)bias=\\1b"]})],
                         ids=["pth", "safetensors", "keep-extra", "renamed"])
def test_fixtures_convert_the_same(suffix: str, options: dict, tmp_path: Path) -> None:
    taken = []
    with pytest.MonkeyPatch.context() as mp:
        for src in _describable_fixtures():
            out = tmp_path / src.name
            out.mkdir()
            if assert_same_convert(src, out, mp, suffix, **options):
                taken.append(src.name)
    assert {"mlp_ddp.pth", "mlp_single.pth", "mlp_cuda1.pth", "mlp_safetensors.safetensors"} <= set(taken), taken


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("max_shard_size", [1, 1000, "1GB"], ids=["one-per-tensor", "several", "one-shard"])
def test_fixtures_shard_the_same(fmt: str, max_shard_size: int | str, tmp_path: Path) -> None:
    taken = []
    with pytest.MonkeyPatch.context() as mp:
        for src in _describable_fixtures():
            out = tmp_path / src.name
            out.mkdir()
            if assert_same_convert(src, out, mp, "", format=fmt, max_shard_size=max_shard_size):
                taken.append(src.name)
    assert {"mlp_ddp.pth", "mlp_single.pth", "mlp_cuda1.pth", "mlp_safetensors.safetensors"} <= set(taken), taken


def test_gpu_saved_file_with_a_mapping(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        assert assert_same_convert(FIXTURES / "mlp_cuda1.pth", tmp_path, mp, ".pth", map_location={"cuda:1": "cpu"})
        assert assert_same_convert(FIXTURES / "mlp_cuda1.pth", tmp_path, mp, ".safetensors", map_location=None) \
            is False  # saved on cuda:1, asked to stay there: torch's path (and its refusal on this machine)


# -- hypothesis --------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(obj=checkpoints(), prefix=st.sampled_from([None, "module", "model._orig_mod"]))
def test_random_checkpoints_convert_the_same(obj: Any, prefix: str | None,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("rand")
    save_both(obj, d)
    with pytest.MonkeyPatch.context() as mp:
        for src in (d / "ckpt.pth", d / "ckpt.safetensors"):
            for suffix, options in ((".pth", {"keep_extra": src.suffix == ".pth"}), (".safetensors", {})):
                out = d / f"{src.suffix[1:]}-{suffix[1:]}-{len(options)}"
                out.mkdir()
                took = assert_same_convert(src, out, mp, suffix, add_prefix=prefix, **options)
                if src.suffix == ".safetensors" and suffix == ".pth":
                    assert took  # nothing in a safetensors file needs torch to be rewritten as .pth


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(obj=checkpoints(), max_shard_size=st.sampled_from([1, 64, 256, 10**9]))
def test_random_checkpoints_shard_the_same(obj: Any, max_shard_size: int,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("shard")
    sd = save_both(obj, d)
    with pytest.MonkeyPatch.context() as mp:
        for src in (d / "ckpt.pth", d / "ckpt.safetensors"):
            for fmt in ("pth", "safetensors"):
                out = d / f"{src.suffix[1:]}-{fmt}"
                out.mkdir()
                took = assert_same_convert(src, out, mp, "", format=fmt, max_shard_size=max_shard_size)
                if src.suffix == ".safetensors" and fmt == "pth" and safetensors_copy(sd):
                    assert took  # nothing in a safetensors file needs torch to be rewritten as .pth shards


# -- no torch -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("src", ["mlp_ddp.pth", "mlp_safetensors.safetensors"])
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_convert_imports_no_torch(src: str, suffix: str, tmp_path: Path) -> None:
    dst = tmp_path / f"out{suffix}"
    run = subprocess.run([sys.executable, "-c", PROBE, "convert", str(FIXTURES / src), str(dst)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, ENV_SWITCH: "1"})
    assert run.returncode == 0, run.stderr
    assert "TORCH=False" in run.stderr, f"ckptfix convert {src} {dst.name} imported torch"
    assert list(torch.load(dst, weights_only=True)) if suffix == ".pth" else dst.stat().st_size > 0


@pytest.mark.parametrize("src", ["mlp_ddp.pth", "mlp_safetensors.safetensors"])
@pytest.mark.parametrize("fmt,index", [("safetensors", "model.safetensors.index.json"),
                                       ("pth", "pytorch_model.bin.index.json")])
def test_sharded_convert_imports_no_torch(src: str, fmt: str, index: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", PROBE, "convert", str(FIXTURES / src), str(dst),
                          "--max-shard-size", "1000", "--format", fmt],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, ENV_SWITCH: "1"})
    assert run.returncode == 0, run.stderr
    assert "TORCH=False" in run.stderr, f"ckptfix convert {src} --max-shard-size into a directory imported torch"
    assert (dst / index).is_file() and len(list(dst.iterdir())) > 2
    loaded = ckptfix.read(dst)
    assert loaded.stats.num_tensors == ckptfix.read(FIXTURES / src).stats.num_tensors


# -- torch's globals written as stand-ins, then renamed ----------------------------------------------

def _marked(text: str) -> str:
    from ckptfix.formats.torchsave.torch_globals import marker

    return f"c{marker().decode()}\n{text}\n"


MARKED: dict[str, Any] = {  # a value whose pickle would hold a stand-in's GLOBAL bytes: converted through torch
    "key": lambda t: {_marked("_rebuild_tensor_v3"): t, "b": t + 1},
    "key, partly": lambda t: {"w": t, _marked("_rebuild_tensor_v2")[:-4]: t},
    "bytes value": lambda t: {"w": t, "blob": _marked("float16").encode()},
    "huge int": lambda t: {"w": t, "n": int.from_bytes(_marked("FloatStorage").encode(), "little") << 3},
    "int spelling the marker": lambda t: {"w": t, "n": int.from_bytes(_marked("x")[1:-3].encode(), "little")},
}


@pytest.mark.parametrize("name", list(MARKED))
def test_values_holding_the_marker_convert_through_torch(name: str, tmp_path: Path) -> None:
    torch.save(MARKED[name](torch.arange(6.0)), tmp_path / "src.pth")
    with pytest.MonkeyPatch.context() as mp:
        took = assert_same_convert(tmp_path / "src.pth", tmp_path, mp, ".pth", keep_extra=True)
    assert took is False
    out = torch.load(tmp_path / "fast.pth", weights_only=True)
    assert list(out) == list(MARKED[name](torch.arange(6.0)))


def test_stand_ins_rewritten_only_where_written() -> None:
    import pickle

    from ckptfix.formats.torchsave.torch_globals import REBUILD_TENSOR, to_torch

    data = pickle.dumps([REBUILD_TENSOR, REBUILD_TENSOR], protocol=2)
    assert to_torch(data) == data.replace(b"cckptfix.formats.torchsave.torch_globals\n", b"ctorch._utils\n") != data
    for bad in (data + _marked("_rebuild_tensor_v2").encode(), data.replace(b"_rebuild_tensor_v2\n", b"_rebuild_tensorX\n")):
        with pytest.raises(ValueError, match="stand-in"):
            to_torch(bad)


@settings(max_examples=30, deadline=None)
@given(obj=checkpoints())
def test_c_and_python_picklers_write_the_same_bytes(obj: Any) -> None:
    """The C pickler (taken unless a dtype value needs the pure one) writes what the pure-Python one writes."""
    import io
    import tempfile

    from ckptfix.formats.torchsave import planner

    with tempfile.TemporaryDirectory() as d:
        torch.save(obj, f"{d}/ckpt.pth")
        infos = describe(f"{d}/ckpt.pth", "torch-zip").obj
        outs = []
        for pickler in (planner._Pickler, planner._PyPickler):
            buf = io.BytesIO()
            pickler(buf, planner._Records(keep_keys=True)).dump(infos)
            outs.append(buf.getvalue())
    if not planner._check_plain(infos):  # with a dtype value the C pickler can't write it as torch does
        assert outs[0] == outs[1]


class _Unlisted:
    """A class on no allow-list."""


@pytest.mark.parametrize("enabled", [True, False])
def test_convert_leaves_the_garbage_collector_as_it_was(enabled: bool, tmp_path: Path) -> None:
    """``convert`` pauses the cyclic collector while it builds the structure (a caller that imported torch
    would otherwise pay for re-walking torch's objects), and gives it back as it was, error or not."""
    import gc

    seen: list[bool] = []
    real = conversion.write_torch_free

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(conversion, "write_torch_free", spy)
            ckptfix.convert(FIXTURES / "mlp_ddp.pth", tmp_path / "out.pth")
            assert gc.isenabled() is enabled and seen == [False]
            torch.save({"w": torch.ones(2), "step": _Unlisted()}, tmp_path / "unsafe.pth")
            with pytest.raises(UnsafeCheckpointError):  # refused while the structure is read
                ckptfix.convert(tmp_path / "unsafe.pth", tmp_path / "out2.pth")
            assert gc.isenabled() is enabled
    finally:
        gc.enable()
