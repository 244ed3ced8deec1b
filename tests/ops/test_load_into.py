"""load_into: every fixture mode into plain, DataParallel and compiled models, bit-exact (the manifest's
output, recorded on another machine, within the recorded-value tolerance); short errors."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.errors import LoadError, SelectError
from ckptfix.statedict.wrappers import strip_wrappers
from tests.compare import assert_close_to_recorded

MODES = ["single", "dp", "ddp", "compile", "compile_ddp", "ddp_compile", "amp",
         "cuda0", "cuda1", "model_parallel", "legacy", "train_ckpt", "safetensors"]
TARGETS = {
    "plain": lambda m: m,
    "dp": nn.DataParallel,
    "compiled": lambda m: torch.compile(m, backend="eager"),
}


def _fixture_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The fixture's tensors by single-form key, read with ckptfix's own reader on CPU."""
    return {strip_wrappers(k): v for k, v in ckptfix.read(path).state_dict.items()}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_into_every_wrapping(fixtures_dir: Path, manifest: dict, train: Any, mode: str, target: str) -> None:
    entry = manifest[train.fixture_name("mlp", mode)]
    model = TARGETS[target](train.mlp())
    report = ckptfix.load_into(model, fixtures_dir / entry["file"])
    want_wrappers = {"plain": [], "dp": ["module"], "compiled": ["_orig_mod"]}[target]
    assert report.model_wrappers == want_wrappers and report.checkpoint_wrappers == entry["wrappers"]
    assert report.fix is None if entry["wrappers"] == want_wrappers else report.fix is not None
    assert report.matched == 6 and report.missing == [] and report.unexpected == []
    saved = _fixture_tensors(fixtures_dir / entry["file"])
    loaded = {strip_wrappers(k): v for k, v in model.state_dict().items()}
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():  # (.cpu(): DataParallel moves its module to the GPU when there is one)
        assert torch.equal(loaded[key].cpu(), value.to(loaded[key].dtype)), key
    inner = model.module if target == "dp" else model
    inner.eval()
    device = next(inner.parameters()).device
    with torch.no_grad():
        out = inner(train.fixed_input("mlp").to(device)).cpu()
    assert_close_to_recorded(out, entry["output"])


def test_wrapping_error_names_the_report_not_torchs_wall(fixtures_dir: Path) -> None:
    wider = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    with pytest.raises(LoadError) as info:
        ckptfix.load_into(nn.DataParallel(wider), fixtures_dir / "mlp_compile.pth")
    message = str(info.value)
    assert message.startswith(f"{fixtures_dir / 'mlp_compile.pth'}: does not load into the model; "
                              "after the repair (replace _orig_mod. with module.: 6/6 keys match); "
                              "2 shape mismatch: module.4.weight [1, 32] vs model [2, 32], module.4.bias [1] vs model [2]")
    assert "Error(s) in loading state_dict" not in message
    before = wider.state_dict()["4.weight"].clone()
    assert torch.equal(wider.state_dict()["4.weight"], before)  # nothing was loaded


def test_renamed_keys_report_missing_and_unexpected(fixtures_dir: Path, tmp_path: Path) -> None:
    sd = torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)
    renamed = OrderedDict((k.replace("4.", "head.") if k.startswith("4.") else k, v) for k, v in sd.items())
    torch.save(renamed, tmp_path / "renamed.pth")
    with pytest.raises(LoadError, match=r"2 missing: 4\.weight, 4\.bias; 2 unexpected: head\.weight, head\.bias; "
                                        "the names differ: a renamed layer"):
        ckptfix.load_into(nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
                          tmp_path / "renamed.pth")


def test_not_strict_loads_what_matches(fixtures_dir: Path, tmp_path: Path, train: Any) -> None:
    sd = torch.load(fixtures_dir / "mlp_ddp.pth", weights_only=True)
    sd["module.extra.weight"] = torch.ones(2)
    del sd["module.4.bias"]
    torch.save(sd, tmp_path / "partial.pth")
    model = train.mlp()
    bias_before = model[4].bias.detach().clone()
    with pytest.raises(LoadError, match="1 missing: 4.bias; 1 unexpected: extra.weight"):
        ckptfix.load_into(model, tmp_path / "partial.pth")
    report = ckptfix.load_into(model, tmp_path / "partial.pth", strict=False)
    assert report.missing == ["4.bias"] and report.unexpected == ["extra.weight"] and report.fix == "strip module."
    assert torch.equal(model[0].weight, sd["module.0.weight"]) and torch.equal(model[4].bias, bias_before)


