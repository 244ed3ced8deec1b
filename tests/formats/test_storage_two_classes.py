"""One storage record referenced through two storage classes (issue 20): ``data.pkl``'s persistent ids name
record ``data/0`` once as a FloatStorage and once as an IntStorage (or an UntypedStorage). ``torch.load``
keeps the first typed storage it made for a record and hands it to every later reference, whose own class
and size it ignores; ``_rebuild_tensor_v2`` then takes the dtype of that storage, ``_rebuild_tensor_v3`` its
own dtype argument. Both ckptfix readers (the torch-free describer and the structure read on meta) must
give the same dtypes, and every conversion must write what ``torch.load(weights_only=True)`` returns.

The files are real ``torch.save`` outputs whose ``data.pkl`` is edited at the pickle-opcode level: one
persistent id's record key is rewritten (same length, the member's CRC-32 updated), so every other byte is
torch's own.
"""

from __future__ import annotations

import pickletools
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH, NeedsTorch
from ckptfix.formats import describe
from ckptfix.formats.torchsave.records import read_structure
from ckptfix.parse.format_registry import TORCH_ZIP


def _rekey(path: Path, old: str, new: str) -> None:
    """Point the persistent id naming record ``old`` at record ``new`` (same length), in place."""
    archive = path.stem
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(f"{archive}/data.pkl")
        pkl = z.read(info)
    ops = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(pkl)]
    hits = [pos for i, (name, arg, pos) in enumerate(ops)
            if name == "BINUNICODE" and arg == old and ops[i - 1][0] in ("GLOBAL", "BINPUT") and "Storage" in str(
                next(a for n, a, _p in reversed(ops[:i]) if n == "GLOBAL"))]
    assert len(hits) == 1, hits
    edited = bytearray(pkl)
    edited[hits[0] : hits[0] + 5 + len(old)] = b"X" + struct.pack("<I", len(new)) + new.encode()
    assert len(edited) == len(pkl)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    assert raw[start : start + len(pkl)] == pkl
    raw[start : start + len(pkl)] = edited
    old_crc, new_crc = struct.pack("<I", info.CRC), struct.pack("<I", zlib.crc32(bytes(edited)))
    assert raw.count(old_crc) == 2  # the local header and the central directory
    path.write_bytes(bytes(raw).replace(old_crc, new_crc))


def _u16(n: int) -> torch.Tensor:
    return torch.arange(n).to(torch.uint16)


#: (name, state dict as saved): ``b``'s storage id is then pointed at ``a``'s record, ``data/0``
VARIANTS = {
    "float-then-int": lambda: {"a": torch.arange(4.0), "b": torch.arange(4, dtype=torch.int32).reshape(2, 2)},
    "int-then-float": lambda: {"a": torch.arange(4, dtype=torch.int32), "b": torch.arange(4.0).reshape(2, 2)},
    "untyped-then-float": lambda: {"a": _u16(8), "b": torch.ones(2, 2)},
    "float-then-untyped": lambda: {"a": torch.arange(4.0), "b": _u16(4).reshape(2, 2)},
    "double-then-half": lambda: {"a": torch.arange(4.0, dtype=torch.float64),
                                 "b": torch.arange(4.0, dtype=torch.float16).reshape(2, 2)},
    "short-then-float": lambda: {"a": torch.arange(2, dtype=torch.int16), "b": torch.ones(2, 2)},  # b overruns
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request: Any, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor] | None]:
    """The edited file and what ``torch.load(weights_only=True)`` returns for it (None: torch refuses it)."""
    path = tmp_path / "two.pth"
    torch.save(VARIANTS[request.param](), path)
    _rekey(path, "1", "0")
    try:
        return path, torch.load(path, weights_only=True)
    except RuntimeError:
        return path, None


def test_torch_keeps_the_first_typed_storage(tmp_path: Path) -> None:
    """The rule the readers follow, as torch applies it: ``b`` takes ``a``'s dtype, ``a``'s bytes."""
    path = tmp_path / "two.pth"
    torch.save(VARIANTS["float-then-int"](), path)
    _rekey(path, "1", "0")
    sd = torch.load(path, weights_only=True)
    assert sd["b"].dtype == torch.float32 and torch.equal(sd["b"], torch.arange(4.0).reshape(2, 2))


def test_the_describer_gives_torchs_dtypes(variant: tuple[Path, Any]) -> None:
    path, expected = variant
    try:
        got = describe(str(path), TORCH_ZIP).obj
    except NeedsTorch:  # torch's path then gives torch's answer
        assert expected is None
        return
    assert expected is not None, "torch refuses this file; describing it must defer to torch"
    assert {k: (t.dtype, t.shape) for k, t in got.items()} == \
        {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in expected.items()}


def test_the_structure_read_gives_torchs_dtypes(variant: tuple[Path, Any]) -> None:
    path, expected = variant
    try:
        got = read_structure(str(path)).obj
    except Exception as e:
        assert expected is None, f"{type(e).__name__}: {e}"
        return
    assert expected is not None, "torch refuses this file"
    assert {k: (t.dtype, t.shape) for k, t in got.items()} == {k: (t.dtype, t.shape) for k, t in expected.items()}


@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free", "streamed"])
@pytest.mark.parametrize("ext", [".safetensors", ".pth"])
def test_convert_writes_what_torch_loads(variant: tuple[Path, Any], ext: str, torch_free: str, cli_runner: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path, expected = variant
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    out = path.with_name(f"out{ext}")
    res = cli_runner.invoke(cli, ["convert", str(path), str(out), "-q"])
    if expected is None:
        assert res.exit_code == 1 and res.output.startswith("Error: "), res.output
        assert not out.exists()
        return
    assert res.exit_code == 0, res.output
    got = load_file(out) if ext == ".safetensors" else torch.load(out, weights_only=True)
    assert set(got) == set(expected)
    for key, t in expected.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
