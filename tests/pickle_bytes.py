"""Checkpoint bytes assembled by hand, opcode by opcode and record by record: pickle pieces (``proto``, ``u``,
``glob``, ``tup``, ``call``, ``as_weight``), torch zips (``write_zip``, ``with_data_pkl``, a zip64 with two
directories), legacy pickles and tars. tests/adversarial.py builds its corpus from them; other tests build files
torch's writers can't."""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


# -- pickle assembly ---------------------------------------------------------------------------------

def proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def u(text: str) -> bytes:
    """BINUNICODE."""
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(fn: bytes, *args: bytes) -> bytes:
    return fn + tup(*args) + b"R"


def as_weight(value: bytes, version: int = 2) -> bytes:
    """A pickle of ``{"weight": value}``."""
    return proto(version) + b"}" + u("weight") + value + b"s."


class Reduce:
    """Pickles as ``fn(*args)``: what ``pickle.dumps`` makes of a malicious ``__reduce__``."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


class TinyNet(torch.nn.Module):
    """A whole module saved with torch.save(model): its class is a global outside any allow-list."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)


# -- containers --------------------------------------------------------------------------------------

def benign_zip_members() -> list[tuple[str, bytes]]:
    """The members of a real torch.save zip (root ``archive``)."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def write_zip(path: Path, members: list[tuple[str, bytes] | tuple[str, bytes, int]],
              gap_after: dict[str, bytes] | None = None) -> None:
    """Members in order (duplicates allowed); ``gap_after[name]``: raw bytes written after that member."""
    with open(path, "wb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns on duplicate names: that is the point
        with zipfile.ZipFile(f, "w") as z:
            for name, data, *method in members:
                z.writestr(zipfile.ZipInfo(name), data, compress_type=method[0] if method else zipfile.ZIP_STORED)
                if gap_after and name in gap_after:
                    f.write(gap_after[name])
                    z.start_dir = f.tell()  # the next member starts after the hidden bytes


def with_data_pkl(data_pkl: bytes, method: int = zipfile.ZIP_STORED) -> list[tuple[str, bytes, int]]:
    return [(n, data_pkl if n == "archive/data.pkl" else d, method if n == "archive/data.pkl" else 0)
            for n, d in benign_zip_members()]


def legacy_pickles(main: bytes) -> list[bytes]:
    sys_info = pickle.dumps({"protocol_version": 1001, "little_endian": True,
                             "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    return [pickle.dumps(LEGACY_MAGIC, protocol=2), pickle.dumps(1001, protocol=2), sys_info, main,
            pickle.dumps([], protocol=2)]


def patch_cd_entry(data: bytearray, name: str, offset_in_entry: int, value: bytes) -> None:
    """Overwrite bytes of ``name``'s central-directory entry."""
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack("<LL", data[eocd + 12 : eocd + 20])
    pos = cd_offset
    while pos < cd_offset + cd_size:
        n, e, c = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        if data[pos + 46 : pos + 46 + n].decode() == name:
            data[pos + offset_in_entry : pos + offset_in_entry + len(value)] = value
            return
        pos += 46 + n + e + c
    raise KeyError(name)


def _raw_zip_parts(members: list, start: int) -> tuple[bytes, bytes]:
    """Stored members as local headers + data from offset ``start``, and their central-directory entries."""
    local, central, pos = b"", b"", start
    for name, data, *_method in members:
        raw, crc = name.encode(), zlib.crc32(data)
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(raw), 0)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                               len(raw), 0, 0, 0, 0, 0, pos) + raw
        local += head + raw + data
        pos += len(head) + len(raw) + len(data)
    return local, central


def _eocd64(entries: int, cd_size: int, cd_offset: int) -> bytes:
    return struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, cd_size, cd_offset)


def zip64_two_directories(torch_view: list, python_view: list) -> bytes:
    """One file, two archives: the zip64 locator points at a record for ``torch_view``'s directory
    (torch's miniz follows it); the record right before the locator, which Python's zipfile reads
    instead, describes ``python_view``'s."""
    local_t, cd_t = _raw_zip_parts(torch_view, 0)
    local_p, cd_p = _raw_zip_parts(python_view, len(local_t))
    out = local_t + local_p
    cd_t_at = len(out)
    out += cd_t
    eocd64_t_at = len(out)
    out += _eocd64(len(torch_view), len(cd_t), cd_t_at)
    cd_p_at = len(out)
    out += cd_p + _eocd64(len(python_view), len(cd_p), cd_p_at)
    out += struct.pack("<IIQI", 0x07064B50, 0, eocd64_t_at, 1)
    return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)


def _tar_member(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return buf.getvalue()[: 512 + (len(data) + 511) // 512 * 512]  # without the end-of-archive blocks


def _v7_header(name: bytes, size: int, block: bytearray | None = None) -> bytearray:
    """A pre-POSIX (V7) tar header: no ``ustar`` magic, which tarfile and so torch.load still read.
    Given ``block``, its name field (whatever bytes it holds) is kept and the other fields are set."""
    if block is None:
        block = bytearray(512)
        block[: len(name)] = name
    block[100:108] = b"0000644\0"
    block[124:136] = f"{size:011o}\0".encode()
    block[136:148] = b"00000000000\0"
    block[156:157] = b"0"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return block


def legacy_tar(pickle_member: bytes) -> bytes:
    """A torch < 0.4 tar checkpoint in the V7 format: what torch.load's tar path reads."""
    members = [("storages", pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2)),
               ("tensors", pickle.dumps(0, protocol=2)), ("pickle", pickle_member)]
    out = b""
    for name, data in members:
        out += bytes(_v7_header(name.encode(), len(data))) + data + bytes(-len(data) % 512)
    return out + bytes(1024)


def legacy_tar_polyglot(pickle_member: bytes) -> bytes:
    """A file that is a valid legacy torch pickle stream (five pickles, then one storage whose bytes
    run to the end of the file) *and* a V7 tar whose ``pickle`` member is ``pickle_member``. A scanner
    that reads it as the pickle stream sees a harmless tensor; torch.load tries tar first."""
    tail = legacy_tar(pickle_member)  # the members torch's tar path reads, after a first member
    head = pickle.dumps(LEGACY_MAGIC, protocol=2) + pickle.dumps(1001, protocol=2)
    # pickle 3 (sys_info): a bytes literal that swallows the rest of the tar header block, then {}
    literal_at = len(head) + 2 + 1 + 4  # PROTO 2, BINBYTES, 4-byte length
    literal = 512 - literal_at + 16
    sys_info = b"\x80\x02B" + struct.pack("<I", literal) + bytes(literal) + b"0}."
    first_member_size = 1024  # the rest of the legacy pickles live in the first tar member's data
    storage_start = 512 + first_member_size
    numel_at = None
    for _ in range(2):  # the storage's element count depends on the pickle's length, which depends on it
        numel = len(tail) + storage_start - (numel_at or 0) - 8 if numel_at else 0
        main = (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
                b"ctorch\nByteStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu" + b"\x8a\x08" + struct.pack("<q", numel)
                + b"NtQK\x00" + b"\x8a\x08" + struct.pack("<q", numel) + b"\x85K\x01\x85\x89ccollections\nOrderedDict\n)R"
                b"tRs.")
        keys = b"\x80\x02]X\x01\x00\x00\x000a."
        body = head + sys_info + main + keys
        numel_at = len(body)
    block = _v7_header(b"", first_member_size, bytearray(body[:512]))
    data = bytes(block) + body[512:]
    data += struct.pack("<q", numel)
    data += bytes(storage_start - len(data))
    return data + tail


