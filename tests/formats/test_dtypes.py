"""Every dtype safetensors and torch both have round-trips bit for bit, safetensors ↔ .pth, through the CLI,
on the torch-free path and on the torch path; a dtype only one side has is refused with an error naming it.

The dtypes are the installed safetensors' own list of the torch dtypes it stores (``safetensors.torch._SIZE``):
a safetensors or torch upgrade that adds one fails ``test_ckptfix_knows_every_dtype_safetensors_stores``.
The files are made by ``safetensors.torch.save_file`` and ``torch.save``; F4 (torch's float4_e2m1fn_x2,
two values per element) is written by safetensors with the last dimension counting values.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import _SIZE, save_file

from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.ops.convert import steps as conversion
from ckptfix.parse.safetensors_header import DTYPES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the torch dtypes safetensors stores (safetensors' list ∩ torch's), by torch's name
BOTH = sorted(str(d).removeprefix("torch.") for d in _SIZE)
#: torch's bit-container dtypes: no finfo/iinfo (torch._utils._element_size fails), only ``dtype.itemsize``
BITS = ["bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"]
#: torch dtypes torch.save writes and torch.load(weights_only=True) reads back, that safetensors can't store
TORCH_ONLY = ["complex128", "complex32", "bcomplex32", *BITS]
#: safetensors dtypes torch has none for
SAFETENSORS_ONLY = ["F6_E2M3", "F6_E3M2"]


def tensors(name: str) -> dict[str, torch.Tensor]:
    """A 2-D, a 1-D and an empty tensor of dtype ``name``: real values where torch casts to it, else random
    bytes viewed as it."""
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(len(name))

    def make(*shape: int) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point or dtype.is_complex:
            try:
                return (torch.randn(shape, generator=g) * 4).to(dtype)
            except (RuntimeError, TypeError):
                pass  # no cast to it (float4_e2m1fn_x2): its bits
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g, dtype=torch.uint8)
        return raw.view(dtype)

    return {"w": make(3, 4), "b": make(2), "e": make(0, 2)}


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, t in want.items():
        assert (got[k].dtype, got[k].shape) == (t.dtype, t.shape), k
        assert torch.equal(got[k].contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    entries = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    entries.pop("__metadata__", None)
    return {k: (e["dtype"], e["shape"]) for k, e in entries.items()}


def convert(src: Path, dst: Path, torch_free: bool, cli_runner: Any, mp: pytest.MonkeyPatch) -> Any:
    """``ckptfix convert SRC DST`` on one path; the result, and whether the torch-free writer wrote it."""
    mp.setenv(ENV_SWITCH, "1" if torch_free else "0")
    took: list[bool] = []
    real = conversion.write_torch_free

    def spy(*args: Any, **kwargs: Any) -> Any:
        took.append(True)
        return real(*args, **kwargs)

    mp.setattr(conversion, "write_torch_free", spy)
    res = cli_runner.invoke(cli, ["convert", str(src), str(dst)])
    return res, bool(took)


def test_ckptfix_knows_every_dtype_safetensors_stores() -> None:
    assert set(DTYPES.values()) == set(BOTH)


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
@pytest.mark.parametrize("name", BOTH)
def test_safetensors_to_pth_and_back(name: str, torch_free: bool, tmp_path: Path, cli_runner: Any,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    want = tensors(name)
    src = tmp_path / "src.safetensors"
    save_file(want, str(src))
    res, took = convert(src, tmp_path / "out.pth", torch_free, cli_runner, monkeypatch)
    assert res.exit_code == 0, res.output
    assert took == torch_free
    assert_bits_equal(torch.load(tmp_path / "out.pth", weights_only=True), want)
    res, took = convert(tmp_path / "out.pth", tmp_path / "back.safetensors", torch_free, cli_runner, monkeypatch)
    assert res.exit_code == 0, res.output
    assert_bits_equal(read_safetensors(tmp_path / "back.safetensors"), want)
    assert header(tmp_path / "back.safetensors") == header(src)  # dtype names and (F4: value-counting) shapes


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
@pytest.mark.parametrize("name", BOTH)
def test_pth_to_safetensors(name: str, torch_free: bool, tmp_path: Path, cli_runner: Any,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    want = tensors(name)
    torch.save(want, tmp_path / "src.pth")
    res, took = convert(tmp_path / "src.pth", tmp_path / "out.safetensors", torch_free, cli_runner, monkeypatch)
    assert res.exit_code == 0, res.output
    assert took == torch_free
    assert_bits_equal(read_safetensors(tmp_path / "out.safetensors"), want)
    save_file(want, str(tmp_path / "theirs.safetensors"))
    assert header(tmp_path / "out.safetensors") == header(tmp_path / "theirs.safetensors")


@pytest.mark.parametrize("name", BOTH)
def test_inspect_names_the_dtype(name: str, tmp_path: Path, cli_runner: Any) -> None:
    save_file(tensors(name), str(tmp_path / "src.safetensors"))
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "src.safetensors"), "--json"])
    assert res.exit_code == 0, res.output
    assert set(json.loads(res.output)["dtypes"]) == {name}


@pytest.mark.parametrize("name", TORCH_ONLY)
def test_torch_only_dtype_is_refused_by_name(name: str, tmp_path: Path, cli_runner: Any) -> None:
    dtype = getattr(torch, name)
    torch.save({"w": torch.zeros(4 * dtype.itemsize, dtype=torch.uint8).view(dtype)}, tmp_path / "src.pth")
    res = cli_runner.invoke(cli, ["convert", str(tmp_path / "src.pth"), str(tmp_path / "out.safetensors")])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "'w'" in res.stderr and name in res.stderr and "a bug in ckptfix" not in res.stderr, res.stderr
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
@pytest.mark.parametrize("name", TORCH_ONLY)
def test_torch_only_dtype_inspects_and_converts_to_pth(name: str, torch_free: bool, tmp_path: Path, cli_runner: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """bits8 and the other bit containers (no finfo/iinfo) and complex dtypes: inspect names them, .pth → .pth
    keeps them bit for bit, with the torch-free path on and off (it declines them: torch's path writes them)."""
    want = tensors(name)
    torch.save(want, tmp_path / "src.pth")
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "src.pth"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["dtypes"] == {name: 3}
    res, _ = convert(tmp_path / "src.pth", tmp_path / "out.pth", torch_free, cli_runner, monkeypatch)
    assert res.exit_code == 0, res.output
    assert_bits_equal(torch.load(tmp_path / "out.pth", weights_only=True), want)


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("name", SAFETENSORS_ONLY)
def test_safetensors_only_dtype_is_refused_by_name(name: str, command: str, tmp_path: Path, cli_runner: Any) -> None:
    """A real file with its U8 tensor's dtype edited to a 6-bit one: 4 values in 3 bytes."""
    save_file({"w": torch.arange(3, dtype=torch.uint8)}, str(tmp_path / "u8.safetensors"))
    raw = (tmp_path / "u8.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    text = raw[8 : 8 + n].replace(b'"dtype":"U8","shape":[3]', f'"dtype":"{name}","shape":[4]'.encode())
    assert name.encode() in text
    (tmp_path / "src.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    args = [command, str(tmp_path / "src.safetensors")] + ([str(tmp_path / "out.pth")] if command == "convert" else [])
    res = cli_runner.invoke(cli, args)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "'w'" in res.stderr and name in res.stderr and "no torch dtype" in res.stderr, res.stderr
    assert not (tmp_path / "out.pth").exists()
