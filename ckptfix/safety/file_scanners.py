"""The scan of one checkpoint file: its report, and the scanners of the zip, legacy and tar formats.

A :class:`Collector` gathers what the pickle walks (:mod:`ckptfix.parse.pickle_walk`) and the structure
checks find; ``finish()`` turns it into the :class:`ScanReport` that ``ckptfix scan`` prints, or a
FormatError when the file is only damaged. Nothing here imports or runs anything from the file.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core import limits as _limits
from ..core.units import shown
from ..parse import pickle_walk, zipcheck
from .allowlist import ALLOWED, INERT, REBUILD_NESTED_TENSOR, UNSAFE, classify
from .static_checks import refused_build, refused_call, storage_itemsize
from ..errors import FormatError, LimitError
from ..parse.legacy_tar import BoundedReader
from ..parse.recognise import LEGACY_MAGIC

PICKLE = "pickle"  # a plain pickle file: not a checkpoint, but scan reads it
_LEGACY_PICKLES = ("pickle 1 (magic number)", "pickle 2 (protocol version)", "pickle 3 (system info)",
                   "pickle 4 (the checkpoint)", "pickle 5 (storage keys)")
_LEGACY_PROTOCOL_VERSION = 1001


@dataclass
class GlobalRef:
    """A global the file references, how (``GLOBAL``, ``REDUCE``, …) and its class."""

    name: str
    category: str  # safe (torch's own) | allowed (ckptfix's allow-list) | unsafe
    where: str
    ops: list[str] = field(default_factory=list)


@dataclass
class Finding:
    """One reason the file is not safe to load: an unsafe global or a structural problem."""

    kind: str
    where: str
    message: str


@dataclass
class ScanReport:
    """What ``scan`` found; ``ok`` when nothing is unsafe."""

    path: str
    format: str
    globals: list[GlobalRef] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    pickles: list[str] = field(default_factory=list)  # every pickle walked, by where it sits
    main_pickle: str | None = None  # the pickle that holds the checkpoint (zip data.pkl, legacy pickle 4)
    bytes_fetched: int | None = None  # a remote file: the bytes the scan fetched (None: a local one)
    #: a line per zip whose records carry no CRC-32 (torch's CRC-less saves): no finding, their bytes unchecked
    no_crc: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def extractable(self) -> bool:
        """Unsafe only through globals outside the allow-list in the checkpoint's own pickle: ckptfix still
        reads it, those globals as inert placeholders (never imported), refused only inside the state dict."""
        return bool(self.findings) and all(f.kind == "unsafe-global" and f.where == self.main_pickle
                                           for f in self.findings) and not any(
            "EXT" in g.ops for g in self.globals)  # a copyreg extension is the loading process's, never a name

    @property
    def inert_globals(self) -> list[str]:
        """The classes read as inert data (OmegaConf's configs): never imported, not a finding."""
        return sorted({g.name for g in self.globals if g.category == INERT})

    @property
    def unsafe_globals(self) -> list[str]:
        return sorted({g.name for g in self.globals if g.category == UNSAFE})

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "unsafe_globals": self.unsafe_globals,
            "globals": [{"name": g.name, "class": g.category, "where": g.where, "ops": g.ops} for g in self.globals],
            "findings": [asdict(f) for f in self.findings],
            "pickles": self.pickles,
            "extractable": self.extractable,
            "inert_globals": self.inert_globals,
            **({"bytes_fetched": self.bytes_fetched} if self.bytes_fetched is not None else {}),
        }


