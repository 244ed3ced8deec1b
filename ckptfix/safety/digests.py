"""Per-tensor digests and lineage: the convention every ckptfix output carries (docs/digests.md), read and checked.

A digest is the CRC-32 (the zip polynomial, :func:`ckptfix.core.checksums.crc32`) of a tensor's bytes as stored:
corruption detection at copy speed, not tamper-evidence (a signature's job). safetensors: ``__metadata__``'s
``ckptfix.digests`` = ``{"algorithm": "crc32", "tensors": {name: "8 hex digits"}}`` over each tensor's
``data_offsets`` range. torch zip: the record ``<archive>/.ckptfix/digests.json`` = ``{"algorithm": "crc32",
"storages": {key: "8 hex digits"}, "tensors": {name: key}}`` over each ``data/KEY`` record (a tensor is a view of
its storage). Lineage (``ckptfix.lineage``, ``.ckptfix/lineage.json``): the ckptfix version, the transform and the
source's identity, set for a write by :func:`recording`. A DCP directory: both in the sidecar ``ckptfix.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..core import locations
from ..core.positional import crc32_range
from ..core.checksums import Tally, crc32
from ..errors import FormatError
from ..parse import checkpoint_dirs
from ..parse.format_registry import get as format_of
from ..parse.safetensors_header import json_object, read_header
from ..parse.zipdir import ZipFormatError, data_start, zip_directory

ALGORITHM = "crc32"
DIGESTS_KEY = "ckptfix.digests"  #: safetensors ``__metadata__`` keys
LINEAGE_KEY = "ckptfix.lineage"
DIGESTS_RECORD = ".ckptfix/digests.json"  #: torch zip records, under the archive's folder
LINEAGE_RECORD = ".ckptfix/lineage.json"
SIDECAR = "ckptfix.json"  #: a DCP directory's, whose files hold no place for either
_WORKERS = 4

_lineage: ContextVar[str | None] = ContextVar("ckptfix_lineage", default=None)


def compact(obj: Any) -> str:
    """JSON without spaces, keys in the order given: the same object is always the same bytes."""
    return json.dumps(obj, separators=(",", ":"))


def hex8(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def tensors_entry(crcs: dict[str, int]) -> str:
    """safetensors' ``ckptfix.digests`` value for ``{tensor name: CRC-32}``."""
    return compact({"algorithm": ALGORITHM, "tensors": {k: hex8(v) for k, v in crcs.items()}})


def storages_entry(crcs: dict[str, int], tensors: dict[str, str]) -> bytes:
    """A torch zip's ``.ckptfix/digests.json``: ``{storage key: CRC-32}`` and ``{tensor name: storage key}``."""
    return compact({"algorithm": ALGORITHM, "storages": {k: hex8(v) for k, v in crcs.items()},
                    "tensors": tensors}).encode("utf-8")


def sidecar_entry(items: list[tuple[str, str, int, int, int]], lineage: str | None) -> bytes:
    """A DCP directory's ``ckptfix.json``: ``{"digests": {"algorithm", "items": [[name, file, offset, length,
    CRC-32], …]}, "lineage": …}``, one item per storage item of its metadata (a tensor's chunk: ``fqn@offsets``)."""
    entry = {"algorithm": ALGORITHM, "items": [[n, f, o, k, hex8(c)] for n, f, o, k, c in items]}
    return (compact({"digests": entry, **({"lineage": json.loads(lineage)} if lineage is not None else {})})
            + "\n").encode("utf-8")


@contextmanager
def recording(lineage: dict[str, Any]) -> Iterator[None]:
    """Every output written inside records ``lineage`` (ckptfix version, transform, source identity)."""
    token = _lineage.set(compact(lineage))
    try:
        yield
    finally:
        _lineage.reset(token)


def lineage() -> str | None:
    """The lineage the current write records (compact JSON), or None outside :func:`recording`."""
    return _lineage.get()


# -- reading --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Digest:
    """One digested byte range: the tensors it holds, where it is, its recorded CRC-32."""

    names: tuple[str, ...]
    path: str
    offset: int
    size: int
    crc: int


@dataclass
class FileDigests:
    """What a file records: its digests (None: none) and lineage (None: none)."""

    digests: list[Digest] | None
    lineage: dict[str, Any] | None


def _crc(path: str, value: Any, where: str) -> int:
    if not isinstance(value, str) or len(value) != 8 or any(c not in "0123456789abcdef" for c in value):
        raise FormatError(f"{path}: {where} is not 8 lowercase hex digits")
    return int(value, 16)


def _algorithm(path: str, entry: dict, what: str) -> None:
    if entry.get("algorithm") != ALGORITHM:
        raise FormatError(f"{path}: its {what} use {str(entry.get('algorithm'))[:40]!r}, which this ckptfix "
                          f"doesn't know (it checks {ALGORITHM})")


