"""Every committed fixture mode × --to target × output format: bit-exact tensors, consistent
_metadata, strict load into the matching (wrapped) model, and the trained model's output (the
manifest's, recorded on another machine: within the recorded-value tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ckptfix
from ckptfix.statedict.wrappers import strip_wrappers
from tests.compare import assert_close_to_recorded

MLP_FIXTURES = [
    "mlp_single.pth", "mlp_dp.pth", "mlp_ddp.pth", "mlp_compile.pth", "mlp_compile_ddp.pth",
    "mlp_ddp_compile.pth", "mlp_amp.pth", "mlp_cuda0.pth", "mlp_cuda1.pth", "mlp_model_parallel.pth",
    "mlp_legacy.pth", "mlp_train_ckpt.pth", "mlp_safetensors.safetensors",
]
TARGETS = ["single", "ddp", "compile", "keep"]
FORMATS = ["pth", "safetensors"]


def wrap_model(model: nn.Module, to: str) -> nn.Module:
    """The real wrapper a user's inference code would put around the model for ``to``."""
    if to == "ddp":
        return nn.DataParallel(model)
    if to == "compile":
        return torch.compile(model, backend="eager")
    return model


def original_tensors(path: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The fixture's tensors read by plain torch/safetensors (not ckptfix), keyed by single form."""
    if path.suffix == ".safetensors":
        sd = load_file(path)
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        sd = obj[entry["state_dict_key"]] if entry["state_dict_key"] else obj
    return {strip_wrappers(k): v for k, v in sd.items()}


def read_output(path: Path, fmt: str) -> Any:
    if fmt == "safetensors":
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, key
    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a,
                       b.view(torch.uint8) if b.dtype == torch.bool else b), key


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("name", MLP_FIXTURES)
def test_convert_matrix(name: str, to: str, fmt: str, tmp_path: Path, fixtures_dir: Path,
                        manifest: dict, train: Any) -> None:
    entry = manifest[name]
    src = fixtures_dir / name
    dst = tmp_path / f"out.{fmt}"
    before = src.read_bytes()
    report = ckptfix.convert(src, dst, to=to)
    assert src.read_bytes() == before
    assert report.wrappers_before == entry["wrappers"]
    assert report.state_dict_key == entry["state_dict_key"]

    out = read_output(dst, fmt)  # plain torch.load(weights_only=True) / safetensors
    orig = original_tensors(src, entry)
    expected_stack = entry["wrappers"] if to == "keep" else {"single": [], "ddp": ["module"], "compile": ["_orig_mod"]}[to]
    assert report.wrappers_after == expected_stack
    assert len(out) == len(orig)
    for key, t in out.items():
        assert key.split(".")[: len(expected_stack)] == expected_stack
        assert_bit_equal(t, orig[strip_wrappers(key)], key)

    # ckptfix's own loader restores _metadata (pth natively, safetensors from its metadata entry)
    loaded = ckptfix.load(dst, to="keep")
    target_model = wrap_model(train.mlp(), to)
    if to != "keep":
        if fmt == "pth" or entry["format"] != "safetensors":
            meta = getattr(loaded, "_metadata", None)
            if entry["format"] != "safetensors":
                assert meta == target_model.state_dict()._metadata
        target_model.load_state_dict(loaded, strict=True)

    plain = train.mlp()
    plain.load_state_dict(ckptfix.load(dst), strict=True)
    plain.eval()
    with torch.no_grad():
        got = plain(train.fixed_input("mlp"))
    assert_close_to_recorded(got, entry["output"])


def test_keep_extra_keeps_training_state(tmp_path: Path, fixtures_dir: Path) -> None:
    src = fixtures_dir / "mlp_train_ckpt.pth"
    dst = tmp_path / "resume.pth"
    report = ckptfix.convert(src, dst, to="ddp", keep_extra=True)
    orig = torch.load(src, weights_only=True)
    out = torch.load(dst, weights_only=True)
    assert list(out) == list(orig) and report.kept_extra == ["optimizer_state_dict", "epoch", "loss"]
    assert out["epoch"] == orig["epoch"] and out["loss"] == orig["loss"]
    assert list(out["model_state_dict"]) == [f"module.{k}" for k in orig["model_state_dict"]]
    state, want = out["optimizer_state_dict"]["state"], orig["optimizer_state_dict"]["state"]
    assert list(state) == list(want)
    for p, s in want.items():
        assert list(state[p]) == list(s) and all(torch.equal(state[p][k], v) for k, v in s.items()), p
    assert out["optimizer_state_dict"]["param_groups"] == orig["optimizer_state_dict"]["param_groups"]


