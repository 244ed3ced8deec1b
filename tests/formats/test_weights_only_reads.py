"""What ``torch.load(weights_only=True)`` and safetensors' ``load_file`` read, ckptfix reads too (issue 27, item 10).

Each file is made by real torch code (``torch.save`` of the real object; a hand-built pickle only for the old-style
tensor and the out-of-bounds rebuilds, written through ``torch.save`` with a ``reducer_override``), and every verb is
checked against torch's and safetensors' own reading of it: read, inspect (CLI text and --json), scan, convert to
.pth and .safetensors, load. The out-of-bounds rebuilds (GHSA-jg6j-8w4h-2pg2: a quantized rebuild whose strides reach
outside its storage) are refused in one line by every verb, whatever the installed torch checks.
"""

from __future__ import annotations

import json
import pickle
import struct
import types
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError, SelectError
from ckptfix.parse.unpickler import Refused

pytestmark = [pytest.mark.filterwarnings(r"ignore:torch\.quantize_per_tensor:UserWarning"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
              pytest.mark.filterwarnings(r"ignore:torch\.ao\.quantization:DeprecationWarning")]


def _save_with(obj: Any, path: Path, override: Callable[[Any], Any]) -> Path:
    """``torch.save(obj)`` with ``override`` as the pickler's ``reducer_override`` (torch's persistent ids kept)."""
    class Pickler(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            return override(o)

    torch.save(obj, path, pickle_module=types.SimpleNamespace(Pickler=Pickler, __name__="pickle"))
    return path


def _typed(t: torch.Tensor) -> Any:
    return torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)


def _x() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def _old_style(o: Any) -> Any:
    """``(torch.Tensor, (), state)``: a tensor class called empty, then BUILD's ``set_(storage, offset, size, stride)``."""
    if type(o) is not torch.Tensor:
        return NotImplemented
    cls = torch.Tensor if o.dtype == torch.float32 else getattr(torch, o.type().rsplit(".", 1)[1])
    return cls, (), (_typed(o), o.storage_offset(), tuple(o.size()), o.stride())


def _qrebuild(offset: int, size: tuple, stride: tuple, qparams: Callable[[Any], tuple] | None = None) -> Callable:
    """A quantized tensor rebuilt as ``_rebuild_qtensor(storage, offset, size, stride, qparams, …)``."""
    def override(o: Any) -> Any:
        if not (isinstance(o, torch.Tensor) and o.is_quantized):
            return NotImplemented
        params = qparams(o) if qparams else (torch.per_tensor_affine, o.q_scale(), o.q_zero_point())
        return torch._utils._rebuild_qtensor, (_typed(o), offset, size, stride, params, False, OrderedDict())
    return override


def _nested_offsets(o: Any) -> Any:
    if not (isinstance(o, torch.Tensor) and o.is_nested):
        return NotImplemented
    return torch._utils._rebuild_nested_tensor, (o.values(), o._nested_tensor_size(), o._nested_tensor_strides(),
                                                 torch.tensor([0, 100]))


def _whitespace_header(path: Path) -> Path:
    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 3, dtype=torch.int16)}, path)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = b" \n\t\r " + data[8:8 + n].rstrip()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
    return path


def _quantized_per_channel() -> torch.Tensor:
    return torch.quantize_per_channel(_x(), torch.rand(6) + 0.1, torch.randint(0, 5, (6,)), 1, torch.quint8)


def _dynamic_linear() -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8).state_dict()


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])


