"""A minimal zip writer for torch checkpoints: stored members, 64-byte aligned data, zip64.

Member data either comes from bytes or is copied from another file's byte range in the kernel
(``bytecopy.copy_range``), so tensor bytes never enter Python memory; from a remote file's range, it is
written when the write's queued copies run (the CRC-32s those give are patched into the local headers at
:meth:`ZipWriter.close`). torch's reader needs stored
(uncompressed) members whose data it can mmap; the alignment padding goes in an extra field, as
torch's own writer does.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from ...core.checksums import crc32
from ...core import bytecopy, outputs
from ...parse.zipdir import read_directory

ALIGN = 64
_U32 = 0xFFFFFFFF
_PAD_ID = 0x4246  # "FB": the padding extra-field id torch's writer uses
_DOS_DATE = (0, 0)  # torch writes 1980-00-00 00:00 as well


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int
    flags: int = 0  # (torch.save's records have data descriptors: bit 3, kept when the directory is rewritten)


class ZipWriter:
    """Write members one after another into an open binary file, then the central directory."""

    def __init__(self, f: BinaryIO, out: outputs.Output | None = None):
        self.f, self.out = f, out
        self.entries: list[_Entry] = []
        self.pending: list[tuple[_Entry, Callable[[], int]]] = []  # CRC-32s known once the copies are done
        self.pos = f.tell()
        self.queued = False  # a remote copy is queued: its bytes land when the write's copies run

    def _final(self) -> None:
        """Tell the output that the bytes so far are final (it may hash them behind the copies), unless a local
        header before them waits for its CRC-32 or a queued copy hasn't landed."""
        if self.out is not None and not self.pending and not self.queued:
            self.f.flush()
            self.out.final(self.pos)

    def _local_header(self, name: bytes, size: int, crc: int) -> bytes:
        zip64 = size >= _U32 or self.pos >= _U32
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        fixed = 30 + len(name) + len(extra)
        pad = (-(self.pos + fixed + 4)) % ALIGN
        extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
        n = _U32 if zip64 else size
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, *_DOS_DATE, crc, n, n,
                           len(name), len(extra))
        return head + name + extra

    def _start(self, name: str, size: int, crc: int) -> None:
        raw = name.encode("utf-8")
        header = self._local_header(raw, size, crc)
        self.entries.append(_Entry(raw, self.pos, size, crc))
        self.f.write(header)
        self.pos += len(header)

    def add_bytes(self, name: str, data: bytes) -> None:
        self._start(name, len(data), crc32(data))
        self.f.write(data)
        self.pos += len(data)
        self._final()

    def add_tensor_data(self, name: str, data: memoryview) -> None:
        """A member of tensor bytes computed in memory (a dtype cast), written with the progress line
        counting it as it does copied tensors."""
        self._start(name, len(data), crc32(data))
        self._final()
        self.f.flush()
        bytecopy.write_all(self.f.fileno(), data, self.pos)
        self.pos += len(data)
        self.f.seek(self.pos)

    def add_copy(self, name: str, src_fd: bytecopy.Source, src_offset: int, size: int,
                 crc: int | Callable[[], int]) -> None:
        """A member whose bytes are ``size`` bytes of ``src_fd`` at ``src_offset``.

        ``crc`` is the CRC-32 if known, or a function giving it once the copy is done (computed
        meanwhile on another thread, or from a remote copy's bytes); the local header is patched in place
        at :meth:`close`.
        """
        self.add_segments(name, [(src_fd, src_offset, size)], crc)

    def add_segments(self, name: str, segments: list[tuple[bytecopy.Source, int, int]],
                     crc: int | Callable[[], int]) -> None:
        """A member whose bytes are the file ranges ``[(src_fd, src_offset, size), …]`` one after
        another (a tensor sharded in chunks); ``crc`` as for :meth:`add_copy`, over them all."""
        size = sum(n for _fd, _offset, n in segments)
        self._start(name, size, crc if isinstance(crc, int) else 0)
        entry = self.entries[-1]
        self.queued |= any(isinstance(src, bytecopy.RemoteFile) for src, _o, _n in segments)
        if isinstance(crc, int):
            self._final()
        self.f.flush()
        if len(segments) == 1:
            bytecopy.copy_range(segments[0][0], self.f.fileno(), segments[0][1], self.pos, size)
        else:
            bytecopy.copy_segments(segments, self.f.fileno(), self.pos)
        self.pos += size
        if not isinstance(crc, int):
            self.pending.append((entry, crc))
        self.f.seek(self.pos)

    def crcs(self) -> dict[str, int]:
        """Every record's CRC-32 by name, those computed while copying put into their local headers first."""
        for entry, crc in self.pending:
            entry.crc = crc()
            self.f.seek(entry.offset + 14)
            self.f.write(struct.pack("<I", entry.crc))
        self.pending.clear()
        self.f.seek(self.pos)
        return {e.name.decode("utf-8"): e.crc for e in self.entries}

    def serialization_id(self) -> bytes:
        """``.data/serialization_id`` for the records so far, shaped as torch's (40 digits: torch hashes the record
        names and combines their CRC-32s) and as deterministic: two writes of one state dict are one file."""
        names = "\n".join(f"{name}:{crc:08x}:{e.size}" for (name, crc), e in zip(self.crcs().items(), self.entries))
        digest = hashlib.sha256(names.encode("utf-8")).digest()
        return b"%020d%020d" % (int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:16], "little"))

    def close(self) -> None:
        self.crcs()
        cd_start = self.pos
        for e in self.entries:
            zip64 = e.size >= _U32 or e.offset >= _U32
            extra = b""
            if zip64:
                extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.offset)
            size = _U32 if zip64 else e.size
            off = _U32 if zip64 else e.offset
            rec = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, e.flags, 0, *_DOS_DATE,
                              e.crc, size, size, len(e.name), len(extra), 0, 0, 0, 0, off)
            self.f.write(rec + e.name + extra)
            self.pos += len(rec) + len(e.name) + len(extra)
        cd_size = self.pos - cd_start
        n = len(self.entries)
        if n >= 0xFFFF or cd_start >= _U32 or cd_size >= _U32:
            eocd64 = self.pos
            self.f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size, cd_start))
            self.f.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self.f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0))
        else:
            self.f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))
        self.f.flush()


def append(path: str, records: Callable[[dict[str, int]], list[tuple[str, bytes]]]) -> None:
    """Add the stored records ``records({name: CRC-32})`` gives to the finished zip ``path``, where its central
    directory was, then write the directory again with every earlier entry: ckptfix's digests and lineage, added
    to a file ``torch.save`` wrote (torch's reader skips records it isn't asked for)."""
    with open(path, "r+b") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            directory = read_directory(buf, len(buf))
        f.seek(directory.cd_offset)
        f.truncate()
        z = ZipWriter(f)
        z.entries = [_Entry(e.raw_name, e.header_offset, e.file_size, e.crc, e.flags) for e in directory.entries]
        for name, data in records(z.crcs()):
            z.add_bytes(name, data)
        z.close()
