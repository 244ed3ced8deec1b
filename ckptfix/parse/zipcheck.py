"""Zip structure checks for torch archives: what torch's own reader does not verify.

torch reads the archive through miniz (:mod:`ckptfix.parse.zipdir` is that reader in Python): the root
folder from the first central-directory entry, ``ROOT/data.pkl`` looked up case-insensitively, tensor
records mapped in place; it checks no CRC. Other readers (Python's zipfile, a scanner streaming
local headers) may see different bytes in the same file. Wherever the file can be read two ways —
torch's reader and Python's disagreeing on the members or their offsets, names equal but for case,
duplicate names, a local header naming another file, members outside the root, bytes hidden before,
between or after the members, compressed or encrypted members — it is reported here, never guessed.
"""

from __future__ import annotations

import re
import struct
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.checksums import crc32
from ..core import limits as _limits, locations
from .zipdir import LOCAL_SIZE, Directory, Entry, RangeFile, ZipFormatError, data_start, fold, read_directory

_DESCRIPTOR = b"PK\x07\x08"
#: the records torch's reader opens before it unpickles anything (inline_container.cc, torch/serialization.py)
_OPEN_RECORDS = (".data/version", "version", ".format_version", ".storage_alignment", "byteorder",
                 ".data/serialization_id")
#: kMinSupportedFileFormatVersion, kMaxSupportedFileFormatVersion (caffe2/serialize/versions.h)
SUPPORTED_VERSIONS = (1, 10)
_STOULL = re.compile(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_CHUNK = 16 << 20
_LOCAL_EXTRA = 128  # room for a local header's extra field (torch's pads data to 64 bytes) when prefetching


@dataclass(slots=True)  # one per member: 20,000-tensor files hold 20,000
class Member:
    """One central-directory entry (as torch reads it) and where its bytes really are."""

    name: str
    offset: int  # local header
    data_start: int
    compress_type: int
    compress_size: int
    file_size: int
    crc: int | None  # None: its zip records none (torch's CRC-less saves, :func:`~ckptfix.parse.zipdir.unrecorded_crcs`)
    flags: int


@dataclass
class ZipLayout:
    """The archive as torch would read it, plus every way it can be read differently."""

    root: str = ""
    members: list[Member] = field(default_factory=list)
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, where, message)
    errors: list[str] = field(default_factory=list)  # corruption: the file can't be read at all
    unreferenced: list[tuple[int, int]] = field(default_factory=list)  # byte ranges no record accounts for
    #: pickles as Python's zipfile reads them, when it sees another archive than torch: (name, bytes)
    alternate: list[tuple[str, bytes]] = field(default_factory=list)
    #: the line saying its records carry no CRC-32 to check, as torch's CRC-less saves write them (no finding)
    no_crc: str | None = None

    def find(self, kind: str, where: str, message: str) -> None:
        self.findings.append((kind, where, message))

    def unique(self, name: str) -> Member | None:
        """The member called ``name`` when exactly one is (compared as torch compares: case-folded)."""
        key = fold(name.encode("utf-8"))
        found = [m for m in self.members if fold(m.name.encode("utf-8")) == key]
        return found[0] if len(found) == 1 else None


