"""Sparse tensors (issue 27, item 9): COO, CSR, CSC, BSR and BSC, as ``torch.save`` writes them
(``_rebuild_sparse_tensor`` of the layout, the indices and the values). ``convert`` writes them to ``.pth``
exactly as torch saves them, refuses ``.safetensors`` in one line naming the key and the layout, and
``inspect`` shows the layout of each sparse tensor (a strided tensor's row is unchanged). ``load_into`` assigns them
to a meta-built model as torch's ``assign=True`` does, and refuses them for a built dense tensor, as torch does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.errors import ConversionError, LoadError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning",
                                        "ignore:Validating sparse tensor invariants:UserWarning")

DENSE = torch.tensor([[0.0, 1, 0, 0], [2, 0, 0, 3], [0, 0, 0, 0], [4, 0, 5, 0]])

LAYOUTS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: DENSE.to_sparse(),
    "sparse_csr": lambda: DENSE.to_sparse_csr(),
    "sparse_csc": lambda: DENSE.to_sparse_csc(),
    "sparse_bsr": lambda: DENSE.to_sparse_bsr((2, 2)),
    "sparse_bsc": lambda: DENSE.to_sparse_bsc((2, 2)),
}


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got.layout == want.layout and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(got.to_dense(), want.to_dense())
            and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(_parts(got), _parts(want), strict=True))
            and (want.layout != torch.sparse_coo or got.is_coalesced() == want.is_coalesced()))


def _source(layout: str, tmp_path: Path) -> Path:
    path = tmp_path / "src.pth"
    torch.save({"w": LAYOUTS[layout](), "b": torch.arange(3.0)}, path)
    return path


@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free-first", "torch-path"])
@pytest.mark.parametrize("via", ["cli", "library"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pth_output_is_what_torch_saved(layout: str, via: str, torch_free: str, tmp_path: Path, cli_runner: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    src, out = _source(layout, tmp_path), tmp_path / "out.pth"
    if via == "cli":
        res = cli_runner.invoke(cli, ["convert", str(src), str(out), "-q"])
        assert res.exit_code == 0, res.output
    else:
        ckptfix.convert(src, out, progress=False)
    want, got = torch.load(src, weights_only=True), torch.load(out, weights_only=True)
    assert list(got) == ["w", "b"] and torch.equal(got["b"], want["b"])
    assert _same(got["w"], want["w"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_loaded_path_and_shards_keep_them(layout: str, tmp_path: Path, cli_runner: Any) -> None:
    """``--trust`` (torch reads and writes) and ``--max-shard-size`` (each shard a torch zip) alike."""
    src = _source(layout, tmp_path)
    want = torch.load(src, weights_only=True)["w"]
    res = cli_runner.invoke(cli, ["convert", str(src), str(tmp_path / "t.pth"), "-q", "--trust"])
    assert res.exit_code == 0, res.output
    assert _same(torch.load(tmp_path / "t.pth", weights_only=True)["w"], want)
    res = cli_runner.invoke(cli, ["convert", str(src), str(tmp_path / "shards"), "-q", "--format", "pth",
                                  "--max-shard-size", "64"])
    assert res.exit_code == 0, res.output
    assert _same(ckptfix.load(tmp_path / "shards")["w"], want)


@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free-first", "torch-path"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_safetensors_output_is_refused_in_one_line(layout: str, torch_free: str, tmp_path: Path, cli_runner: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    src, out = _source(layout, tmp_path), tmp_path / "out.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(src), str(out), "-q"])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert res.output == f"Error: 'w': a {layout} tensor can't be stored in safetensors; write .pth instead\n"
    with pytest.raises(ConversionError, match=f"'w': a {layout} tensor .*write .pth instead"):
        ckptfix.convert(src, out, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inspect_shows_the_layout(layout: str, tmp_path: Path, cli_runner: Any) -> None:
    src = _source(layout, tmp_path)
    res = cli_runner.invoke(cli, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "  w  [4x4]  float32 " + layout + "\n" in res.output and "  b  [3]  float32\n" in res.output
    res = cli_runner.invoke(cli, ["inspect", str(src), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["keys"]
    assert rows == [{"key": "w", "shape": [4, 4], "dtype": "float32", "layout": layout},
                    {"key": "b", "shape": [3], "dtype": "float32"}]
    want = torch.load(src, weights_only=True)["w"]
    stored = sum(p.numel() * p.element_size() for p in _parts(want)) + 12
    assert json.loads(res.output)["nbytes"] == stored  # the bytes the file holds: indices, values and b


def test_a_cast_keeps_sparse_tensors_as_saved(tmp_path: Path, cli_runner: Any) -> None:
    """``--dtype`` casts strided floating-point tensors; a sparse one is written as saved (and counted as kept)."""
    src, out = _source("sparse_csr", tmp_path), tmp_path / "out.pth"
    res = cli_runner.invoke(cli, ["convert", str(src), str(out), "--dtype", "fp16"])
    assert res.exit_code == 0, res.output
    assert "cast to float16: float32->float16 ×1; kept float32 ×1" in res.output
    got, want = torch.load(out, weights_only=True), torch.load(src, weights_only=True)
    assert _same(got["w"], want["w"]) and got["b"].dtype == torch.float16


class _Holder(torch.nn.Module):
    """A module whose ``w`` parameter the checkpoint's sparse ``w`` fills, beside a dense ``b`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4))
        self.register_buffer("b", torch.zeros(3))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_into_a_meta_built_model_assigns_them_as_torch_does(layout: str, tmp_path: Path) -> None:
    """Meta-built (or ``assign=True``): the parameter becomes the sparse tensor as stored, as torch's
    ``load_state_dict(assign=True)`` makes it — same layout, indices, values, Parameter and requires_grad; its values
    checked (a NaN among them named)."""
    path = _source(layout, tmp_path)
    plain = _Holder().to("meta")
    plain.load_state_dict(torch.load(path, weights_only=True), assign=True)
    for assign in (None, True):
        got = _Holder().to("meta") if assign is None else _Holder()
        report = ckptfix.load_into(got, path, assign=assign)
        assert report.nonfinite == []
        assert type(got.w) is type(plain.w) and got.w.requires_grad == plain.w.requires_grad
        assert _same(got.w.detach(), plain.w.detach()) and torch.equal(got.b, plain.b)
    sd = torch.load(path, weights_only=True)
    _parts(sd["w"])[-1][0] = float("nan")
    torch.save(sd, path)
    with pytest.warns(UserWarning, match="NaN/Inf"):
        assert ckptfix.load_into(_Holder().to("meta"), path).nonfinite == ["w"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_into_a_built_dense_tensor_is_refused_and_loads_nothing(layout: str, tmp_path: Path) -> None:
    """A built (dense) parameter can't take a sparse tensor — torch's load_state_dict raises too — so load_into refuses
    it in one LoadError naming the key and both layouts, before anything is loaded (``b`` stays as it was)."""
    path = _source(layout, tmp_path)
    with pytest.raises(RuntimeError):
        _Holder().load_state_dict(torch.load(path, weights_only=True))
    model = _Holder()
    with pytest.raises(LoadError, match=rf"w \(torch\.{layout} in the file, torch\.strided in the model\); nothing "
                                        "was loaded"):
        ckptfix.load_into(model, path)
    assert torch.equal(model.b, torch.zeros(3)) and torch.equal(model.w, torch.zeros(4, 4))


class _OutOfRange:
    """Saves as ``t``'s rebuild with its first index past the size (or its compressed indices not starting at 0)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce_ex__(self, protocol: int) -> tuple:
        parts = [p.clone() for p in _parts(self.t)]
        parts[0].view(-1)[0] = 99 if self.t.layout == torch.sparse_coo else 1
        return torch._utils._rebuild_sparse_tensor, (self.t.layout, (*parts, self.t.size()))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_indices_are_checked_by_every_verb_in_both_file_formats(layout: str, legacy: bool, tmp_path: Path) -> None:
    """torch.load(weights_only=True) checks a sparse tensor's indices after the load (a legacy file's storages are
    read after its pickle): ckptfix's reads, loads and structure reads (meta: the indices read from the file) load a
    good one bit for bit and refuse one whose indices don't fit its size, as torch does."""
    good, bad = tmp_path / "good.pth", tmp_path / "bad.pth"
    t = LAYOUTS[layout]()
    torch.save({"w": t}, good, _use_new_zipfile_serialization=not legacy)
    torch.save({"w": _OutOfRange(t)}, bad, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(RuntimeError):
        torch.load(bad, weights_only=True)
    want = torch.load(good, weights_only=True)["w"]
    for got in (ckptfix.read(good).state_dict["w"], ckptfix.load(good)["w"]):
        assert got.layout == want.layout and all(torch.equal(a, b) for a, b in zip(_parts(got), _parts(want)))
    assert ckptfix.inspect(good).state_dict["w"].layout == want.layout
    for verb in (ckptfix.read, ckptfix.load, ckptfix.describe, ckptfix.inspect):
        with pytest.raises(UnsafeCheckpointError, match="a sparse tensor's indices do not fit its size"):
            verb(bad)