class Lit(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.model = net


def test_lightning_checkpoint_into_a_compiled_model(fixtures_dir: Path, tmp_path: Path, train: Any) -> None:
    lit = Lit(train.mlp())
    ckptfix.load_into(lit.model, fixtures_dir / "mlp_single.pth")
    torch.save({"state_dict": lit.state_dict(), "epoch": 1}, tmp_path / "lit.ckpt")
    model = torch.compile(train.mlp(), backend="eager")
    report = ckptfix.load_into(model, tmp_path / "lit.ckpt")
    assert report.fix == "add _orig_mod., strip prefix model." and report.state_dict_key == "state_dict"
    for key, value in lit.model.state_dict().items():
        assert torch.equal(model.state_dict()[f"_orig_mod.{key}"], value)


def test_old_batchnorm_checkpoint_fills_num_batches_tracked(tmp_path: Path) -> None:
    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))

    src = net()
    src[1].running_mean.fill_(0.25)
    sd = src.state_dict()
    old = OrderedDict((k, v) for k, v in sd.items() if not k.endswith("num_batches_tracked"))
    old._metadata = sd._metadata  # version 2 metadata: torch itself would refuse the missing key
    torch.save(old, tmp_path / "old.pth")
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        net().load_state_dict(torch.load(tmp_path / "old.pth", weights_only=True))
    model = nn.DataParallel(net())
    report = ckptfix.load_into(model, tmp_path / "old.pth")
    assert report.tolerated == ["module.1.num_batches_tracked"] and report.fix == "add module."
    assert torch.equal(model.module[1].running_mean.cpu(), torch.full((4,), 0.25))
    assert int(model.module[1].num_batches_tracked) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cuda0", "model_parallel", "ddp_compile"])
def test_into_a_cuda_model(fixtures_dir: Path, manifest: dict, train: Any, mode: str) -> None:
    entry = manifest[train.fixture_name("mlp", mode)]
    model = train.mlp().cuda()
    ckptfix.load_into(model, fixtures_dir / entry["file"])  # map_location="auto": saved device if present
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    loaded = model.state_dict()
    for key, value in _fixture_tensors(fixtures_dir / entry["file"]).items():
        assert torch.equal(loaded[key].cpu(), value), key


