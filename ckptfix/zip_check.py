"""Zip structure checks for torch archives: what torch's own reader does not verify.

torch takes the archive's root folder from the first central-directory entry, reads
``ROOT/data.pkl`` through the central directory and maps ``ROOT/data/N`` in place; it checks no
CRC, and other readers (Python's zipfile, a scanner streaming local headers) may see different
bytes in the same file. Wherever the file can be read two ways — duplicate names, a local header
naming another file, members outside the root, bytes hidden before, between or after the
members, compressed or encrypted members — it is reported here, never guessed.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_CHUNK = 16 << 20


@dataclass
class Member:
    """One central-directory entry and where its bytes really are."""

    name: str
    offset: int  # local header
    data_start: int
    compress_type: int
    compress_size: int
    file_size: int
    crc: int
    flags: int


@dataclass
class ZipLayout:
    """The archive as torch would read it, plus every way it can be read differently."""

    root: str = ""
    members: list[Member] = field(default_factory=list)
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, where, message)
    errors: list[str] = field(default_factory=list)  # corruption: the file can't be read at all
    unreferenced: list[tuple[int, int]] = field(default_factory=list)  # byte ranges no record accounts for

    def find(self, kind: str, where: str, message: str) -> None:
        self.findings.append((kind, where, message))

    def unique(self, name: str) -> Member | None:
        """The member called ``name`` when exactly one is."""
        found = [m for m in self.members if m.name == name]
        return found[0] if len(found) == 1 else None


def check_zip(path: str, buf: Any, size: int, torchscript: bool = False, check_crc: bool = True) -> ZipLayout:
    """Check the structure of the zip in ``buf`` (an mmap of ``path``, ``size`` bytes).

    ``check_crc=False`` verifies the CRC of ``.pkl`` members only (tensor data is integrity, not
    safety, and reading all of it would make every load read the whole file).
    """
    layout = ZipLayout()
    try:
        from .formats import zip_infos

        infos = zip_infos(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        layout.errors.append(f"is a truncated or corrupt zip archive ({e})")
        return layout
    if not infos:
        layout.errors.append("is an empty zip archive")
        return layout
    cd_start, cd_end = _end_records(layout, buf, size)
    first = infos[0].filename
    layout.root = first.split("/", 1)[0] if "/" in first else ""
    if not layout.root:
        layout.errors.append(f"first member {first!r} is not inside a folder (torch can't read it)")
    for info in infos:
        member = _local_header(layout, buf, size, info)
        if member is not None:
            layout.members.append(member)
    _check_names(layout, infos)
    _check_methods(layout, torchscript)
    _check_gaps(layout, buf, cd_start, cd_end)
    for m in layout.members:
        if m.crc and (check_crc or m.name.endswith(".pkl")) and m.compress_type in (0, 8) and not m.flags & 1:
            crc = 0
            try:
                for chunk in iter_member(m, buf):
                    crc = zlib.crc32(chunk, crc)
            except ValueError as e:
                layout.errors.append(f"member {m.name}: {e}")
                continue
            if crc != m.crc:
                layout.find("crc-mismatch", m.name, f"member {m.name}: CRC-32 {crc:08x} does not match "
                            f"the recorded {m.crc:08x} (altered or corrupt)")
    return layout


def iter_member(m: Member, buf: Any) -> Iterator[bytes]:
    """The member's uncompressed bytes in chunks (stored or deflated); ValueError if it can't be read."""
    end = m.data_start + m.compress_size
    if m.flags & 1:
        raise ValueError("is encrypted")
    if m.compress_type == 0:
        for pos in range(m.data_start, end, _CHUNK):
            yield bytes(buf[pos : min(pos + _CHUNK, end)])
        return
    if m.compress_type != 8:
        raise ValueError(f"uses compression method {m.compress_type}, which can't be analysed")
    inflater = zlib.decompressobj(-15)
    produced = 0
    try:
        for pos in range(m.data_start, end, _CHUNK):
            out = inflater.decompress(bytes(buf[pos : min(pos + _CHUNK, end)]), m.file_size + 1 - produced)
            produced += len(out)
            if produced > m.file_size:
                raise ValueError(f"inflates past its recorded size ({m.file_size} bytes)")
            yield out
    except zlib.error as e:
        raise ValueError(f"has corrupt deflate data ({e})") from None


def read_member(m: Member, buf: Any) -> bytes:
    return b"".join(iter_member(m, buf))


def _end_records(layout: ZipLayout, buf: Any, size: int) -> tuple[int, int]:
    """Find the end-of-central-directory record as readers do (the last one); report bytes around it."""
    tail_start = max(0, size - (22 + 65535))
    pos = buf.rfind(_EOCD, tail_start)
    if pos < 0 or pos + 22 > size:
        layout.errors.append("has no end-of-central-directory record")
        return size, size
    _sig, _d, _dcd, _n, _total, cd_size, cd_offset, comment_len = struct.unpack("<4s4H2LH", buf[pos : pos + 22])
    record_start = pos
    loc = pos - 20
    if loc >= 0 and buf[loc : loc + 4] == _EOCD64_LOCATOR:
        (eocd64,) = struct.unpack("<Q", buf[loc + 8 : loc + 16])
        if eocd64 + 56 <= size and buf[eocd64 : eocd64 + 4] == b"PK\x06\x06":
            cd_size, cd_offset = struct.unpack("<2Q", buf[eocd64 + 40 : eocd64 + 56])
            record_start = eocd64
    after = size - (pos + 22 + comment_len)
    if after > 0:
        layout.find("data-after", "archive", f"{after} bytes after the end of the zip archive")
        layout.unreferenced.append((size - after, size))
    concat = record_start - cd_size - cd_offset
    if concat:
        layout.find("data-before", "archive",
                    f"the central directory is {concat} bytes from where its offsets say "
                    "(data prepended to the archive, or a second archive)")
    return cd_offset + concat, record_start


def _local_header(layout: ZipLayout, buf: Any, size: int, info: zipfile.ZipInfo) -> Member | None:
    off = info.header_offset
    head = bytes(buf[off : off + 30]) if 0 <= off < size else b""
    if len(head) < 30 or head[:4] != _LOCAL:
        layout.errors.append(f"member {info.filename}: no local header at byte {off}")
        return None
    _sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, elen = struct.unpack("<4s5H3L2H", head)
    raw = bytes(buf[off + 30 : off + 30 + nlen])
    local_name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
    if local_name != info.orig_filename:
        layout.find("name-mismatch", info.filename,
                    f"member {info.filename!r} has the name {local_name!r} in its local header")
    if method != info.compress_type or (flags & 1) != (info.flag_bits & 1):
        layout.find("header-mismatch", info.filename,
                    f"member {info.filename}: local header and central directory disagree on compression")
    elif not flags & 0x8 and 0xFFFFFFFF not in (csize, usize) and (crc, csize, usize) != (
            info.CRC, info.compress_size, info.file_size):
        layout.find("header-mismatch", info.filename,
                    f"member {info.filename}: local header and central directory disagree on its size or CRC")
    start = off + 30 + nlen + elen
    if start + info.compress_size > size:
        layout.errors.append(f"member {info.filename}: data runs past the end of the file (truncated)")
        return None
    return Member(info.filename, off, start, info.compress_type, info.compress_size, info.file_size,
                  info.CRC, info.flag_bits)


def _check_names(layout: ZipLayout, infos: list[zipfile.ZipInfo]) -> None:
    for name, n in Counter(i.filename for i in infos).items():
        if n > 1:
            layout.find("duplicate-member", name,
                        f"{n} members are named {name}: readers disagree on which one they read")
    for info in infos:
        if info.orig_filename != info.filename:
            layout.find("odd-name", info.filename, f"member name {info.orig_filename!r} holds a NUL byte or backslash")
        if layout.root and not info.filename.startswith(layout.root + "/"):
            layout.find("outside-root", info.filename,
                        f"member {info.filename} is outside the archive's root folder {layout.root}/ "
                        "(torch never reads it)")


def _check_methods(layout: ZipLayout, torchscript: bool) -> None:
    code = f"{layout.root}/code/"
    for m in layout.members:
        if m.flags & 1:
            layout.find("encrypted", m.name, f"member {m.name} is encrypted: it can't be analysed")
        elif m.compress_type != 0 and not (torchscript and m.name.startswith(code)):
            layout.find("compressed", m.name,
                        f"member {m.name} is compressed (method {m.compress_type}); torch writes every "
                        "member stored")


def _check_gaps(layout: ZipLayout, buf: Any, cd_start: int, cd_end: int) -> None:
    """Members, then the central directory, must tile the file with nothing hidden between them."""
    ordered = sorted(layout.members, key=lambda m: m.offset)
    if ordered and ordered[0].offset > 0:
        layout.find("data-before", "archive", f"{ordered[0].offset} bytes before the first member")
        layout.unreferenced.append((0, ordered[0].offset))
    for m, nxt in zip(ordered, [*ordered[1:], None]):
        data_end = m.data_start + m.compress_size
        if m.flags & 0x8:
            extra = (16, 24) if bytes(buf[data_end : data_end + 4]) == _DESCRIPTOR else (12, 20)
        else:
            extra = (0,)
        next_start = nxt.offset if nxt is not None else cd_start
        what = f"member {nxt.name}" if nxt is not None else "the central directory"
        if next_start < data_end:
            layout.find("overlap", m.name, f"member {m.name} overlaps {what}")
        elif next_start not in [data_end + e for e in extra]:
            layout.find("hidden-data", m.name,
                        f"{next_start - data_end} bytes between the end of member {m.name} and {what} "
                        "that no zip record accounts for")
            layout.unreferenced.append((data_end + extra[0], next_start))
