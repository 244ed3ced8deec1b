"""Sharded checkpoints (Hugging Face layout): split, names, index, validation, lazy reads, atomic dirs.

The layout is checked against what the Hugging Face code does (transformers is not installed here):
- huggingface_hub ``src/huggingface_hub/serialization/_base.py``, ``split_state_dict_into_shards_factory``:
  keys in order, a new shard when the next tensor would pass the limit, a larger tensor alone,
  keys sharing a storage put with the first and counted once in ``total_size`` (``numel × itemsize``),
  names ``model{suffix}`` with suffix ``-{i:05d}-of-{n:05d}``, and one shard → no suffix, no index.
- transformers ``src/transformers/modeling_utils.py``, ``PreTrainedModel.save_pretrained``: index
  ``{"metadata": {...total_size}, "weight_map": {key: file}}`` at ``model.safetensors.index.json``
  (``pytorch_model.bin.index.json`` for ``pytorch_model{suffix}.bin``), shards with safetensors
  metadata ``{"format": "pt"}``; ``from_pretrained`` loads ``sorted(set(weight_map.values()))``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix import formats
from ckptfix.core.atomic import check_destination_dir
from ckptfix.core.devices import DevicePlan
from ckptfix.core.units import parse_size
from ckptfix.errors import ConversionError, DestinationError, FormatError
from ckptfix.formats import base, sharded
from ckptfix.parse.checkpoint_dirs import find_index
from ckptfix.parse.format_registry import sharded_as
from tests.page_cache import mapped_from

FMTS = {"safetensors": formats.SAFETENSORS, "pth": formats.TORCH_ZIP}


def index_of(fmt: str) -> str:
    """The index file a sharded output of ``fmt`` files has."""
    return str(sharded_as(fmt).index_name)


def read_sharded(index: str, plan: DevicePlan, trust: bool = False) -> base.RawRead:
    return formats.read(index, formats.sniff(index), plan, trust)


@pytest.fixture
def sd(fixtures_dir: Path) -> OrderedDict:
    """The trained MLP's state dict (6 tensors, 3204 bytes, with _metadata)."""
    return torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def hf_load(folder: Path, fmt: str) -> dict[str, torch.Tensor]:
    """What from_pretrained does with a sharded folder: every file the weight_map names, merged."""
    from safetensors.torch import load_file

    index = json.loads((folder / index_of(fmt)).read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(folder / name) if fmt == formats.SAFETENSORS else torch.load(folder / name, weights_only=True)
        out.update(part)
    return out


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("size", ["5GB", "5 GB", "40KB", "1KiB", "2MiB", "1.5GB", "1000", 1000])
def test_parse_size(size: Any) -> None:
    want = {"5GB": 5 * 10**9, "5 GB": 5 * 10**9, "40KB": 40_000, "1KiB": 1024, "2MiB": 2 * 2**20,
            "1.5GB": 1_500_000_000, "1000": 1000, 1000: 1000}[size]
    assert parse_size(size) == want


@pytest.mark.parametrize("size", ["", "5 apples", "GB", "-1KB", "0", "5Gb", "1e9"])
def test_parse_size_refuses(size: str) -> None:
    with pytest.raises(ConversionError, match="size"):
        parse_size(size)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("max_size", "count"), [(10**6, 1), (3000, 2), (1, 6)])
def test_write_splits_like_huggingface(sd: OrderedDict, tmp_path: Path, fmt: str, max_size: int, count: int) -> None:
    out = tmp_path / "out"
    formats.write_sharded(sd, str(out), FMTS[fmt], max_size)
    names = sharded.shard_names(sharded_as(FMTS[fmt]).name, count)
    index_name = index_of(FMTS[fmt])
    if count == 1:  # save_pretrained: one shard → model.safetensors / pytorch_model.bin, no index
        assert sorted(p.name for p in out.iterdir()) == names == [("model.safetensors", "pytorch_model.bin")[fmt == "pth"]]
        return
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, index_name])
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    assert names == [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]
    index = json.loads((out / index_name).read_text())
    assert list(index) == ["metadata", "weight_map"]
    assert index["metadata"] == {"total_size": sum(nbytes(t) for t in sd.values())}
    assert list(index["weight_map"]) == list(sd)
    # greedy in key order: each shard within the limit (or one tensor), the next tensor didn't fit
    runs = [[k for k, v in index["weight_map"].items() if v == name] for name in names]
    assert [k for run in runs for k in run] == list(sd)
    sizes = [sum(nbytes(sd[k]) for k in run) for run in runs]
    for run, size in zip(runs, sizes, strict=True):
        assert size <= max_size or len(run) == 1
    for size, nxt in zip(sizes[:-1], runs[1:], strict=True):
        assert size + nbytes(sd[nxt[0]]) > max_size
    assert_same(OrderedDict((k, hf_load(out, FMTS[fmt])[k]) for k in sd), sd)
    if fmt == "safetensors":
        from safetensors import safe_open

        for name, run in zip(names, runs, strict=True):
            with safe_open(out / name, "pt") as f:
                assert sorted(f.keys()) == sorted(run) and f.metadata()["format"] == "pt"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("max_size", [3000, 1])
