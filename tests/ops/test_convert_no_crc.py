"""A torch zip whose records carry no CRC-32, as torch writes it (a CRC-32 of 0 in the central directory and in the
data descriptor): every record under ``torch.serialization.set_crc32_options(False)``, every ``data/`` record under
``skip_data()`` (FakeTensors are saved so; their bytes reserved, maybe filled in place later). torch never checks a
CRC-32, so those files load; ``convert`` converts them with one note (its output's CRC-32s computed from the bytes as
copied), ``verify`` warns, ``scan`` finds nothing. A 0 any other way — one record's among recorded CRC-32s, a lone
storage's whose data descriptor still holds its CRC-32 — is damage, refused as before (tests/ops/test_convert_crc.py).
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.parse.zipdir import zip_directory
from tests.remote_servers import http_server

SERVERS = (http_server,)  # the fixture, registered by being in this namespace


def _crc_off(tmp: Path) -> Path:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.randn(8, 8), "b": torch.arange(8.0)}, tmp / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(before)
    return tmp / "nocrc.pt"


def _skip_data(tmp: Path) -> Path:
    with torch.serialization.skip_data():
        torch.save({"w": torch.randn(8, 8), "b": torch.arange(8.0)}, tmp / "skip.pt")
    return tmp / "skip.pt"


def _skip_data_filled(tmp: Path) -> Path:
    """skip_data's file with its storages' bytes written in place afterwards, as its docs describe."""
    path, sd = tmp / "filled.pt", {"w": torch.randn(8, 8), "b": torch.arange(8.0)}
    with torch.serialization.skip_data():
        torch.save(sd, path)
    reader = torch._C.PyTorchFileReader(str(path))
    with open(path, "r+b") as f:
        for key, value in zip(("0", "1"), sd.values()):  # (storage keys in the order torch.save met them)
            f.seek(reader.get_record_offset(f"data/{key}"))
            f.write(value.numpy().tobytes())
    assert torch.equal(torch.load(path)["w"], sd["w"])
    return path


def _fake(tmp: Path) -> Path:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        sd = torch.nn.Linear(3, 2).state_dict()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(sd, tmp / "fake.pt")
    return tmp / "fake.pt"


#: how a torch save records no CRC-32s → what the note names
CRCLESS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "set_crc32_options-False": (_crc_off, "set_crc32_options(False)"),
    "skip_data": (_skip_data, "skip_data()"),
    "skip_data-filled-later": (_skip_data_filled, "skip_data()"),
    "fake-tensors": (_fake, "skip_data()"),
}


def _crcs(path: Path) -> list[tuple[str, int, int]]:
    """Each record's (name, CRC-32 its central directory records, CRC-32 of its bytes)."""
    raw = path.read_bytes()
    found = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():  # (stored records: zipfile's own read would check the CRC-32)
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
            start = info.header_offset + 30 + name_len + extra_len
            found.append((info.filename, info.CRC, zlib.crc32(raw[start : start + info.file_size])))
    return found


@pytest.mark.parametrize("how", list(CRCLESS))
def test_torch_writes_a_crc_of_0_where_it_records_none(how: str, tmp_path: Path) -> None:
    """What the rule rests on, observed: 0 in the central directory for each record the save leaves unrecorded
    (every record, or every data/ record) while its bytes' CRC-32 is not 0; torch.load reads the file anyway."""
    make, _says = CRCLESS[how]
    path = make(tmp_path)
    zero = {name.split("/", 1)[1] for name, recorded, real in _crcs(path) if recorded == 0 and real != 0}
    data = {name.split("/", 1)[1] for name, _r, _c in _crcs(path) if name.split("/", 1)[1].startswith("data/")}
    assert zero == ({n.split("/", 1)[1] for n, _r, _c in _crcs(path)} if how.startswith("set_crc32") else data)
    assert zip_directory(str(path)).no_crc  # the one predicate (parse.zipdir.unrecorded_crcs) agrees
    torch.load(path, weights_only=True)


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
@pytest.mark.parametrize("flags", [{}, {"trust": True}, {"dtype": "bf16"}], ids=["plain", "trust", "cast"])
@pytest.mark.parametrize("out", ["out.pth", "out.safetensors"])
@pytest.mark.parametrize("how", list(CRCLESS))
def test_a_crcless_save_converts_with_one_note(how: str, out: str, flags: dict, torch_free: bool, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    make, says = CRCLESS[how]
    src = make(tmp_path)
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    report = ckptfix.convert(src, tmp_path / out, to="keep", progress=False, **flags)
    notes = [n for n in report.notes if "CRC-32" in n]
    assert len(notes) == 1 and str(src) in notes[0] and says in notes[0], report.notes
    want = torch.load(src, weights_only=True)
    got = ckptfix.read(tmp_path / out).state_dict
    for key, value in want.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), key
    if out.endswith(".pth"):  # the output's CRC-32s are real: computed from the bytes as copied
        assert all(recorded == real for _n, recorded, real in _crcs(tmp_path / out))
        assert not zip_directory(str(tmp_path / out)).no_crc
    assert ckptfix.verify(tmp_path / out).warnings == []