def check_zip(path: str, buf: Any, size: int, torchscript: bool = False, check_crc: bool = True,
              directory: Directory | None = None) -> ZipLayout:
    """Check the structure of the zip in ``buf`` (an mmap of ``path``, ``size`` bytes).

    ``check_crc=False`` verifies the CRC of ``.pkl`` members only (tensor data is integrity, not
    safety, and reading all of it would make every load read the whole file). ``directory``: ``buf``'s
    central directory when the caller has it parsed already (:func:`ckptfix.parse.zipdir.zip_directory`).
    """
    layout = ZipLayout()
    try:
        directory = directory or read_directory(buf, size)
    except (ZipFormatError, struct.error) as e:
        layout.errors.append(f"is a truncated or corrupt zip archive ({e})")
        if _python_view(layout, buf, size):
            layout.find("reader-disagreement", "archive",
                        f"torch's zip reader can't read the archive ({e}) but Python's zipfile reads one: "
                        "readers disagree (a second archive appended, or a forged directory)")
        return layout
    if not directory.entries:
        layout.errors.append("is an empty zip archive")
        return layout
    layout.root = directory.root
    if not layout.root:
        layout.errors.append(f"first member {directory.entries[0].name!r} is not inside a folder (torch can't read it)")
    locations.prefetch(buf, [(e.header_offset, LOCAL_SIZE + len(e.raw_name) + _LOCAL_EXTRA) for e in directory.entries])
    layout.no_crc = directory.crc_note(path)
    for entry in directory.entries:
        member = _local_header(layout, buf, size, entry, directory.crc(entry))
        if member is not None:
            layout.members.append(member)
    _compare_with_zipfile(layout, buf, size, directory)
    _check_names(layout, directory.entries)
    _check_methods(layout, torchscript)
    _check_open_records(layout, buf)
    _check_end(layout, size, directory)
    _check_gaps(layout, buf, directory.cd_offset)
    locations.prefetch(buf, [(m.data_start, m.compress_size) for m in layout.members if is_pickle(m.name)])
    for m in layout.members:
        if m.crc is not None and (check_crc or is_pickle(m.name)) and m.compress_type in (0, 8) and not m.flags & 1:
            crc = 0
            try:
                for chunk in iter_member(m, buf):
                    crc = crc32(chunk, crc)
            except ValueError as e:
                layout.errors.append(f"member {m.name}: {e}")
                continue
            if crc != m.crc:
                layout.find("crc-mismatch", m.name, f"member {m.name}: CRC-32 {crc:08x} does not match "
                            f"the recorded {m.crc:08x} (altered or corrupt)")
    return layout


def is_pickle(name: str) -> bool:
    """A member torch may unpickle: ``*.pkl`` in any case (torch looks names up case-insensitively)."""
    return name.lower().endswith(".pkl")


def iter_member(m: Member, buf: Any, limit: tuple[str, int] | None = None) -> Iterator[bytes]:
    """The member's uncompressed bytes in chunks of at most 16 MiB (stored or deflated); ValueError if
    it can't be read. With ``limit`` (the name of a limit and its value), a member that is (or
    inflates to) more than that raises LimitError before more is produced."""
    end = m.data_start + m.compress_size
    if m.flags & 1:
        raise ValueError("is encrypted")
    if limit is not None and m.compress_type == 0 and m.compress_size > limit[1]:
        raise _limits.exceeded(limit[0], f"member {m.name}'s size", m.compress_size)
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
            data = bytes(buf[pos : min(pos + _CHUNK, end)])
            while data:  # bounded output per call: a few KB of deflate can stand for gigabytes
                out = inflater.decompress(data, _CHUNK)
                data = inflater.unconsumed_tail
                produced += len(out)
                if produced > m.file_size:
                    raise ValueError(f"inflates past its recorded size ({m.file_size} bytes)")
                if limit is not None and produced > limit[1]:
                    raise _limits.exceeded(limit[0], f"compressed member {m.name} inflating", produced)
                if out:
                    yield out
                if not out and not data:
                    break
    except zlib.error as e:
        raise ValueError(f"has corrupt deflate data ({e})") from None


def read_member(m: Member, buf: Any) -> bytes:
    """A member that torch may unpickle, whole, within the limit max_pickle_bytes (a compressed one,
    which torch never writes, within max_alloc_bytes: it is refused anyway, and read only to name
    what it references)."""
    limits = _limits.current()
    if m.compress_type == 0 or limits.max_pickle_bytes < limits.max_alloc_bytes:
        return b"".join(iter_member(m, buf, ("max_pickle_bytes", limits.max_pickle_bytes)))
    return b"".join(iter_member(m, buf, ("max_alloc_bytes", limits.max_alloc_bytes)))


def _check_end(layout: ZipLayout, size: int, directory: Directory) -> None:
    """Bytes after the end record, and a directory that is not where its offsets say."""
    end = directory.eocd_offset + 22 + directory.comment_length
    if end < size:
        layout.find("data-after", "archive", f"{size - end} bytes after the end of the zip archive")
        layout.unreferenced.append((end, size))
    elif end > size:
        layout.find("data-after", "archive", "the end record's comment runs past the end of the file")
    record = directory.zip64_offset if directory.zip64_offset is not None else directory.eocd_offset
    concat = record - directory.cd_size - directory.cd_offset
    if concat:
        layout.find("data-before", "archive",
                    f"the central directory is {concat} bytes from where its offsets say "
                    "(data prepended to the archive, a second archive, or hidden bytes before the end records)")
        if concat > 0:
            layout.unreferenced.append((directory.cd_offset + directory.cd_size, record))
    if directory.zip64_offset is not None and directory.zip64_offset + 56 != directory.eocd_offset - 20:
        layout.find("hidden-data", "archive",
                    "the zip64 end record is not right before its locator: bytes there that no reader accounts "
                    "for, or a second zip64 record")