def test_read_back_bit_exact(sd: OrderedDict, tmp_path: Path, fmt: str, max_size: int) -> None:
    formats.write_sharded(sd, str(tmp_path / "out"), FMTS[fmt], max_size)
    index = find_index(str(tmp_path / "out"))
    assert index is not None
    raw = read_sharded(index, DevicePlan("cpu"), trust=False)
    assert raw.format == ("sharded-safetensors" if fmt == "safetensors" else "sharded-pth")
    assert_same(raw.obj, sd)
    assert raw.obj._metadata == sd._metadata  # rides in the first shard
    meta = read_sharded(index, DevicePlan("meta"), trust=False).obj
    assert list(meta) == list(sd) and all(t.device.type == "meta" and t.shape == sd[k].shape for k, t in meta.items())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", FMTS)
def test_read_is_lazy_tensors_stay_in_the_shard_files(sd: OrderedDict, tmp_path: Path, fmt: str) -> None:
    formats.write_sharded(sd, str(tmp_path / "out"), FMTS[fmt], 1)
    raw = read_sharded(str(tmp_path / "out" / index_of(FMTS[fmt])), DevicePlan("cpu"), trust=False)
    index = json.loads((tmp_path / "out" / index_of(FMTS[fmt])).read_text())
    for key, t in raw.obj.items():
        assert mapped_from(t) == str(tmp_path / "out" / index["weight_map"][key]), key


@pytest.mark.parametrize("fmt", FMTS)
def test_structure_read_streams_into_any_output(sd: OrderedDict, tmp_path: Path, fmt: str) -> None:
    """A meta read gives refs for every storage: shards → one file, and re-sharding, copy bytes without loading."""
    formats.write_sharded(sd, str(tmp_path / "src"), FMTS[fmt], 3000)
    raw = read_sharded(find_index(str(tmp_path / "src")), DevicePlan("meta"), trust=False)
    assert {base.StorageRef} == {type(r) for r in raw.refs.values()} and len(raw.refs) == len(sd)
    formats.write(raw.obj, str(tmp_path / "one.safetensors"), formats.SAFETENSORS, refs=raw.refs)
    assert_same(formats.read(str(tmp_path / "one.safetensors"), formats.SAFETENSORS, DevicePlan("cpu"), False).obj, sd)
    formats.write_sharded(raw.obj, str(tmp_path / "resharded"), FMTS[fmt], 1, refs=raw.refs)
    back = read_sharded(find_index(str(tmp_path / "resharded")), DevicePlan("cpu"), trust=False)
    assert_same(back.obj, sd)


@pytest.mark.parametrize("fmt", FMTS)
def test_tied_weights_share_a_shard_and_are_written_once(tmp_path: Path, fmt: str) -> None:
    emb = torch.randn(8, 4)
    tied = OrderedDict([("emb.weight", emb), ("mid.weight", torch.randn(4, 4)), ("head.weight", emb)])
    formats.write_sharded(tied, str(tmp_path / "out"), FMTS[fmt], 1)
    index = json.loads((tmp_path / "out" / index_of(FMTS[fmt])).read_text())
    assert index["metadata"]["total_size"] == nbytes(emb) + 64  # the shared storage counted once
    first = index["weight_map"]["emb.weight"]
    if fmt == "safetensors":  # safetensors can't hold a shared tensor twice: ckptfix records the alias
        assert "head.weight" not in index["weight_map"]
    else:
        assert index["weight_map"]["head.weight"] == first
    raw = read_sharded(str(tmp_path / "out" / index_of(FMTS[fmt])), DevicePlan("cpu"), trust=False)
    # a safetensors alias isn't in the weight_map: it comes back right after the key it aliases
    order = ["emb.weight", "head.weight", "mid.weight"] if fmt == "safetensors" else list(tied)
    assert_same(raw.obj, OrderedDict((k, tied[k]) for k in order))
    assert raw.obj["head.weight"].data_ptr() == raw.obj["emb.weight"].data_ptr()