def _safetensors(path: str) -> FileDigests:
    start, header, meta = read_header(path)
    entry = json_object(path, f"its {DIGESTS_KEY!r} metadata", meta.get(DIGESTS_KEY))
    digests = None
    if entry is not None:
        _algorithm(path, entry, f"{DIGESTS_KEY!r} metadata")
        tensors = entry.get("tensors")
        if not isinstance(tensors, dict) or set(tensors) != set(header):
            raise FormatError(f"{path}: its {DIGESTS_KEY!r} metadata doesn't name every stored tensor")
        digests = [Digest((k,), path, start + header[k]["data_offsets"][0],
                          header[k]["data_offsets"][1] - header[k]["data_offsets"][0], _crc(path, v, f"the digest of {k!r}"))
                   for k, v in tensors.items()]
    return FileDigests(digests, json_object(path, f"its {LINEAGE_KEY!r} metadata", meta.get(LINEAGE_KEY)))


def _torch_zip(path: str) -> FileDigests:
    try:
        directory = zip_directory(path)
    except ZipFormatError:
        return FileDigests(None, None)
    root = directory.root
    entries = {e.name: e for e in directory.entries}
    with locations.open_buffer(path) as buf:
        def record(name: str) -> bytes | None:
            e = entries.get(f"{root}/{name}")
            if e is None or e.method != 0:
                return None
            start = data_start(buf, len(buf), e)[0]
            return bytes(buf[start : start + e.file_size])

        entry = json_object(path, f"its {DIGESTS_RECORD}", record(DIGESTS_RECORD))
        found = FileDigests(None, json_object(path, f"its {LINEAGE_RECORD}", record(LINEAGE_RECORD)))
        if entry is None:
            return found
        _algorithm(path, entry, DIGESTS_RECORD)
        storages, tensors = entry.get("storages"), entry.get("tensors")
        if not isinstance(storages, dict) or not isinstance(tensors, dict):
            raise FormatError(f"{path}: its {DIGESTS_RECORD} has no storages and tensors objects")
        names: dict[str, list[str]] = {}
        for name, key in tensors.items():
            names.setdefault(str(key), []).append(name)
        found.digests = []
        for key, value in storages.items():
            e = entries.get(f"{root}/data/{key}")
            if e is None or e.method != 0:
                raise FormatError(f"{path}: its {DIGESTS_RECORD} names storage {key!r}, which has no record")
            found.digests.append(Digest(tuple(names.get(key, [f"data/{key}"])), path,
                                        data_start(buf, len(buf), e)[0], e.file_size,
                                        _crc(path, value, f"the digest of storage {key!r}")))
    return found


def _dcp(path: str) -> FileDigests:
    sidecar = os.path.join(path, SIDECAR)
    if not os.path.isfile(sidecar):
        return FileDigests(None, None)
    with open(sidecar, "rb") as f:
        whole = json_object(path, f"its {SIDECAR}", f.read()) or {}  # (raw bytes: never None)
    entry, lineage = whole.get("digests"), whole.get("lineage")
    if not isinstance(entry, dict) or not isinstance(entry.get("items"), list):
        raise FormatError(f"{path}: its {SIDECAR} has no digests object with items")
    _algorithm(path, entry, SIDECAR)
    found = []
    for item in entry["items"]:
        if not (isinstance(item, list) and len(item) == 5 and type(item[0]) is str and type(item[2]) is int
                and type(item[3]) is int and item[2] >= 0 and item[3] >= 0):
            raise FormatError(f"{path}: its {SIDECAR} holds a malformed item: {str(item)[:80]}")
        member = checkpoint_dirs.member_path(path, item[1], sidecar, "file")
        found.append(Digest((item[0],), member, item[2], item[3], _crc(path, item[4], f"the digest of {item[0]!r}")))
    return FileDigests(found, lineage if isinstance(lineage, dict) else None)


def read(path: str, fmt: str) -> FileDigests:
    """The digests and lineage ``path`` (a safetensors file or torch zip, or a sharded directory of them: every
    shard's) records; FormatError where they are malformed."""
    spec = format_of(fmt)
    if spec.index_name is not None:
        index = checkpoint_dirs.find_index(path)
        if index is None:
            return FileDigests(None, None)
        root = os.path.dirname(os.path.abspath(index)) if not locations.is_remote(index) else index.rsplit("/", 1)[0]
        shards = [read(checkpoint_dirs.member_path(root, s, index), str(spec.shard_format))
                  for s in dict.fromkeys(checkpoint_dirs.load_index(index).values())]
        every = [d for s in shards if s.digests is not None for d in s.digests]
        return FileDigests(every if shards and all(s.digests is not None for s in shards) else None,
                        shards[0].lineage if shards else None)
    if fmt == "safetensors":
        return _safetensors(path)
    if fmt == "dcp" and not locations.is_remote(path):
        return _dcp(path)
    if spec.zip and fmt == "torch-zip":
        return _torch_zip(path)
    return FileDigests(None, None)


# -- checking ----------------------------------------------------------------------------------------------