def _local_header(layout: ZipLayout, buf: Any, size: int, entry: Entry, crc_recorded: int | None) -> Member | None:
    try:
        start, local_name, fields = data_start(buf, size, entry)
    except ZipFormatError as e:
        layout.errors.append(str(e))
        return None
    if fields is None:  # torch maps the data from here anyway (it reads only the lengths)
        layout.find("header-mismatch", entry.name,
                    f"member {entry.name}: no local-header signature at byte {entry.header_offset}: readers "
                    "disagree on whether and where its data is")
        flags, method, crc, csize, usize = entry.flags, entry.method, entry.crc, entry.compress_size, entry.file_size
    else:
        flags, method, crc, csize, usize = fields
    if local_name != entry.raw_name:
        layout.find("name-mismatch", entry.name,
                    f"member {entry.name!r} has the name {local_name.decode('utf-8', 'replace')!r} in its local header")
    if method != entry.method or (flags & 1) != (entry.flags & 1):
        layout.find("header-mismatch", entry.name,
                    f"member {entry.name}: local header and central directory disagree on compression")
    elif not flags & 0x8 and 0xFFFFFFFF not in (csize, usize) and (crc, csize, usize) != (
            entry.crc, entry.compress_size, entry.file_size):
        layout.find("header-mismatch", entry.name,
                    f"member {entry.name}: local header and central directory disagree on its size or CRC")
    if start + entry.compress_size > size:
        layout.errors.append(f"member {entry.name}: data runs past the end of the file (truncated)")
        return None
    return Member(entry.name, entry.header_offset, start, entry.method, entry.compress_size, entry.file_size,
                  crc_recorded, entry.flags)


_ZIPFILE_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError, KeyError)


def _as_file(buf: Any, size: int) -> RangeFile:
    """The buffer (an mmap, a memoryview of one record) as a read-only file for zipfile."""
    return RangeFile(lambda pos, n: bytes(buf[pos : pos + n]), size)


def _python_view(layout: ZipLayout, buf: Any, size: int) -> bool:
    """Read the pickles as Python's zipfile sees them into ``layout.alternate``; False if it can't."""
    limits = _limits.current()
    try:
        with zipfile.ZipFile(_as_file(buf, size)) as z:
            for info in z.infolist():
                if is_pickle(info.filename) and not info.flag_bits & 1 and info.compress_type in (0, 8):
                    limit = limits.max_pickle_bytes if info.compress_type == 0 else min(
                        limits.max_pickle_bytes, limits.max_alloc_bytes)
                    with z.open(info) as f:
                        layout.alternate.append((info.filename, f.read(limit)))
    except (*_ZIPFILE_ERRORS, RuntimeError):
        return False
    return True


def _compare_with_zipfile(layout: ZipLayout, buf: Any, size: int, directory: Directory) -> None:
    """Python's zipfile must see the same members at the same offsets as torch's reader."""
    try:
        with zipfile.ZipFile(_as_file(buf, size)) as z:
            infos = z.infolist()
    except _ZIPFILE_ERRORS as e:
        layout.find("reader-disagreement", "archive",
                    f"torch's zip reader reads the archive but Python's zipfile does not ({e}): readers disagree")
        return
    if len(directory.entries) != len(infos):
        layout.find("reader-disagreement", "archive",
                    f"torch's zip reader sees {len(directory.entries)} members, Python's zipfile {len(infos)} "
                    "(two central directories, or a count that does not match the directory's size)")
        _python_view(layout, buf, size)
        return
    for index, (entry, info) in enumerate(zip(directory.entries, infos)):  # pairs made one at a time: no copy of either list
        a = (entry.raw_name, entry.header_offset, entry.compress_size, entry.file_size, entry.crc, entry.method)
        b = (info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", errors="replace"), info.header_offset,
             info.compress_size, info.file_size, info.CRC, info.compress_type)
        if a != b:
            what = ("name", "offset", "compressed size", "size", "CRC", "compression")
            diff = ", ".join(w for w, x, y in zip(what, a, b) if x != y)
            layout.find("reader-disagreement", entry.name,
                        f"member {index + 1} ({entry.name}) differs between torch's zip reader "
                        f"and Python's zipfile ({diff}): readers disagree on the archive")
            _python_view(layout, buf, size)
            return


