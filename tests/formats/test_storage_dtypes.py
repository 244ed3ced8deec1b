"""One storage referenced under several dtypes (issue 27, item 8): an untyped storage (a bare ``UntypedStorage``
in the state dict, or a ``_rebuild_tensor_v3`` tensor's id) then a float view of it. ``torch.load`` hands every
reference to a record the typed storage of its first and ``_rebuild_tensor_v2`` takes that dtype, while v3
keeps its own: a writer that turns a v3 float tensor into v2 over a FloatStorage changes what the others load
as (or makes a byte view 4× too long: "Trying to resize storage that is not resizable"). Every conversion must
write a ``.pth`` that ``torch.load(weights_only=True)`` loads as it loads the source.

The files are ``torch.save`` outputs whose pickler writes the float views as ``_rebuild_tensor_v3`` over the
untyped storage (``reducer_override``): every other byte is torch's own.
"""

from __future__ import annotations

import pickle
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH

pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")


class _V3:
    """A tensor written as ``_rebuild_tensor_v3(untyped storage, offset, (n,), (1,), …, dtype)``."""

    def __init__(self, storage: Any, dtype: torch.dtype, n: int, offset: int = 0):
        self.storage, self.dtype, self.n, self.offset = storage, dtype, n, offset


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]  # the Python pickler: reducer_override
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _V3:
            return (torch._utils._rebuild_tensor_v3,
                    (obj.storage, obj.offset, (obj.n,), (1,), False, OrderedDict(), obj.dtype))
        return NotImplemented


_PICKLE_MODULE = types.ModuleType("v3_pickle")
_PICKLE_MODULE.Pickler = _Pickler  # type: ignore[attr-defined]
_PICKLE_MODULE.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]


def _bytes24() -> torch.UntypedStorage:
    return torch.arange(24, dtype=torch.uint8).untyped_storage()


def _bytes_view(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(s, 0, (24,), (1,))


VARIANTS = {  # each over one 24-byte storage
    "storage-then-float": lambda s: {"s": s, "t": _V3(s, torch.float32, 6), "w": torch.ones(2)},
    "float-then-storage": lambda s: {"t": _V3(s, torch.float32, 6), "s": s},
    "storage-then-float-view": lambda s: {"s": s, "t": _V3(s, torch.float32, 4, 2)},
    "float-then-bytes": lambda s: {"t": _V3(s, torch.float32, 6), "b": _bytes_view(s)},
    "bytes-then-float": lambda s: {"b": _bytes_view(s), "t": _V3(s, torch.float32, 6)},
    "float-then-half": lambda s: {"t": _V3(s, torch.float32, 6), "h": _V3(s, torch.float16, 12)},
}


def _loaded(obj: Any) -> Any:
    """What a loaded value is: a storage's dtype and bytes, a tensor's dtype, shape and bytes."""
    if isinstance(obj, torch.storage.TypedStorage):
        return "storage", obj.dtype, bytes(obj._untyped_storage)
    return "tensor", obj.dtype, tuple(obj.shape), bytes(obj.contiguous().reshape(-1).view(torch.uint8).numpy())


@pytest.fixture(params=sorted(VARIANTS))
def source(request: Any, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "src.pth"
    torch.save(VARIANTS[request.param](_bytes24()), path, pickle_module=_PICKLE_MODULE)
    return path, {k: _loaded(v) for k, v in torch.load(path, weights_only=True).items()}


@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free-first", "torch-path"])
@pytest.mark.parametrize("keep_extra", [False, True], ids=["", "keep-extra"])
@pytest.mark.parametrize("via", ["cli", "library"])
def test_convert_writes_what_torch_loads(source: tuple[Path, dict[str, Any]], via: str, keep_extra: bool,
                                         torch_free: str, cli_runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, want = source
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    out = path.with_name("out.pth")
    if via == "cli":
        res = cli_runner.invoke(cli, ["convert", str(path), str(out), "-q", *(["--keep-extra"] if keep_extra else [])])
        assert res.exit_code == 0, res.output
    else:
        ckptfix.convert(path, out, keep_extra=keep_extra, progress=False)
    assert {k: _loaded(v) for k, v in torch.load(out, weights_only=True).items()} == want


def test_torch_saves_refusal_is_one_line(tmp_path: Path, cli_runner: Any) -> None:
    """Loaded by torch (``--trust``), such a state dict is what ``torch.save`` refuses to write: one Error line."""
    path, out = tmp_path / "src.pth", tmp_path / "out.pth"
    torch.save(VARIANTS["float-then-bytes"](_bytes24()), path, pickle_module=_PICKLE_MODULE)
    res = cli_runner.invoke(cli, ["convert", str(path), str(out), "-q", "--trust"])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert res.output.startswith("Error: two tensors or storages view the same bytes as different dtypes")
    assert not out.exists()