def mismatches(digests: list[Digest]) -> list[tuple[Digest, int]]:
    """The digests whose bytes don't match, with the CRC-32 found: every range read once, by a few threads
    (the CRC releases the GIL), largest first."""
    fds: dict[str, int] = {}
    try:
        for d in digests:
            if d.path not in fds:
                fds[d.path] = os.open(d.path, os.O_RDONLY)

        def crc(d: Digest) -> int:
            try:
                return crc32_range(fds[d.path], d.offset, d.size)
            except OSError:
                return -1  # the file ends before the range: it was truncated

        order = sorted(digests, key=lambda d: -d.size)
        with ThreadPoolExecutor(min(_WORKERS, os.cpu_count() or 1)) as pool:
            found = dict(zip(order, pool.map(crc, order)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return [(d, found[d]) for d in digests if found[d] != d.crc]


def failures(path: str, fmt: str, fetched: Tally | None = None) -> list[str]:
    """One line per digested tensor (or storage) whose bytes don't match its recorded digest, naming it. A URL's:
    on the CRC-32s of the ranges ``fetched`` (else the session's) holds, the others fetched here."""
    recorded = read(path, fmt)
    if recorded.digests is None:
        return []
    if locations.is_remote(path):  # the ranges verify fetched already, else fetched here (each digest's once)
        return tallied(recorded.digests, fetched if fetched is not None else locations.fetched())
    return mismatched(recorded.digests)


def mismatched(digests: list[Digest]) -> list[str]:
    """:func:`failures` of the digests read already."""
    return [_line(d, found) for d, found in mismatches(digests)]


def _line(d: Digest, found: int) -> str:
    names = ", ".join(map(repr, d.names[:5])) + (f" (+{len(d.names) - 5} more)" if len(d.names) > 5 else "")
    got = "the file ends first" if found < 0 else f"its bytes give {hex8(found)}"
    return (f"integrity: {d.path}: tensor {names} does not match its recorded digest ({ALGORITHM} {hex8(d.crc)}, "
            f"{got}): the file was damaged or altered after it was written; copy or download it again")


def check(path: str, fmt: str) -> None:
    """Raise FormatError naming each tensor whose bytes don't match its recorded digest (a file that records
    digests; nothing to check otherwise). A URL's: on the ranges the session fetched, else fetched here."""
    refuse(failures(path, fmt))


def tallied(digests: list[Digest], tally: Tally) -> list[str]:
    """:func:`failures`, each digest's CRC-32 joined from the chunks a load's value check took or a URL's fetches
    (``tally``); only the bytes it holds none of (a cast, a strided view, a tensor left out) read here."""
    named = {_same(n): n for n in tally.chunks}  # (the load's spelling of each file path)
    fds: dict[str, int] = {}
    lines = []
    try:
        for d in digests:
            if not locations.is_remote(d.path) and d.path not in fds:
                fds[d.path] = os.open(d.path, os.O_RDONLY)
            try:
                found = tally.crc(named.get(_same(d.path), d.path), d.offset, d.size, _reader(d.path, fds.get(d.path)))
            except (OSError, FormatError):
                found = -1  # the file ends before the range: it was truncated
            if found != d.crc:
                lines.append(_line(d, found))
    finally:
        for fd in fds.values():
            os.close(fd)
    return lines


def _same(path: str) -> str:
    """One spelling of a local file's path (a URL's as it is)."""
    return path if locations.is_remote(path) else os.path.realpath(path)


def _reader(path: str, fd: int | None) -> Callable[[int, int], int]:
    """CRC-32 of a range of ``path``: read from ``fd``, or a URL's fetched by a Range request."""
    if fd is not None:
        return lambda offset, size: crc32_range(fd, offset, size)

    def fetched(offset: int, size: int) -> int:
        with locations.opened(path) as source:
            data = source.read(offset, size)
        if len(data) < size:
            raise FormatError(f"{path}: ends before byte {offset + size}")
        return crc32(data)
    return fetched


def refuse(lines: list[str]) -> None:
    """FormatError naming the tensors of ``lines`` (:func:`failures`): nothing was loaded; nothing for none."""
    if lines:
        raise FormatError("; ".join(lines[:5]) + (f"; … (+{len(lines) - 5} more)" if len(lines) > 5 else "")
                          + "; nothing was loaded")


def provenance(path: str, fmt: str) -> dict[str, Any]:
    """What ``inspect`` shows: ``{"digests": {"algorithm", "tensors"}, "lineage": {...}}``, each only when recorded."""
    try:
        recorded = read(path, fmt)
    except FormatError as e:
        return {"digests": {"error": str(e)}}
    out: dict[str, Any] = {}
    if recorded.digests is not None:
        out["digests"] = {"algorithm": ALGORITHM, "tensors": sum(len(d.names) for d in recorded.digests)}
    if recorded.lineage is not None:
        out["lineage"] = recorded.lineage
    return out