#: name → (maker(dir) → file, kind): ``sd`` a state dict torch-only formats keep (quantized, nested: .pth only),
#: ``plain`` a state dict any format keeps, ``none`` no state dict at all
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "quantized-per-tensor": (lambda d: _saved(d / "qpt.pth", {
        "w": torch.quantize_per_tensor(_x(), 0.1, 3, torch.quint8), "i8": torch.quantize_per_tensor(_x(), 0.05, -2, torch.qint8),
        "i32": torch.quantize_per_tensor(_x(), 0.01, 0, torch.qint32), "bias": torch.zeros(6)}), "sd"),
    "quantized-per-channel": (lambda d: _saved(d / "qpc.pth", {"w": _quantized_per_channel()}), "sd"),
    "quantized-quint4x2": (lambda d: _saved(d / "q4.pth", {"w": torch.quantize_per_tensor(_x(), 0.2, 2, torch.quint4x2)}), "sd"),
    "quantize-dynamic-linear": (lambda d: _saved(d / "dyn.pth", _dynamic_linear()), "sd"),
    "legacy-file-quantized": (lambda d: _saved(d / "legacy.pt", {"w": _quantized_per_channel(), "b": torch.ones(2)},
                                               zipped=False), "sd"),
    "nested": (lambda d: _saved(d / "nested.pth", {"nt": _nested(), "w": torch.randn(2)}), "sd"),
    "old-style-tensor": (lambda d: _save_with({"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(3)},
                                              d / "old.pth", _old_style), "plain"),
    "empty-dict": (lambda d: _saved(d / "empty.pth", OrderedDict()), "plain"),
    "safetensors-empty": (lambda d: _st_empty(d / "empty.safetensors"), "plain"),
    "safetensors-header-whitespace": (lambda d: _whitespace_header(d / "ws.safetensors"), "plain"),
    "bare-tensor": (lambda d: _saved(d / "bare.pth", torch.randn(3, 2)), "none"),
    "list-of-tensors": (lambda d: _saved(d / "list.pth", [torch.randn(2), torch.randn(3)]), "none"),
    "dict-without-tensors": (lambda d: _saved(d / "plain.pth", {"epoch": 3, "lr": 0.1, "name": "run"}), "none"),
}

#: out-of-bounds rebuilds: name → (maker, what the refusal says)
OUT_OF_BOUNDS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "quantized-strides-past-storage": (lambda d: _save_with(
        {"w": torch.quantize_per_tensor(_x(), 0.1, 3, torch.quint8)}, d / "ghsa.pth", _qrebuild(0, (4, 6), (1000, 1))),
        "out of bounds"),
    "quantized-offset-past-storage": (lambda d: _save_with(
        {"w": torch.quantize_per_tensor(_x(), 0.1, 3, torch.quint8)}, d / "off.pth", _qrebuild(20, (4, 6), (6, 1))),
        "out of bounds"),
    "quint4x2-one-element-past": (lambda d: _save_with(  # 25 values need 13 bytes of a 12-byte storage
        {"w": torch.quantize_per_tensor(_x(), 0.2, 2, torch.quint4x2)}, d / "q4.pth", _qrebuild(1, (4, 6), (6, 1))),
        "out of bounds"),
    "per-channel-scales-short": (lambda d: _save_with({"w": _quantized_per_channel()}, d / "pc.pth", _qrebuild(
        0, (4, 6), (6, 1), lambda o: (torch.per_channel_affine, torch.rand(2), torch.zeros(2, dtype=torch.long), 1)))
        , "scales"),
    "nested-offset-past-buffer": (lambda d: _save_with({"nt": _nested()}, d / "nested.pth", _nested_offsets),
                                  "out of bounds"),
}


def _saved(path: Path, obj: Any, zipped: bool = True) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=zipped)
    return path


def _st_empty(path: Path) -> Path:
    save_file({}, path)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, (make, _kind) in {**CASES, **OUT_OF_BOUNDS}.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = make(folder)
    return out