def _aliasing_shards(out: Path, alias_in_both: bool) -> Path:
    """Two safetensors shards and their index: ``a`` in shard 1 (safetensors' own writer), ``b`` in shard 2
    (ckptfix's writer, a tied ``b``/``a`` pair: ``a`` recorded in its header as an alias of ``b``). With
    ``alias_in_both`` ``a`` is left out of the index and shard 1 is ckptfix's too, recording ``a`` as
    an alias of its own tensor ``c``."""
    from safetensors.torch import save_file

    out.mkdir()
    b, c = torch.full((2, 2), 2.0), torch.full((2, 2), 3.0)
    formats.write_sharded(OrderedDict([("b", b), ("a", b)]), str(out / "two"), formats.SAFETENSORS, 10**6)
    (out / "two" / "model.safetensors").rename(out / "model-00002-of-00002.safetensors")
    first = out / "model-00001-of-00002.safetensors"
    if alias_in_both:
        formats.write_sharded(OrderedDict([("c", c), ("a", c)]), str(out / "one"), formats.SAFETENSORS, 10**6)
        (out / "one" / "model.safetensors").rename(first)
        weight_map = {"c": first.name, "b": "model-00002-of-00002.safetensors"}
    else:
        save_file({"a": torch.ones(2, 2)}, str(first), metadata={"format": "pt"})
        weight_map = {"a": first.name, "b": "model-00002-of-00002.safetensors"}
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("alias_in_both", [False, True], ids=["alias-of-a-listed-key", "alias-in-two-shards"])
def test_a_shards_alias_cannot_override_another_shards_key(tmp_path: Path, alias_in_both: bool, cli_runner) -> None:
    """Each key comes from the one shard the index names for it (an alias: the one shard recording it)."""
    from ckptfix.cli import cli

    index = _aliasing_shards(tmp_path / "out", alias_in_both)
    if not alias_in_both:  # what from_pretrained does: every listed file loaded; safetensors ignores the alias
        assert torch.equal(hf_load(index.parent, formats.SAFETENSORS)["a"], torch.ones(2, 2))
    message = r"model-00002-of-00002\.safetensors records 'a' as an alias.*, but 'a' comes from model-00001"
    for plan in ("cpu", "meta"):
        with pytest.raises(FormatError, match=message) as e:
            read_sharded(str(index), DevicePlan(plan), trust=False)
        assert "model.safetensors.index.json" in str(e.value)
    with pytest.raises(FormatError, match=message):
        formats.describe(str(index), formats.sniff(str(index)))
    res = cli_runner.invoke(cli, ["convert", str(index.parent), str(tmp_path / "model.safetensors")])
    assert res.exit_code == 1 and len(res.stderr.splitlines()) == 1 and "'a'" in res.stderr, res.output
    assert not (tmp_path / "model.safetensors").exists()


# --- index validation: each broken index is a FormatError naming the index and the problem ---

def _outside_copy(out: Path, shard: str) -> Path:
    target = out.parent / ("outside" + Path(shard).suffix)
    target.write_bytes((out / shard).read_bytes())
    return target


def _symlink_out(out: Path, shard: str) -> None:
    target = _outside_copy(out, shard)
    (out / shard).unlink()
    (out / shard).symlink_to(target)


def _remap(out: Path, index_name: str, shard: str, to: str) -> None:
    path = out / index_name
    index = json.loads(path.read_text())
    index["weight_map"] = {k: (to if v == shard else v) for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))


def _edit(out: Path, index_name: str, fn: Callable[[dict], None]) -> None:
    path = out / index_name
    index = json.loads(path.read_text())
    fn(index["weight_map"])
    path.write_text(json.dumps(index))