def _check_names(layout: ZipLayout, entries: list[Entry]) -> None:
    folded = Counter(fold(e.raw_name) for e in entries)
    for key, n in folded.items():
        if n < 2:
            continue
        names = sorted({e.name for e in entries if fold(e.raw_name) == key})
        if len(names) == 1:
            layout.find("duplicate-member", names[0],
                        f"{n} members are named {names[0]}: readers disagree on which one they read")
        else:
            layout.find("duplicate-member", names[0],
                        f"members {', '.join(names)} differ only in case: torch looks names up case-insensitively, "
                        "so readers disagree on which one is read")
    root = fold(layout.root.encode("utf-8") + b"/")
    for e in entries:
        if b"\x00" in e.raw_name or b"\\" in e.raw_name:
            layout.find("odd-name", e.name, f"member name {e.name!r} holds a NUL byte or backslash")
        if layout.root and not fold(e.raw_name).startswith(root):
            layout.find("outside-root", e.name,
                        f"member {e.name} is outside the archive's root folder {layout.root}/ (torch never reads it)")
        elif layout.root and not e.raw_name.startswith(layout.root.encode("utf-8") + b"/"):
            layout.find("outside-root", e.name,
                        f"member {e.name} is in the root folder {layout.root}/ only when case is ignored "
                        "(torch reads it, other readers don't)")


def _check_open_records(layout: ZipLayout, buf: Any) -> None:
    """Damage torch refuses the archive for: an encrypted record it opens, a version it can't read."""
    opened = {f"{layout.root}/{name}": layout.unique(f"{layout.root}/{name}") for name in _OPEN_RECORDS}
    for record in opened.values():
        if record is not None and record.flags & 1:
            layout.errors.append(f"record {record.name} is encrypted: torch can't open the archive")
    version = opened[f"{layout.root}/.data/version"] or opened[f"{layout.root}/version"]
    if version is None:  # torch's reader: TORCH_CHECK(hasRecord("version")) when there is no .data/version
        layout.errors.append(f"it has no format version record ({layout.root}/version or {layout.root}/.data/version), "
                             "which torch needs to open it: the file is damaged or was not written by torch.save")
        return
    if version.flags & 1:
        return
    try:
        head = next(iter_member(version, buf), b"")[:64]
    except ValueError as e:
        layout.errors.append(f"record {version.name} {e}")
        return
    number = _STOULL.match(head)  # std::stoull, as torch reads it; a minus sign makes any number out of range
    low, high = SUPPORTED_VERSIONS
    if number is None or number.group(1) == b"-" or not low <= int(number.group(2)) <= high:
        layout.errors.append(f"its format version record {version.name} holds {head[:20]!r}, not a version torch "
                             f"reads ({low} to {high}): the file is damaged or was written by a newer torch")


def _check_methods(layout: ZipLayout, torchscript: bool) -> None:
    code = f"{layout.root}/code/"
    opened = {f"{layout.root}/{name}" for name in _OPEN_RECORDS}
    for m in layout.members:
        if m.flags & 1 and m.name in opened:
            continue  # torch can't open the archive at all: damage (_check_open_records)
        if m.flags & 1:
            layout.find("encrypted", m.name, f"member {m.name} is encrypted: it can't be analysed")
        elif m.compress_type != 0 and not (torchscript and m.name.startswith(code)):
            layout.find("compressed", m.name,
                        f"member {m.name} is compressed (method {m.compress_type}); torch writes every "
                        "member stored")


def _check_gaps(layout: ZipLayout, buf: Any, cd_start: int) -> None:
    """Members, then the central directory, must tile the file with nothing hidden between them."""
    ordered = sorted(layout.members, key=lambda m: m.offset)
    if ordered and ordered[0].offset > 0:
        layout.find("data-before", "archive", f"{ordered[0].offset} bytes before the first member")
        layout.unreferenced.append((0, ordered[0].offset))
    for m, nxt in zip(ordered, [*ordered[1:], None]):
        data_end = m.data_start + m.compress_size
        extra: tuple[int, ...]
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
