"""The zip central directory read exactly as torch reads it (miniz 3, as built into torch), in pure Python.

torch's ``PyTorchStreamReader`` finds the end-of-central-directory record by scanning back from the
end of the file, follows the zip64 locator to wherever it points, reads as many central-directory
entries as the record *counts*, and looks members up by name **case-insensitively** (ASCII). Python's
``zipfile`` differs on several of these points (it reads the zip64 record just before the locator,
reads entries until the directory's *size* is used up, shifts offsets for prepended data, and
compares names exactly), so the same bytes can be two different archives. :func:`read_directory`
is torch's view; :mod:`ckptfix.parse.zipcheck` compares it with Python's and refuses any disagreement.

Nothing here imports torch. ``buf`` is anything sliceable to bytes: ``bytes``, ``mmap``, ``memoryview``;
:func:`zip_directory` reads a path's (or a URL's) directory once for every reader of the file.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core import locations

EOCD_SIG, EOCD_SIZE = 0x06054B50, 22
EOCD64_SIG, EOCD64_SIZE = 0x06064B50, 56
LOCATOR_SIG, LOCATOR_SIZE = 0x07064B50, 20
CENTRAL_SIG, CENTRAL_SIZE = 0x02014B50, 46
LOCAL_SIG, LOCAL_SIZE = 0x04034B50, 30
DESCRIPTOR_SIG = 0x08074B50
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
_WINDOW = 4096
_MASKED_LOCAL_DIR = 0x2000


class ZipFormatError(ValueError):
    """torch's reader would refuse the archive; the message says why (miniz's reason)."""


@dataclass(slots=True)  # one per member: 20,000-tensor files hold 20,000
class Entry:
    """One central-directory entry, sizes and offset resolved through the zip64 extra field."""

    index: int
    raw_name: bytes
    flags: int
    method: int
    crc: int
    compress_size: int
    file_size: int
    header_offset: int
    extra: bytes

    @property
    def name(self) -> str:
        """The name as text (UTF-8 when flagged, else cp437, as zipfile decodes it)."""
        return self.raw_name.decode("utf-8" if self.flags & 0x800 else "cp437", errors="replace")


@dataclass
class Directory:
    """What torch sees: the entries in central-directory order and where the records are."""

    entries: list[Entry]
    eocd_offset: int
    cd_offset: int
    cd_size: int
    zip64_offset: int | None  # where the zip64 record is, when there is one
    comment_length: int
    #: the entries whose CRC-32 of 0 is torch's "none recorded" (:func:`unrecorded_crcs`), and the save that wrote them
    no_crc: frozenset[int] = frozenset()
    no_crc_why: str = ""

    def crc(self, entry: Entry) -> int | None:
        """The CRC-32 the zip records for ``entry``; None where its writer recorded none (its 0 is no checksum)."""
        return None if entry.index in self.no_crc else entry.crc

    def crc_note(self, path: str) -> str | None:
        """The line that says ``path``'s records carry no CRC-32 to check their bytes against; None where they do."""
        if not self.no_crc:
            return None
        if self.no_crc_why == CRC32_OFF:
            return f"{path}'s zip records no CRC-32s ({CRC32_OFF}): its bytes can't be checked against them"
        return f"{path}'s zip records no CRC-32 for its storages ({self.no_crc_why}): their bytes can't be checked"

    def lookup(self, name: str) -> list[Entry]:
        """Every entry torch's ``mz_zip_reader_locate_file`` could return for ``name`` (ASCII case folded)."""
        key = fold(name.encode("utf-8"))
        return [e for e in self.entries if fold(e.raw_name) == key]

    @property
    def root(self) -> str:
        """The archive's folder as torch takes it: the first entry's name up to its first '/'."""
        first = self.entries[0].raw_name if self.entries else b""
        return first.split(b"/", 1)[0].decode("utf-8", errors="replace") if b"/" in first else ""


def fold(raw: bytes) -> bytes:
    """miniz's case folding for name lookups: ASCII letters only."""
    return raw.lower() if raw.isascii() else bytes(c + 32 if 65 <= c <= 90 else c for c in raw)


def _u16(buf: Any, pos: int) -> int:
    return struct.unpack_from("<H", buf, pos)[0]


def _u32(buf: Any, pos: int) -> int:
    return struct.unpack_from("<I", buf, pos)[0]


def _u64(buf: Any, pos: int) -> int:
    return struct.unpack_from("<Q", buf, pos)[0]


def _bytes(buf: Any, start: int, n: int) -> bytes:
    return bytes(buf[start : start + n])


def find_eocd(buf: Any, size: int) -> int | None:
    """The end-of-central-directory record's offset, found as miniz finds it (scanning 4 KiB windows
    back from the end for the last signature with room for a whole record, giving up ~64 KiB back)."""
    if size < EOCD_SIZE:
        return None
    cur = max(size - _WINDOW, 0)
    while True:
        n = min(_WINDOW, size - cur)
        window = _bytes(buf, cur, n)
        if len(window) != n:
            return None
        i = n - 4
        while i >= 0:
            i = window.rfind(b"PK\x05\x06", 0, i + 4)
            if i < 0:
                break
            if size - (cur + i) >= EOCD_SIZE:
                return cur + i
            i -= 1
        if cur == 0 or size - cur >= _U16 + EOCD_SIZE:
            return None
        cur = max(cur - (_WINDOW - 3), 0)