def _reference(path: Path) -> Any:
    """What torch (a torch file, weights_only) or safetensors (load_file) reads."""
    return load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def same(a: Any, b: Any) -> bool:
    """Bit for bit, quantizers and nested components included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.is_quantized != b.is_quantized or a.is_nested != b.is_nested or type(a) is not type(b):
            return False
        if a.is_nested:
            return len(a.unbind()) == len(b.unbind()) and all(map(same, a.unbind(), b.unbind()))
        if a.is_quantized:
            return a.shape == b.shape and _same_quantizer(a, b) and torch.equal(a.int_repr(), b.int_repr())
        bits = (a.view(torch.uint8), b.view(torch.uint8)) if a.dim() else (a, b)
        return a.shape == b.shape and a.stride() == b.stride() and torch.equal(*bits)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def _same_quantizer(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.qscheme() != b.qscheme():
        return False
    if a.qscheme() == torch.per_tensor_affine:
        return (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
    return a.q_per_channel_axis() == b.q_per_channel_axis() and torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales()) \
        and torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())


def _cli(*args: str) -> Any:
    from click.testing import CliRunner

    return CliRunner().invoke(cli, list(args))


def _one_error_line(res: Any, *words: str) -> None:
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "a bug in ckptfix" not in res.stderr and all(w in res.stderr for w in words), res.stderr


@pytest.mark.parametrize("name", list(CASES))
def test_read(name: str, made: dict[str, Path]) -> None:
    path, kind = made[name], CASES[name][1]
    ckpt = ckptfix.read(path)
    expected = _reference(path)
    if kind == "none":
        assert same(ckpt.raw, expected) and dict(ckpt.state_dict) == {} and ckpt.no_state_dict is not None
    else:
        assert same(dict(ckpt.state_dict), dict(expected)) and ckpt.no_state_dict is None


@pytest.mark.parametrize("name", list(CASES))
def test_load(name: str, made: dict[str, Path]) -> None:
    path, kind = made[name], CASES[name][1]
    if kind == "none":
        with pytest.raises(SelectError, match="not a state dict|no state dict found") as e:
            ckptfix.load(path)
        assert "\n" not in str(e.value)
    else:
        assert same(dict(ckptfix.load(path)), dict(_reference(path)))


@pytest.mark.parametrize("name", list(CASES))
def test_inspect_text_and_json(name: str, made: dict[str, Path]) -> None:
    path, kind = made[name], CASES[name][1]
    expected = _reference(path)
    text, js = _cli("inspect", str(path)), _cli("inspect", "--json", str(path))
    assert text.exit_code == 0 and js.exit_code == 0 and text.stderr == "" and js.stderr == "", text.output + js.output
    info = json.loads(js.stdout)
    if kind == "none":
        assert info["no_state_dict"] and info["num_keys"] == 0 and "state dict:     none" in text.stdout
        assert "note: no state dict:" in text.stdout
        return
    assert [row["key"] for row in info["keys"]] == list(expected)
    for row in info["keys"]:
        value = expected[row["key"]]
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).replace("torch.", "")
            shape = [2, None, 3] if value.is_nested else list(value.shape)  # (nested: (2, 3) and (4, 3))
            assert (row["dtype"], row["shape"]) == (dtype, shape), row
            assert f"[{'x'.join('*' if n is None else str(n) for n in shape)}]" in text.stdout
    if not expected:
        assert "(empty: no tensors)" in text.stdout


@pytest.mark.parametrize("name", list(CASES))
def test_scan_finds_nothing(name: str, made: dict[str, Path]) -> None:
    res = _cli("scan", "--json", str(made[name]))
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["findings"] == [] and report["unsafe_globals"] == []


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
@pytest.mark.parametrize("name", list(CASES))
def test_convert(name: str, suffix: str, made: dict[str, Path], tmp_path: Path) -> None:
    path, kind = made[name], CASES[name][1]
    out = tmp_path / f"out{suffix}"
    res = _cli("convert", str(path), str(out))
    if kind == "none":
        _one_error_line(res, str(path), "state dict")
    elif kind == "sd" and suffix == ".safetensors":
        _one_error_line(res, "safetensors", "write .pth instead")  # naming the key, and what it is
        assert any(f"'{k}': a {kind} tensor" in res.stderr for k in _reference(path) for kind in ("quantized", "nested")) \
            or "is a dtype, not a tensor" in res.stderr  # (quantize_dynamic's packed params hold a dtype first)
    else:
        assert res.exit_code == 0, res.output
        if suffix == ".safetensors":  # (safetensors keeps its own key order)
            assert same(dict(sorted(load_file(out).items())), dict(sorted(_reference(path).items())))
        else:
            assert same(dict(torch.load(out, weights_only=True)), dict(_reference(path)))
    if res.exit_code:
        assert not out.exists()


@pytest.mark.parametrize("name", list(OUT_OF_BOUNDS))
def test_out_of_bounds_rebuilds_refused_by_every_verb(name: str, made: dict[str, Path], tmp_path: Path) -> None:
    path, words = made[name], OUT_OF_BOUNDS[name][1]
    with pytest.raises(Exception, match=r"out of bounds|setStorage|must equal|scales"):  # torch refuses too (2.14)
        torch.load(path, weights_only=True)
    for verb in (ckptfix.read, ckptfix.load, ckptfix.inspect):
        with pytest.raises(CkptfixError, match=words) as e:
            verb(path)
        assert "\n" not in str(e.value)
    for args in (["inspect", str(path)], ["convert", str(path), str(tmp_path / "o.pth")],
                 ["convert", str(path), str(tmp_path / "o.safetensors")]):
        _one_error_line(_cli(*args), words)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["quantized-strides-past-storage", "quantized-offset-past-storage",
                                  "quint4x2-one-element-past"])
def test_scan_finds_out_of_bounds_rebuild(name: str, made: dict[str, Path]) -> None:
    res = _cli("scan", "--json", str(made[name]))
    assert res.exit_code == 3 and any("out of bounds" in f["message"] for f in json.loads(res.stdout)["findings"])


@pytest.mark.parametrize("name", ["bare-tensor", "list-of-tensors", "dict-without-tensors"])
def test_diff_refuses_a_file_without_state_dict(name: str, made: dict[str, Path]) -> None:
    path = str(made[name])
    _one_error_line(_cli("diff", path, path), path, "state dict")


def test_legacy_nested_tensor_refused(tmp_path: Path) -> None:
    """A legacy (non-zip) file reads its storages after unpickling: a nested tensor would be built from sizes not
    yet read (torch.load fails on it, or worse); scan finds it, every verb refuses it in one line."""
    path = _saved(tmp_path / "nested.pt", {"nt": _nested()}, zipped=False)
    res = _cli("scan", "--json", str(path))
    assert res.exit_code == 3 and any("nested tensor in a legacy" in f["message"] for f in json.loads(res.stdout)["findings"])
    for args in (["inspect", str(path)], ["convert", str(path), str(tmp_path / "o.pth")]):
        _one_error_line(_cli(*args), "nested tensor in a legacy")
    with pytest.raises(CkptfixError, match="nested tensor in a legacy"):
        ckptfix.load(path)


class _Loader:
    """What a guard reads of the unpickler: where it is, and the allocations it charges."""

    where = "f.pth: data.pkl"

    def charge(self, amount: int, what: str) -> None:
        assert amount >= 0


def test_quantized_guard_refuses_before_torch_sees_it() -> None:
    """Whatever the installed torch checks (GHSA-jg6j-8w4h-2pg2: a torch that reads past the storage), the
    guard refuses the rebuild before calling torch's function."""
    from ckptfix.safety import tensor_guards  # (here: a module of this change, so the other tests run without it)

    q = torch.quantize_per_tensor(_x(), 0.1, 3, torch.quint8)
    called = []
    guard = tensor_guards.GUARDS["qtensor"]
    args = (_typed(q), 0, (4, 6), (1000, 1), (torch.per_tensor_affine, 0.1, 3), False, OrderedDict())
    with pytest.raises(Refused, match="out of bounds"):
        guard(_Loader(), lambda *a: called.append(a), args, {})
    assert called == []
    good = (_typed(q), 0, (4, 6), (6, 1), *args[4:])
    guard(_Loader(), lambda *a: called.append(a), good, {})
    assert len(called) == 1
