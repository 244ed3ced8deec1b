"""The records torch's zip reader opens before it unpickles anything (the version record, ``.storage_alignment``,
``byteorder``, ``.format_version``, ``.data/serialization_id``): where torch refuses the file because one is
encrypted or the version is unreadable, ckptfix refuses it as damage, with one Error line (issue 20, item 4)."""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.parse import zipcheck


def _saved(tmp_path: Path) -> bytes:
    path = tmp_path / "src.pth"
    torch.save({"w": torch.arange(4.0)}, path)
    return path.read_bytes()


def _headers(data: bytes, name: str) -> tuple[int, int]:
    """Offsets of the local header and the central-directory entry of member ``name``."""
    local = central = -1
    for m in re.finditer(rb"PK\x03\x04", data):
        n = struct.unpack("<H", data[m.start() + 26 : m.start() + 28])[0]
        if data[m.start() + 30 : m.start() + 30 + n] == name.encode():
            local = m.start()
    for m in re.finditer(rb"PK\x01\x02", data):
        n = struct.unpack("<H", data[m.start() + 28 : m.start() + 30])[0]
        if data[m.start() + 46 : m.start() + 46 + n] == name.encode():
            central = m.start()
    assert local >= 0 and central >= 0, name
    return local, central


def _encrypted(record: str):
    def edit(data: bytearray) -> None:
        local, central = _headers(bytes(data), f"src/{record}")
        data[local + 6] |= 1
        data[central + 8] |= 1
    return edit


def _version(text: bytes):
    def edit(data: bytearray) -> None:
        with zipfile.ZipFile(__import__("io").BytesIO(bytes(data))) as z:
            info = z.getinfo("src/version")
            old = z.read(info)
        assert len(text) == len(old)
        local, central = _headers(bytes(data), "src/version")
        start = data.index(old, local + 30)
        data[start : start + len(old)] = text
        crc = struct.pack("<I", zlib.crc32(text))
        data[local + 14 : local + 18] = crc
        data[central + 16 : central + 20] = crc
    return edit


def _renamed(record: str, to: str | None):
    """The archive rewritten by zipfile (records stored, as torch writes them) with ``record`` renamed, or dropped."""
    def edit(data: bytearray) -> None:
        src = zipfile.ZipFile(io.BytesIO(bytes(data)))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as z:
            for info in src.infolist():
                if info.filename == f"src/{record}":
                    if to is None:
                        continue
                    info.filename = f"src/{to}"
                z.writestr(info, src.read(info))
        data[:] = out.getvalue()
    return edit


REFUSED = {
    "no version record": _renamed("version", None),
    "version under another name": _renamed("version", "versions"),
    "encrypted .storage_alignment": _encrypted(".storage_alignment"),
    "encrypted version": _encrypted("version"),
    "encrypted byteorder": _encrypted("byteorder"),
    "encrypted .format_version": _encrypted(".format_version"),
    "encrypted serialization_id": _encrypted(".data/serialization_id"),
    "version not a number": _version(b"x\n"),
    "version 0": _version(b"0\n"),
    "version 99": _version(b"99"),
    "version -1": _version(b"-1"),
}
ACCEPTED = {"version 3x": _version(b"3x"), "version  3": _version(b" 3"), "version +3": _version(b"+3"),
            "version in .data/version": _renamed("version", ".data/version"), "rewritten": _renamed("byteorder", "byteorder")}


@pytest.mark.parametrize("command", ["scan", "inspect", "convert"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_record_torch_refuses_is_refused(case: str, command: str, tmp_path: Path, refused_as_damage) -> None:
    data = bytearray(_saved(tmp_path))
    REFUSED[case](data)
    path = tmp_path / "bad.pth"
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError):  # torch's own reader refuses the file
        torch.load(path, weights_only=True)
    line = refused_as_damage(command, path)
    assert "refused" not in line  # damage, not danger
    if "version" in case:
        assert "version" in line and "hasRecord" not in line, line  # ckptfix's words, not torch's check


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_version_torch_reads_is_accepted(case: str, tmp_path: Path) -> None:
    data = bytearray(_saved(tmp_path))
    ACCEPTED[case](data)
    path = tmp_path / "ok.pth"
    path.write_bytes(bytes(data))
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))
    assert ckptfix.scan(path).ok
    assert torch.equal(ckptfix.load(path)["w"], torch.arange(4.0))


def test_supported_versions_are_torch_s() -> None:
    """The range ckptfix accepts is caffe2/serialize/versions.h's, of the installed torch."""
    header = (Path(torch.__file__).parent / "include/caffe2/serialize/versions.h").read_text()
    low = int(re.search(r"kMinSupportedFileFormatVersion\s*=\s*(0x[0-9a-fA-F]+|\d+)", header).group(1), 0)
    high = int(re.search(r"kMaxSupportedFileFormatVersion\s*=\s*(0x[0-9a-fA-F]+|\d+)L?", header).group(1), 0)
    assert zipcheck.SUPPORTED_VERSIONS == (low, high)