@pytest.mark.parametrize("how", list(CRCLESS))
def test_verify_warns_and_scan_finds_nothing(how: str, tmp_path: Path) -> None:
    make, says = CRCLESS[how]
    src = make(tmp_path)
    report = ckptfix.verify(src)
    assert report.ok and report.failures == [], report.failures
    (warning,) = [w for w in report.warnings if "CRC-32" in w]
    assert warning.startswith("integrity: ") and says in warning and str(src) in warning
    assert not [n for n in report.notes if "CRC-32" in n]  # (the read's note: said once, as the warning)
    scanned = ckptfix.scan(src)
    assert scanned.ok and scanned.findings == []


def _zero_crc(src: Path, dst: Path, record: str) -> Path:
    """``src`` with the CRC-32 the central directory records for ``record`` (``data/0``, ``data.pkl``) set to 0."""
    data = bytearray(src.read_bytes())
    directory = zip_directory(str(src))
    pos = directory.cd_offset
    for entry in directory.entries:
        name_len, extra_len, comment_len = struct.unpack_from("<3H", data, pos + 28)
        if entry.name.split("/", 1)[1] == record:
            struct.pack_into("<I", data, pos + 16, 0)
        pos += 46 + name_len + extra_len + comment_len
    dst.write_bytes(bytes(data))
    return dst


def _three_storages(tmp: Path) -> Path:
    torch.save({"a": torch.randn(16), "b": torch.randn(4, 4), "c": torch.ones(3)}, tmp / "three.pt")
    return tmp / "three.pt"


def _one_storage(tmp: Path) -> Path:
    torch.save({"a": torch.randn(16)}, tmp / "one.pt")
    return tmp / "one.pt"


#: a CRC-32 zeroed after the save → what convert refuses with (the record named), and scan's finding
DAMAGED: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    "one-storage-among-recorded": (_three_storages, "data/1", "does not match the CRC-32 its zip records"),
    "a-lone-storage": (_one_storage, "data/0", "does not match the CRC-32 its zip records"),  # its descriptor has one
    "the-pickle": (_three_storages, "data.pkl", "CRC-32"),
    "a-skip_data-save-pickle": (_skip_data, "data.pkl", "CRC-32"),  # (no torch save's pattern: all checked)
}


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
@pytest.mark.parametrize("case", list(DAMAGED))
def test_one_zeroed_crc_among_recorded_ones_is_damage(case: str, torch_free: bool, tmp_path: Path, cli_runner: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    make, record, says = DAMAGED[case]
    (tmp_path / "src").mkdir()
    bad = _zero_crc(make(tmp_path / "src"), tmp_path / "bad.pt", record)
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    (tmp_path / "out").mkdir()
    res = cli_runner.invoke(cli, ["convert", str(bad), str(tmp_path / "out" / "out.pth"), "-q"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert str(bad) in lines[0] and record in lines[0] and says in lines[0], lines[0]
    assert list((tmp_path / "out").iterdir()) == []
    assert any(f.kind == "crc-mismatch" and f.where.endswith(record) for f in ckptfix.scan(bad).findings)
    if record.startswith("data/"):
        report = ckptfix.verify(bad)
        assert not report.ok and any(record in f and "CRC-32 does not match" in f for f in report.failures)
        assert not [w for w in report.warnings if "CRC-32" in w]


@pytest.mark.parametrize("how", list(CRCLESS))
def test_a_crcless_save_loads_with_strict_values_and_from_a_url(how: str, tmp_path: Path, http_server: Any) -> None:
    """The loads that check records against their CRC-32s (``strict_values``; a URL's storages, fetched over a network)
    load it as torch does; a zeroed CRC among recorded ones is still refused by both (as damage, naming the record)."""
    def holding(path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:  # (a model of the file's keys, zeros)
        want, model = torch.load(path, weights_only=True), torch.nn.Module()
        for key, value in want.items():
            model.register_buffer(key, torch.zeros_like(value))
        return model, want

    path = CRCLESS[how][0](tmp_path)
    model, want = holding(path)
    ckptfix.load_into(model, path, strict_values=True)
    assert all(torch.equal(getattr(model, k), v) for k, v in want.items())
    (http_server.root / path.name).write_bytes(path.read_bytes())
    got = ckptfix.load(http_server.url(path.name))
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    damaged = _zero_crc(_three_storages(tmp_path), tmp_path / "damaged.pt", "data/1")
    (http_server.root / damaged.name).write_bytes(damaged.read_bytes())
    model, _want = holding(damaged)
    for load in (lambda: ckptfix.load_into(model, damaged, strict_values=True),
                 lambda: ckptfix.load(http_server.url(damaged.name))):
        with pytest.raises(ckptfix.errors.FormatError, match="record data/1 does not match the CRC-32 its zip records"):
            load()
    assert not any(getattr(model, k).any() for k in ("a", "b", "c"))  # (nothing loaded)