@pytest.mark.parametrize("target", ["plain", "dp"])
def test_nonfinite_values_warn_or_are_refused(fixtures_dir: Path, tmp_path: Path, train: Any, target: str) -> None:
    sd = torch.load(fixtures_dir / "mlp_ddp.pth", weights_only=True)
    sd["module.2.bias"][3] = float("nan")
    sd["module.4.weight"][0, 1] = float("-inf")
    torch.save(sd, tmp_path / "nan.pth")
    model = TARGETS[target](train.mlp())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoadError, match=r"nan\.pth: 2 tensor\(s\) hold NaN/Inf values: .*2\.bias, .*4\.weight; "
                                        "nothing was loaded"):
        ckptfix.load_into(model, tmp_path / "nan.pth", strict_values=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # untouched
    prefix = "module." if target == "dp" else ""
    with pytest.warns(UserWarning, match=rf"2 tensor\(s\) hold NaN/Inf values: {prefix}2\.bias, {prefix}4\.weight") as seen:
        report = ckptfix.load_into(model, tmp_path / "nan.pth")
    assert seen[0].filename == __file__  # points at the caller's line
    assert report.nonfinite == [f"{prefix}2.bias", f"{prefix}4.weight"]
    assert any("hold NaN/Inf values" in n for n in report.notes)
    assert torch.isnan(model.state_dict()[f"{prefix}2.bias"][3])


def test_finite_values_load_without_a_warning(fixtures_dir: Path, train: Any, recwarn: pytest.WarningsRecorder) -> None:
    report = ckptfix.load_into(train.mlp(), fixtures_dir / "mlp_single.pth", strict_values=True)
    assert report.nonfinite == [] and not [w for w in recwarn if "NaN" in str(w.message)]


def test_the_signature_is_declared_once(tmp_path: Path) -> None:
    """``ckptfix.load_into``'s options are LoadOptions' fields (names, defaults, order), passed by position or keyword."""
    import inspect
    from dataclasses import fields

    from ckptfix.ops.load_into.loading import LoadOptions

    params = list(inspect.signature(ckptfix.load_into).parameters.values())
    assert [p.name for p in params] == ["model", "path"] + [f.name for f in fields(LoadOptions)]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    assert [p.default for p in params[2:]] == [f.default for f in fields(LoadOptions)]
    torch.save({"weight": torch.ones(2, 2)}, tmp_path / "m.pth")  # no bias: a strict load refuses it
    by_position = ckptfix.load_into(nn.Linear(2, 2), tmp_path / "m.pth", "cpu", False)
    by_keyword = ckptfix.load_into(nn.Linear(2, 2), tmp_path / "m.pth", map_location="cpu", strict=False)
    assert by_position.missing == by_keyword.missing == ["bias"]
    with pytest.raises(TypeError, match="no_such_option"):
        ckptfix.load_into(nn.Linear(2, 2), tmp_path / "m.pth", no_such_option=True)


def _quantized(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    if kind == "per_channel":
        return torch.quantize_per_channel(x, torch.rand(4, generator=g) / 10 + 0.01, torch.arange(4) - 2, 0,
                                          torch.qint8)
    return torch.quantize_per_tensor(x, 0.05 + seed / 100, seed, torch.quint8 if kind == "quint8" else torch.qint8)


class _QNet(nn.Module):
    """A legacy quantized buffer (torch.ao's qint8/quint8 tensors) beside a Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.register_buffer("q", _quantized(kind, 1))
        self.lin = nn.Linear(6, 3)


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch deprecates its legacy quantized tensors; TypedStorage)
@pytest.mark.parametrize("kind", ["qint8", "quint8", "per_channel"])
@pytest.mark.parametrize("assign", [None, True])
def test_a_quantized_buffer_takes_the_files_scale_and_zero_point_as_torch_does(kind: str, assign: bool | None,
                                                                               tmp_path: Path) -> None:
    """A quantized tensor's values are its integers and its quantizer: copied in place (a built model) or assigned,
    the model holds the file's scale(s) and zero point(s), as torch's load_state_dict gives them — a copy of the
    integers alone (into a detached alias, whose quantizer is its own) kept the model's old scale."""
    sd = {"q": _quantized(kind, 7), "lin.weight": torch.randn(3, 6), "lin.bias": torch.randn(3)}
    path = tmp_path / "q.pth"
    torch.save(sd, path)
    want = _QNet(kind)
    want.load_state_dict(torch.load(path, weights_only=True), assign=bool(assign))
    got = _QNet(kind)
    ckptfix.load_into(got, path, assign=assign)
    a, b = got.q, want.q
    assert a.qscheme() == b.qscheme() and a.dtype == b.dtype and torch.equal(a.int_repr(), b.int_repr())
    if a.qscheme() == torch.per_tensor_affine:
        assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point()) == (sd["q"].q_scale(), 7)
    else:
        assert torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales())
        assert torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())
    assert torch.equal(a.dequantize(), sd["q"].dequantize()) and torch.equal(got.lin.weight, sd["lin.weight"])


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.zeros(3, 70, dtype=torch.complex64))
        self.register_buffer("n", torch.zeros(3, 70, dtype=torch.complex64))
        self.register_buffer("r", torch.zeros(3, 70))