class Collector:
    def __init__(self, path: str, fmt: str):
        self.path, self.fmt = path, fmt
        self.globals: dict[tuple[str, str], GlobalRef] = {}
        self.findings: list[Finding] = []
        self.errors: list[tuple[str, str, bool]] = []  # (where, message, a pickle broke): damage, not danger
        self.pickles: list[str] = []
        self.main_pickle: str | None = None
        self.no_crc: list[str] = []  # (ScanReport.no_crc)

    def find(self, kind: str, where: str, message: str) -> None:
        self.findings.append(Finding(kind, where, message))

    def add_walk(self, w: pickle_walk.Walk, also: frozenset[str] = frozenset()) -> None:
        """Record a walked pickle; ``also``: names allowed in this pickle only (created with NEWOBJ and
        given state with BUILD), such as DCP's metadata classes in its ``.metadata``."""
        self.pickles.append(w.where)
        # Allowed globals that take only certain arguments (getattr, numpy's _reconstruct) are unsafe
        # in a pickle that calls them with others.
        misused: dict[str, str] = {}
        for call in w.calls:
            name = call.func.full
            if name in also or classify(call.func.module, call.func.name) == UNSAFE:
                continue  # (a global outside the allow-list is a finding by itself, whatever is done with it)
            reason = refused_call(name, call.args, call.op)
            if reason is None and call.built:
                reason = refused_build(name, call.state)
            if reason is not None:
                misused.setdefault(name, reason)
        for use in w.uses:
            g = self.globals.get((use.full, w.where))
            if g is None:
                category = UNSAFE if use.full in misused else ALLOWED if use.full in also else classify(
                    use.module, use.name)
                g = self.globals[(use.full, w.where)] = GlobalRef(use.full, category, w.where)
            if use.op not in g.ops:
                g.ops.append(use.op)
        for problem in [*w.problems, *misused.values()]:
            self.find("unsafe-construct", w.where, f"{w.where}: {problem}")
        if w.error:
            self.errors.append((w.where, f"{w.where} is truncated or corrupt ({w.error})", True))

    def damage(self, where: str, message: str) -> None:
        self.errors.append((where, message, False))

    def merge_report(self, label: str, part: ScanReport) -> None:
        """Take a scanned part (a shard, Lightning's meta.pt) of this checkpoint, named ``label``."""
        for g in part.globals:
            self.globals[(g.name, f"{label}: {g.where}")] = GlobalRef(g.name, g.category, f"{label}: {g.where}", g.ops)
        self.findings += [Finding(f.kind, f"{label}: {f.where}", f"{label}: {f.message}") for f in part.findings
                          if f.kind != "unsafe-global"]  # finish() lists those again from the globals
        self.pickles += [f"{label}: {w}" for w in part.pickles]
        self.no_crc += part.no_crc

    def merge(self, other: Collector) -> None:
        """Take another collector's results (a part of this checkpoint), named by its path."""
        for (name, where), g in other.globals.items():
            label = f"{other.path}: {where}"
            self.globals[(name, label)] = GlobalRef(g.name, g.category, label, g.ops)
        self.findings += [Finding(f.kind, f"{other.path}: {f.where}", f"{other.path}: {f.message}") for f in other.findings]
        self.errors += [(f"{other.path}: {w}", f"{other.path}: {m}", b) for w, m, b in other.errors]
        self.pickles += [f"{other.path}: {p}" for p in other.pickles]
        self.no_crc += other.no_crc

    def finish(self) -> ScanReport:
        unsafe = [Finding("unsafe-global", g.where, f"unsafe global {shown(g.name)} ({', '.join(g.ops)}) in {shown(g.where)}")
                  for g in self.globals.values() if g.category == UNSAFE]
        findings = unsafe + self.findings
        if findings:
            # A pickle that breaks after a payload still runs the payload: report both.
            findings += [Finding("malformed", where, msg + ("; an unpickler runs everything before the break"
                                                            if broke else "")) for where, msg, broke in self.errors]
        elif self.errors:
            more = f" (and {len(self.errors) - 1} more problems)" if len(self.errors) > 1 else ""
            raise FormatError(f"{self.path}: {self.errors[0][1]}{more}")
        return ScanReport(self.path, self.fmt, list(self.globals.values()), findings, self.pickles, self.main_pickle,
                          no_crc=self.no_crc)