def read_directory(buf: Any, size: int) -> Directory:
    """The central directory as torch's miniz reads it; ZipFormatError where torch would fail."""
    eocd = find_eocd(buf, size)
    if eocd is None:
        raise ZipFormatError("no end-of-central-directory record (torch: failed finding central directory)")
    head = _bytes(buf, eocd, EOCD_SIZE)
    total, on_disk = _u16(head, 10), _u16(head, 8)
    this_disk, cd_disk = _u16(head, 4), _u16(head, 6)
    cd_size, cd_offset = _u32(head, 12), _u32(head, 16)
    zip64_offset = None
    if eocd >= LOCATOR_SIZE + EOCD64_SIZE:
        locator = _bytes(buf, eocd - LOCATOR_SIZE, LOCATOR_SIZE)
        if _u32(locator, 0) == LOCATOR_SIG:
            at = _u64(locator, 8)
            if at > size - EOCD64_SIZE:
                raise ZipFormatError("the zip64 locator points past the end of the file")
            record = _bytes(buf, at, EOCD64_SIZE)
            if _u32(record, 0) == EOCD64_SIG:
                zip64_offset = at
                if _u64(record, 4) < EOCD64_SIZE - 12:
                    raise ZipFormatError("the zip64 end-of-central-directory record is too short")
                if _u32(locator, 16) != 1:
                    raise ZipFormatError("multi-disk zip64 archive")
                total, on_disk = _u64(record, 32), _u64(record, 24)
                cd_size = _u64(record, 40)
                if total > _U32 or on_disk > _U32 or cd_size > _U32:
                    raise ZipFormatError("too many entries or too large a central directory for torch's reader")
                this_disk, cd_disk = _u32(record, 16), _u32(record, 20)
                cd_offset = _u64(record, 48)
    if total != on_disk or (this_disk | cd_disk) != 0 and (this_disk, cd_disk) != (1, 1):
        raise ZipFormatError("multi-disk archive")
    if cd_size < total * CENTRAL_SIZE or cd_offset + cd_size > size:
        raise ZipFormatError("the central directory's size or offset is invalid")
    directory = _bytes(buf, cd_offset, cd_size)
    entries, pos = [], 0
    for index in range(total):
        if cd_size - pos < CENTRAL_SIZE or _u32(directory, pos) != CENTRAL_SIG:
            raise ZipFormatError(f"central-directory entry {index + 1} is corrupt")
        (flags, method, crc, csize, usize, nlen, elen, clen, disk) = struct.unpack_from(
            "<2H4x3I4H", directory, pos + 8)
        local = _u32(directory, pos + 42)
        if csize != _U32 and usize != _U32 and (method == 0 and usize != csize or usize and not csize):
            raise ZipFormatError(f"central-directory entry {index + 1} has inconsistent sizes")
        if disk == _U16 or disk not in (this_disk, 1):
            raise ZipFormatError("multi-disk archive")
        if csize != _U32 and local + LOCAL_SIZE + csize > size:
            raise ZipFormatError(f"central-directory entry {index + 1} runs past the end of the file")
        if flags & _MASKED_LOCAL_DIR:
            raise ZipFormatError("encrypted central directory")
        if CENTRAL_SIZE + nlen + elen + clen > cd_size - pos:
            raise ZipFormatError(f"central-directory entry {index + 1} runs past the directory")
        name = _bytes(directory, pos + CENTRAL_SIZE, nlen)
        extra = _bytes(directory, pos + CENTRAL_SIZE + nlen, elen)
        usize, csize, local = _zip64_values(extra, usize, csize, local, index)
        entries.append(Entry(index, name, flags, method, crc, csize, usize, local, extra))
        pos += CENTRAL_SIZE + nlen + elen + clen
    no_crc, why = unrecorded_crcs(buf, size, entries)
    return Directory(entries, eocd, cd_offset, cd_size, zip64_offset, _u16(head, 20), no_crc, why)


#: why a torch zip records no CRC-32 for some records: what its saver was told (each observed in torch 2.14's files)
CRC32_OFF = "saved with torch.serialization.set_crc32_options(False)"
SKIP_DATA = "saved under torch.serialization.skip_data(), as FakeTensors are: reserved, filled later or never"