def _duplicate_key(out: Path, index_name: str, shard: str) -> None:
    path = out / index_name
    text = path.read_text()
    key, value = next(iter(json.loads(text)["weight_map"].items()))
    line = f'"{key}": "{value}",'
    path.write_text(text.replace(line, line + "\n    " + f'"{key}": "{shard}",', 1))


BREAKS: dict[str, tuple[Callable[[Path, str, str], None], str]] = {
    "missing shard": (lambda out, ix, shard: (out / shard).unlink(), "is missing from"),
    "dotdot path": (lambda out, ix, shard: (_outside_copy(out, shard), _remap(out, ix, shard, "../outside" + Path(shard).suffix)),
                    "leaves the directory"),
    "absolute path": (lambda out, ix, shard: _remap(out, ix, shard, str(_outside_copy(out, shard))), "is absolute"),
    "symlink out": (lambda out, ix, shard: _symlink_out(out, shard), "is a symlink to"),
    "duplicate key": (_duplicate_key, "listed twice"),
    "listed key not in shard": (lambda out, ix, shard: _edit(out, ix, lambda wm: wm.update({"ghost.weight": shard})),
                                "has no such tensor"),
    "unlisted tensor in shard": (lambda out, ix, shard: _edit(out, ix,
                                                              lambda wm: wm.pop(next(k for k, v in wm.items() if v == shard))),
                                 "does not list"),
}


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", BREAKS)
def test_index_validation(sd: OrderedDict, tmp_path: Path, fmt: str, case: str) -> None:
    out = tmp_path / "out"
    formats.write_sharded(sd, str(out), FMTS[fmt], 3000)
    index_name = index_of(FMTS[fmt])
    shard = sharded.shard_names(sharded_as(FMTS[fmt]).name, 2)[1]
    breaker, message = BREAKS[case]
    breaker(out, index_name, shard)
    for plan in ("cpu", "meta"):
        with pytest.raises(FormatError, match=message) as e:
            read_sharded(str(out / index_name), DevicePlan(plan), trust=False)
        assert index_name in str(e.value)


@pytest.mark.parametrize(("text", "message"), [("{not json", "not valid JSON"), ('{"metadata": {}}', "no \"weight_map\""),
                                                ('{"weight_map": {"a": 3}}', "not a shard file name")])