def scan_zip(c: Collector, buf: Any, size: int, torchscript: bool, check_crc: bool,
              unpickled_by_caller: str | None = None, also: frozenset[str] = frozenset(), directory: Any = None,
              every_pickle: bool = False) -> None:
    """A zip's structure and pickles (``*.pkl``; ``every_pickle``: any member that starts as a pickle does)."""
    layout = zipcheck.check_zip(c.path, buf, size, torchscript=torchscript, check_crc=check_crc, directory=directory)
    for kind, where, message in layout.findings:
        c.find(kind, where, message)
    for error in layout.errors:
        c.damage("archive", error)
    if layout.no_crc:
        c.no_crc.append(layout.no_crc)
    for name, data in layout.alternate:  # what another reader would unpickle: say what it would run
        for w in pickle_walk.walk_stack(data, 0, len(data), f"{name} (as Python's zipfile reads it)"):
            c.add_walk(w)
    for start, end in layout.unreferenced:  # hidden bytes that hold a pickle: say what it would run
        if buf[start] == 0x80:
            hidden = bytes(buf[start : min(end, start + _limits.current().max_pickle_bytes)])
            for w in pickle_walk.walk_stack(hidden, 0, len(hidden), f"unreferenced bytes at {start}"):
                c.add_walk(w)
    names = [m.name for m in layout.members]
    for i, m in enumerate(layout.members):
        unnamed = not zipcheck.is_pickle(m.name)
        if unnamed and not every_pickle or m.flags & 1 or m.compress_type not in (0, 8):
            continue  # encrypted / unknown compression: already a finding
        if unpickled_by_caller and m.name == f"{layout.root}/{unpickled_by_caller}" and layout.unique(m.name) is m:
            continue  # the caller unpickles it with ckptfix's restricted unpickler and checks its end
        where = m.name if names.count(m.name) == 1 else f"{m.name} (entry {i + 1})"
        if where == f"{layout.root}/data.pkl":
            c.main_pickle = where
        try:
            data = zipcheck.read_member(m, buf)
        except LimitError as e:
            c.find("resource-limit", where, f"member {where}: {e}")
            continue
        except ValueError as e:
            c.damage(where, f"member {where} {e}")
            continue
        if unnamed and data[:1] != b"\x80":
            continue
        walks = pickle_walk.walk_stack(data, 0, len(data), where)
        for w in walks:
            c.add_walk(w, also)
        first_end = walks[0].end if walks else 0
        if first_end is not None and first_end < len(data):
            c.find("trailing-data", where, f"{len(data) - first_end} bytes follow the pickle in {where} "
                   "(torch ignores them; a second pickle can hide there)")
    code = [n for n in names if n.startswith(f"{layout.root}/code/") and n.endswith(".py")]
    if torchscript:
        c.find("torchscript-code", "archive",
               f"a TorchScript archive: loading it runs the code in {len(code)} file(s) under {layout.root}/code/ "
               "(`ckptfix inspect` lists its tensors without running it)")


def starts_with_magic(buf: Any) -> bool:
    w = pickle_walk.walk(bytes(buf[:64]), 0, "magic")
    return w.end is not None and w.value == LEGACY_MAGIC


def scan_legacy(c: Collector, buf: Any, size: int) -> None:
    """A legacy file is five stacked pickles, every one unpickled by torch, then raw storages."""
    pos, walks = 0, []
    c.main_pickle = _LEGACY_PICKLES[3]
    for label in _LEGACY_PICKLES:
        w = pickle_walk.walk(buf, pos, label)
        c.add_walk(w)
        walks.append(w)
        if w.end is None:
            return
        pos = w.end
    if walks[0].value != LEGACY_MAGIC or walks[1].value != _LEGACY_PROTOCOL_VERSION:
        c.damage(walks[1].where, f"is not a torch legacy file (magic {walks[0].value!r}, protocol {walks[1].value!r})")
        return
    if any(call.func.full == REBUILD_NESTED_TENSOR for call in walks[3].calls):
        c.find("uninitialised", walks[3].where, "a nested tensor in a legacy (non-zip) file: torch builds it from its "
               "sizes before it reads their bytes (uninitialised memory; torch.load fails on it too)")
    try:
        end = _storages_end(c, walks[3].persistent_ids, walks[4].value, buf, pos, size)
    except _Truncated as e:
        c.damage("storage data", f"is truncated: {e}")
        return
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        c.damage("storage data", f"its storage data does not match the pickle's storages ({e})")
        return
    if end < size:
        c.find("data-after", "file", f"{size - end} bytes after the end of the checkpoint's storage data")
        if buf[end] == 0x80:
            for w in pickle_walk.walk_stack(buf, end, size, f"data after the checkpoint (byte {end})"):
                c.add_walk(w)