def unrecorded_crcs(buf: Any, size: int, entries: list[Entry]) -> tuple[frozenset[int], str]:
    """The entries whose CRC-32 of 0 means "none recorded", as torch writes it, and why ("" for none).

    torch writes 0 for every record of a ``set_crc32_options(False)`` save, and for every ``data/`` record of a
    ``skip_data()`` save (FakeTensors are saved so) while its other records carry theirs; in both, the copy after
    the bytes (data descriptor; its local header's where there is none) is 0 too. Only those patterns count, each
    record's local copy 0: a 0 among recorded CRC-32s, or beside a local copy that holds one, is damage and checked
    as such. A record of no bytes is left out: its CRC-32 is 0."""
    sized = [e for e in entries if e.file_size]
    zero = [e for e in sized if e.crc == 0]
    if not zero:
        return frozenset(), ""
    if len(zero) == len(sized):
        why = CRC32_OFF
    elif zero == [e for e in sized if e.raw_name.split(b"/", 1)[-1].startswith(b"data/")]:
        why = SKIP_DATA
    else:
        return frozenset(), ""
    locations.prefetch(buf, [(e.header_offset, LOCAL_SIZE + len(e.raw_name) + 128) for e in zero])
    found = frozenset(e.index for e in zero if _local_crc(buf, size, e) == 0)
    return found, why if found else ""


def _local_crc(buf: Any, size: int, entry: Entry) -> int | None:
    """The CRC-32 the entry's local copy records: its data descriptor's (flag bit 3), else its local header's;
    None where there is none to read."""
    try:
        start, _name, fields = data_start(buf, size, entry)
    except ZipFormatError:
        return None
    if fields is None:
        return None
    if not fields[0] & 0x8:
        return fields[2]
    tail = _bytes(buf, start + entry.compress_size, 8)
    if len(tail) < 8:
        return None
    return _u32(tail, 4) if _u32(tail, 0) == DESCRIPTOR_SIG else _u32(tail, 0)


_ZIP_CACHE: dict[tuple, Any] = {}


def zip_directory(path: str) -> Directory:
    """The zip's central directory as torch reads it (:class:`Directory`), parsed once per file version:
    sniffing, the safety checks and the structure reader all need it, and for a checkpoint of 20,000
    tensors parsing it costs a noticeable fraction of a second.
    Raises :class:`ZipFormatError` (a ValueError) where torch's reader would fail."""
    if locations.is_remote(path):
        source = locations.open_source(path)
        if source.validator is None:  # (a version can't be told: parsed again, from the session's cached blocks)
            with locations.open_buffer(path) as buf:
                return read_directory(buf, len(buf))
        key: tuple = (path, source.size, source.validator)
    else:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _ZIP_CACHE:
        with locations.open_buffer(path) as buf:
            directory = read_directory(buf, len(buf))
        _ZIP_CACHE.clear()  # keep only the latest file: conversions read one source at a time
        _ZIP_CACHE[key] = directory
    return _ZIP_CACHE[key]


def _zip64_values(extra: bytes, usize: int, csize: int, local: int, index: int) -> tuple[int, int, int]:
    """The sizes and offset from the first zip64 extra field, for each 32-bit value that is 0xFFFFFFFF."""
    if max(usize, csize, local) != _U32:
        return usize, csize, local
    pos = 0
    while pos + 4 <= len(extra):
        field_id, length = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + length > len(extra):
            raise ZipFormatError(f"central-directory entry {index + 1} has a corrupt extra field")
        if field_id == 1:
            data, at = extra[pos + 4 : pos + 4 + length], 0
            values = []
            for value in (usize, csize, local):
                if value == _U32:
                    if at + 8 > len(data):
                        raise ZipFormatError(f"central-directory entry {index + 1} has a short zip64 field")
                    value = _u64(data, at)
                    at += 8
                values.append(value)
            return values[0], values[1], values[2]
        pos += 4 + length
    return usize, csize, local


def data_start(buf: Any, size: int, entry: Entry) -> tuple[int, bytes, tuple[int, ...] | None]:
    """Where the entry's bytes start (torch's ``getRecordOffset``: the local header's name and extra
    lengths, its signature *not* checked), the local header's name, and its (flags, method, crc,
    compressed size, size) fields — None for those when the signature is wrong. ZipFormatError when
    there is no room for a local header at all."""
    off = entry.header_offset
    head = _bytes(buf, off, LOCAL_SIZE) if 0 <= off < size else b""
    if len(head) < LOCAL_SIZE:
        raise ZipFormatError(f"member {entry.name}: no local header at byte {off}")
    _sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, elen = struct.unpack("<IHHHHHIIIHH", head)
    local_name = _bytes(buf, off + LOCAL_SIZE, nlen)
    fields = (flags, method, crc, csize, usize) if _sig == LOCAL_SIG else None
    return off + LOCAL_SIZE + nlen + elen, local_name, fields


class RangeFile(io.RawIOBase):
    """``length`` bytes readable through ``read_at(position, n)`` as a seekable read-only file: a
    member of an mmap for zipfile, a record inside a larger file for torch.load, without a copy."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int):
        super().__init__()
        self.read_at, self.length, self.pos = read_at, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, out: Any) -> int:
        n = min(len(out), self.length - self.pos)
        data = self.read_at(self.pos, n) if n > 0 else b""
        out[: len(data)] = data
        self.pos += len(data)
        return len(data)