def test_malformed_index(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(FormatError, match=message):
        read_sharded(str(tmp_path / "model.safetensors.index.json"), DevicePlan("cpu"), trust=False)


def test_find_index(sd: OrderedDict, tmp_path: Path) -> None:
    formats.write_sharded(sd, str(tmp_path / "st"), formats.SAFETENSORS, 3000)
    index = str(tmp_path / "st" / "model.safetensors.index.json")
    assert find_index(str(tmp_path / "st")) == index
    assert find_index(index) == index
    assert find_index(str(tmp_path / "st" / "model-00001-of-00002.safetensors")) is None
    assert find_index(str(tmp_path / "nowhere")) is None
    formats.write_sharded(sd, str(tmp_path / "one"), formats.SAFETENSORS, 10**6)
    assert find_index(str(tmp_path / "one")) is None  # a single model.safetensors: no index
    formats.write_sharded(sd, str(tmp_path / "pt"), formats.TORCH_ZIP, 3000)
    (tmp_path / "st" / "pytorch_model.bin.index.json").write_text((tmp_path / "pt" / "pytorch_model.bin.index.json").read_text())
    assert find_index(str(tmp_path / "st")) == index  # both: safetensors, and read says so
    notes = read_sharded(index, DevicePlan("meta"), trust=False).notes
    assert any("pytorch_model.bin.index.json" in n for n in notes)


def test_refuses_what_a_shard_cant_hold(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="not a tensor"):
        formats.write_sharded({"w": torch.ones(2), "step": 3}, str(tmp_path / "o"), formats.TORCH_ZIP, 10)
    with pytest.raises(ConversionError, match="meta"):
        formats.write_sharded({"w": torch.ones(2, device="meta")}, str(tmp_path / "o"), formats.SAFETENSORS, 10)
    assert not (tmp_path / "o").exists()


# --- directory outputs are atomic (sharded and DCP share atomic.atomic_dir) ---

def _write_sharded_st(sd: Any, dst: Path, force: bool = False) -> None:
    formats.write_sharded(sd, str(dst), formats.SAFETENSORS, 3000, force=force)


def _write_sharded_pth(sd: Any, dst: Path, force: bool = False) -> None:
    formats.write_sharded(sd, str(dst), formats.TORCH_ZIP, 3000, force=force)


def _write_dcp(sd: Any, dst: Path, force: bool = False) -> None:
    from ckptfix.formats.dcp import directory as dcp

    dcp.write(sd, str(dst), force=force)


WRITERS = {"sharded-safetensors": _write_sharded_st, "sharded-pth": _write_sharded_pth, "dcp": _write_dcp}


@pytest.mark.parametrize("writer", WRITERS)
def test_existing_dst_dir_needs_force(sd: OrderedDict, tmp_path: Path, writer: str) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    with pytest.raises(DestinationError, match="non-empty directory"):
        WRITERS[writer](sd, dst)
    assert [p.name for p in dst.iterdir()] == ["precious.txt"]
    WRITERS[writer](sd, dst, force=True)
    assert (dst / "precious.txt").read_text() == "keep me"  # --force replaces the output's own files only
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or set-aside directory left
    (tmp_path / "empty").mkdir()
    WRITERS[writer](sd, tmp_path / "empty")  # an empty directory is simply filled
    (tmp_path / "file").write_text("x")
    with pytest.raises(DestinationError, match="is a file"):
        WRITERS[writer](sd, tmp_path / "file")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("writer", WRITERS)
def test_failure_mid_write_leaves_nothing(sd: OrderedDict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          writer: str, interrupt: type[BaseException]) -> None:
    """Die after the first file is on disk: neither dst nor any temp directory may remain."""
    import torch.distributed.checkpoint as tdcp

    real = formats.write if writer != "dcp" else None

    def first_file_then_die(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if real is not None:
            real(obj, *args, **kwargs)
        else:
            Path(kwargs["storage_writer"].path, "__0_0.distcp").write_bytes(b"partial")
        raise interrupt(28, "No space left on device") if interrupt is OSError else interrupt()

    if writer == "dcp":
        monkeypatch.setattr(tdcp, "save", first_file_then_die)
    else:
        monkeypatch.setattr(formats, "write", first_file_then_die)
    with pytest.raises(DestinationError if interrupt is OSError else KeyboardInterrupt):
        WRITERS[writer](sd, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_destination_dir_may_not_hold_the_source(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    src = tmp_path / "d" / "model.safetensors.index.json"
    src.write_text("{}")
    for dst in (tmp_path / "d", tmp_path):
        with pytest.raises(DestinationError, match="holds the source"):
            check_destination_dir(str(src), str(dst), force=True)
    check_destination_dir(str(src), str(tmp_path / "elsewhere"), force=False)


# --- --force into a directory the user keeps other files in: only the output's own files change ---

# (convert options, the old output already in the directory: files of the same names, more of them)
OUTPUTS = {
    "sharded-safetensors": ({"max_shard_size": 3000}, {"max_shard_size": 1, "format": "safetensors"}),
    "sharded-pth": ({"max_shard_size": 3000, "format": "pth"}, {"max_shard_size": 1, "format": "pth"}),
    "dcp": ({"format": "dcp"}, None),  # None: the FSDP2 fixture, whose __1_0.distcp a 1-rank save doesn't write
}
# 6 shards and an index replaced by model.safetensors alone: the old index must go (readers would take it)
FORCE_CASES = {**OUTPUTS, "sharded-to-one": ({"max_shard_size": "1GB"}, {"max_shard_size": 1, "format": "safetensors"})}


def _user_files(dst: Path) -> dict[str, Any]:
    """Everything a user might keep beside the weights, and what it is."""
    dst.mkdir(exist_ok=True)
    before = set(os.listdir(dst))
    (dst / "config.json").write_text('{"hidden_size": 16}')
    (dst / "notes.md").write_text("trained on the 2024 split")
    (dst / ".gitattributes").write_text("*.safetensors filter=lfs")
    (dst / "model.safetensors.bak").write_text("an old copy, not a name ckptfix writes")
    (dst / "runs").mkdir()
    (dst / "runs" / "model-00001-of-00001.safetensors").write_text("in a subdirectory: never touched")
    os.symlink("config.json", dst / "latest-config")
    return {k: v for k, v in _listing(dst).items() if k not in before}


def _previous_output(dst: Path, old: dict | None, fixtures_dir: Path) -> Path:
    """An earlier output in ``dst``: the fsdp2 DCP fixture (``old`` None) or mlp_single converted with ``old``."""
    import ckptfix

    if old is None:
        shutil.copytree(fixtures_dir / "mlp_fsdp2", dst)
    else:
        ckptfix.convert(fixtures_dir / "mlp_single.pth", dst, **old)
    return dst


def _listing(dst: Path) -> dict[str, Any]:
    return {p.name: (p.readlink() if p.is_symlink() else sorted(os.listdir(p)) if p.is_dir() else p.read_bytes())
            for p in dst.iterdir()}


@pytest.mark.parametrize("output", FORCE_CASES)
def test_force_replaces_only_the_outputs_own_files(output: str, tmp_path: Path, fixtures_dir: Path) -> None:
    import ckptfix

    new, old = FORCE_CASES[output]
    dst = _previous_output(tmp_path / "out", old, fixtures_dir)
    old_names = {p.name for p in dst.iterdir()}
    user = _user_files(dst)
    report = ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, force=True, **new)
    after = _listing(dst)
    assert {k: v for k, v in after.items() if k in user} == user  # every user entry as it was
    new_names = set(after) - set(user)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp directory left beside it
    stale = old_names - new_names
    assert stale  # the old output had files the new one doesn't: they are gone, not left beside the new index
    written = dst / "model.safetensors" if output == "sharded-to-one" else dst  # one shard: no index
    assert_same(ckptfix.load(written), ckptfix.load(fixtures_dir / "mlp_ddp.pth"))
    kept = next(n for n in report.notes if n.startswith("kept 6 entries"))
    assert all(name in kept for name in ("config.json", "notes.md", ".gitattributes", "runs/", "latest-config"))
    removed = next(n for n in report.notes if n.startswith(f"removed {len(stale)} file(s) of the previous"))
    assert all(name in removed for name in stale)


@pytest.mark.parametrize("output", OUTPUTS)
def test_force_refuses_a_symlink_or_directory_of_an_output_name(output: str, tmp_path: Path, fixtures_dir: Path) -> None:
    import ckptfix

    new, _old = OUTPUTS[output]
    name = {"sharded-safetensors": "model-00001-of-00002.safetensors", "sharded-pth": "pytorch_model.bin.index.json",
            "dcp": ".metadata"}[output]
    for kind in ("symlink", "directory"):
        dst = tmp_path / kind
        user = _user_files(dst)
        if kind == "symlink":
            os.symlink("config.json", dst / name)
        else:
            (dst / name).mkdir()
        before = _listing(dst)
        with pytest.raises(DestinationError, match=f"{name}: is a {kind}.*replaces only regular files"):
            ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, force=True, **new)
        assert _listing(dst) == before and set(before) == set(user) | {name}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["directory", "symlink"]


@pytest.mark.parametrize("output", OUTPUTS)
def test_force_failing_mid_replace_leaves_no_index_over_a_mix(output: str, tmp_path: Path, fixtures_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The old manifest (index / .metadata) goes first and the new one comes last: a failure between
    leaves no manifest naming a mix of old and new files, and the user's files as they were."""
    import ckptfix

    new, old = OUTPUTS[output]
    dst = _previous_output(tmp_path / "out", old, fixtures_dir)
    manifest = {"sharded-safetensors": "model.safetensors.index.json", "sharded-pth": "pytorch_model.bin.index.json",
                "dcp": ".metadata"}[output]
    assert (dst / manifest).exists()
    user = _user_files(dst)
    real_replace, moved = os.replace, []

    def replace_once(a: Any, b: Any) -> None:
        if moved:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        moved.append(b)
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace_once)
    with pytest.raises(DestinationError, match="moving the new files in failed.*holds no complete.*run the conversion again"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, force=True, **new)
    monkeypatch.undo()
    assert moved and not (dst / manifest).exists()
    assert {k: v for k, v in _listing(dst).items() if k in user} == user
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, force=True, **new)  # running it again mends it
    assert_same(ckptfix.load(dst), ckptfix.load(fixtures_dir / "mlp_ddp.pth"))