@pytest.mark.parametrize("model", ["built", "assign", "meta"])
def test_conjugate_and_negative_views_load_as_torch_rebuilds_them(model: str, tmp_path: Path) -> None:
    """torch.save keeps a conjugate (``x.conj()``) or negative (``_neg_view``) view as its stored values plus the bit,
    and torch.load rebuilds the view: the model gets the values torch's load_state_dict gives (copied resolved, or
    assigned with the bit kept) — not the stored bytes read as they lie (which were the unconjugated values)."""
    x = torch.randn(3, 70, dtype=torch.complex64)
    sd = {"c": x.conj(), "n": torch._neg_view(x), "r": torch._neg_view(torch.randn(3, 70))}
    assert sd["c"].is_conj() and sd["n"].is_neg() and sd["r"].is_neg()
    path = tmp_path / "views.pth"
    torch.save(sd, path)
    want = _Complex()
    want.load_state_dict(torch.load(path, weights_only=True), assign=model != "built")
    got = _Complex().to("meta") if model == "meta" else _Complex()
    report = ckptfix.load_into(got, path, assign=True if model == "assign" else None)
    for k in sd:
        a, b = getattr(got, k), getattr(want, k)
        assert torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()), k
        assert torch.equal(a.resolve_conj().resolve_neg(), sd[k].resolve_conj().resolve_neg()), k
        assert (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg()), k
    assert report.nonfinite == []
    converted = tmp_path / "converted.pth"  # ckptfix's output records each tensor's digest: checked on its stored bytes
    ckptfix.convert(path, converted)
    again = _Complex().to("meta") if model == "meta" else _Complex()
    ckptfix.load_into(again, converted, assign=True if model == "assign" else None, check_digests=True)
    assert all(torch.equal(getattr(again, k).resolve_conj().resolve_neg(), sd[k].resolve_conj().resolve_neg())
               for k in sd)
    x[1, 5] = complex(float("nan"), 0)
    torch.save({"c": x.conj(), "n": torch._neg_view(x), "r": sd["r"]}, path)
    with pytest.warns(UserWarning, match="NaN/Inf"):
        report = ckptfix.load_into(_Complex().to("meta") if model == "meta" else _Complex(), path,
                                   assign=True if model == "assign" else None)
    assert sorted(report.nonfinite) == ["c", "n"]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_model_with_a_nested_tensor_is_refused_in_one_line(tmp_path: Path) -> None:
    """A nested tensor has no one shape: torch's load_state_dict fails on it with an internal error; load_into
    refuses it before anything is loaded, naming the key and how to set it."""

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("nt", torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)]))
            self.w = nn.Parameter(torch.zeros(3))

    path = tmp_path / "nt.pth"
    torch.save({"nt": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)]), "w": torch.ones(3)}, path)
    with pytest.raises(RuntimeError):
        Nested().load_state_dict(torch.load(path, weights_only=True))
    model = Nested()
    with pytest.raises(LoadError, match=r"^nt: the model's tensor is a nested tensor.*nothing was loaded.*"
                                        r"model\.nt = ckptfix\.load\(PATH\)\['nt'\]"):
        ckptfix.load_into(model, path)
    assert not model.w.any()
    assert [t.shape for t in ckptfix.load(path)["nt"].unbind()] == [(2, 3), (4, 3)]


#: what the file holds beside the model's state dict → the key load_into takes (None: it asks, naming which fit)
SEVERAL = {"model-and-head": ({"model": "fits", "head": "other", "step": 3}, "model"),
           "ema-beside": ({"model": "fits", "model_ema": "fits", "opt": "other"}, "model"),
           "two-that-fit": ({"model": "fits", "copy": "fits"}, None),
           "none-fit": ({"a": "other", "b": "other"}, None)}


@pytest.mark.parametrize("name", list(SEVERAL))
def test_several_state_dicts_the_one_that_fits_the_model_is_loaded(name: str, tmp_path: Path) -> None:
    """A file of several state dicts (select="auto"): load_into takes the one whose keys fit the model, saying so in
    its notes; where none or several fit, the SelectError says which did. Nothing is loaded then."""
    layout, want = SEVERAL[name]
    src = nn.Linear(3, 2)
    entries = {"fits": src.state_dict(), "other": nn.Linear(5, 1).state_dict()}
    torch.save({k: entries.get(v, v) if isinstance(v, str) else v for k, v in layout.items()}, tmp_path / "several.pth")
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if want is not None:
        report = ckptfix.load_into(model, tmp_path / "several.pth")
        assert report.state_dict_key == want and any(f"loaded {want!r}, the one whose keys fit the model" in n
                                                     for n in report.notes), report.notes
        assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items())
        return
    with pytest.raises(SelectError, match="holds several state dicts") as info:
        ckptfix.load_into(model, tmp_path / "several.pth")
    assert ("the model's keys fit 'model' and 'copy'" if name == "two-that-fit" else "fit none of them") in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