def _storages_end(c: Collector, pids: list[Any], keys: Any, buf: Any, pos: int, size: int) -> int:
    """Check the raw storages (int64 element count, then the bytes) in pickle 5's key order against the
    storages pickle 4 declares, and return where they end. A declared storage that no record fills
    would load as uninitialised memory: that is a finding, not just damage."""
    declared: dict[str, tuple[int, int]] = {}  # root key -> (element size, elements)
    for pid in pids:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] in ("storage", b"storage")):
            raise ValueError(f"persistent id {pid!r:.60} is not a storage")
        itemsize = storage_itemsize(getattr(pid[1], "name", ""))
        if itemsize is None or type(pid[4]) is not int or pid[4] < 0:
            raise ValueError(f"storage {pid[2]!r:.40} has an unknown type or size")
        declared.setdefault(str(pid[2]), (itemsize, pid[4]))
        view = pid[5] if len(pid) > 5 else None
        if view is not None and not (isinstance(view, tuple) and len(view) == 3 and all(type(v) is int for v in view[1:])
                                     and 0 <= view[1] and view[1] + view[2] <= pid[4] and view[2] >= 0):
            c.find("out-of-bounds", "pickle 4 (the checkpoint)",
                   f"a storage view {view!r:.60} lies outside its storage of {pid[4]} elements")
    keys = [str(k) for k in keys]
    unfilled = [k for k in declared if k not in keys]
    if unfilled:
        c.find("uninitialised", "storage data",
               f"{len(unfilled)} storage(s) ({', '.join(unfilled[:5])}) are declared but their bytes are not in the "
               "file: torch would hand out uninitialised memory for them")
    if len(set(keys)) != len(keys):
        c.find("uninitialised", "storage data", "a storage is listed twice in pickle 5: its bytes would be read twice")
    for i, key in enumerate(keys):
        if key not in declared:
            raise KeyError(f"pickle 5 lists storage {key!r}, which the checkpoint does not declare")
        itemsize, numel = declared[key]
        stored = struct.unpack("<q", buf[pos : pos + 8])[0] if pos + 8 <= size else -1
        pos += 8 + max(stored, 0) * itemsize
        if stored < 0 or pos > size:
            raise _Truncated(f"storage {i + 1} of {len(keys)} runs past the end of the file")
        if stored != numel:
            raise ValueError(f"storage {key!r} holds {stored} elements, the pickle declares {numel}")
    return pos


class _Truncated(ValueError):
    pass


def scan_tar(c: Collector, legacy_too: bool) -> None:
    """torch < 0.4 tar files: torch.load tries tarfile first and, without weights_only, unpickles its
    members (and extracts them to a temporary directory): always a finding; list what they reference."""
    import io
    import tarfile

    limit = _limits.current().max_pickle_bytes
    try:
        with open(c.path, "rb") as raw, tarfile.open(fileobj=io.BufferedReader(BoundedReader(raw)), mode="r:") as tar:
            for member in tar:
                if not member.isfile() or member.size > limit:
                    continue
                f = tar.extractfile(member)
                data = f.read() if f is not None else b""
                if data[:1] == b"\x80":
                    for w in pickle_walk.walk_stack(data, 0, len(data), f"tar member {member.name}"):
                        c.add_walk(w)
    except (tarfile.TarError, KeyError, OSError) as e:
        c.damage("archive", f"is a corrupt legacy tar checkpoint ({e})")
    c.find("tar-format", "archive", "a torch < 0.4 tar checkpoint: torch loads these only with full unpickling")
    if legacy_too:
        c.find("polyglot", "archive", "the file is both a tar archive and a legacy torch pickle stream: torch.load "
                                      "reads it as the tar, other readers as the pickles")