def test_keep_extra_refused_for_safetensors(tmp_path: Path, fixtures_dir: Path) -> None:
    with pytest.raises(ckptfix.errors.ConversionError, match="only a single .pth"):
        ckptfix.convert(fixtures_dir / "mlp_train_ckpt.pth", tmp_path / "x.safetensors", keep_extra=True)
    assert not list(tmp_path.iterdir())


def test_default_drops_extra_and_says_so(tmp_path: Path, fixtures_dir: Path) -> None:
    report = ckptfix.convert(fixtures_dir / "mlp_train_ckpt.pth", tmp_path / "w.pth")
    assert any("optimizer_state_dict" in n and "--keep-extra" in n for n in report.notes)
    assert isinstance(torch.load(tmp_path / "w.pth", weights_only=True), dict)


def test_strip_and_add_prefix(tmp_path: Path) -> None:
    sd = {"model.backbone.conv.weight": torch.randn(2, 2), "model.head.weight": torch.randn(1, 2)}
    src = tmp_path / "lightning_like.ckpt"
    torch.save({"state_dict": sd, "epoch": 1}, src)
    ckptfix.convert(src, tmp_path / "a.pth", strip_prefix="model.", add_prefix="net")
    out = torch.load(tmp_path / "a.pth", weights_only=True)
    assert list(out) == ["net.backbone.conv.weight", "net.head.weight"]
    with pytest.raises(ckptfix.errors.WrapperError, match="no key starts with 'encoder.'"):
        ckptfix.convert(src, tmp_path / "b.pth", strip_prefix="encoder")
    assert not (tmp_path / "b.pth").exists()


def test_collision_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "clash.pth"
    torch.save({"module.fc.weight": torch.ones(1), "fc.weight": torch.zeros(1)}, src)
    with pytest.raises(ckptfix.errors.KeyCollisionError, match="module.fc.weight"):
        ckptfix.convert(src, tmp_path / "out.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash.pth"]


def test_tied_weights_round_trip_through_safetensors(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

    src = tmp_path / "tied.pth"
    torch.save(Tied().state_dict(), src)
    report = ckptfix.convert(src, tmp_path / "tied.safetensors", compact_ties=True)
    assert any("out.weight -> emb.weight" in n for n in report.notes)
    raw = load_file(tmp_path / "tied.safetensors")
    assert list(raw) == ["emb.weight"]  # written once: plain safetensors refuses shared tensors
    sd = ckptfix.load(tmp_path / "tied.safetensors")
    assert list(sd) == ["emb.weight", "out.weight"]
    assert sd["emb.weight"].data_ptr() == sd["out.weight"].data_ptr()
    m = Tied()
    m.load_state_dict(sd, strict=True)


def test_non_contiguous_and_partial_views(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"t": base.t(), "half_a": base[:2], "half_b": base[2:], "scalar": torch.tensor(3, dtype=torch.int64)}
    src = tmp_path / "views.pth"
    torch.save(sd, src)
    ckptfix.convert(src, tmp_path / "views.safetensors")
    back = ckptfix.load(tmp_path / "views.safetensors")
    for k, v in sd.items():
        assert torch.equal(back[k], v) and back[k].dtype == v.dtype
    assert list(back) == list(sd)


def test_safetensors_output_header_has_format_pt(tmp_path: Path, fixtures_dir: Path) -> None:
    from safetensors import safe_open

    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"


def test_format_by_content_not_extension(tmp_path: Path, fixtures_dir: Path) -> None:
    # a torch zip named .safetensors and a safetensors file named .pt both read correctly
    zip_named_st = tmp_path / "actually_zip.safetensors"
    zip_named_st.write_bytes((fixtures_dir / "mlp_ddp.pth").read_bytes())
    st_named_pt = tmp_path / "actually_st.pt"
    st_named_pt.write_bytes((fixtures_dir / "mlp_safetensors.safetensors").read_bytes())
    assert ckptfix.read(zip_named_st).format == "torch-zip"
    assert ckptfix.read(st_named_pt).format == "safetensors"
    a, b = ckptfix.load(zip_named_st), ckptfix.load(st_named_pt)
    assert set(a) == set(b)


def test_explicit_format_overrides_extension(tmp_path: Path, fixtures_dir: Path) -> None:
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "weights.bin", format="safetensors")
    assert ckptfix.read(tmp_path / "weights.bin").format == "safetensors"
    with pytest.raises(ckptfix.errors.FormatError, match="extension"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "weights.xyz")
