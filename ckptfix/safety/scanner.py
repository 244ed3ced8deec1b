"""Safe loading: the static scan run before every untrusted torch load, and ``ckptfix scan``.

Nothing in a file is imported or executed here: pickles are walked opcode by opcode
(:mod:`ckptfix.parse.pickle_walk`), zip archives are checked byte by byte (:mod:`ckptfix.parse.zipcheck`),
and every global is classed against torch's weights_only defaults and ckptfix's allow-list
(:mod:`ckptfix.safety.allowlist`, its rules applied to constant arguments by :mod:`ckptfix.safety.static_checks`);
:mod:`ckptfix.safety.file_scanners` holds the per-format scanners, this module the entry points and the
directory formats. A file with an unsafe global or an ambiguous structure is
refused before torch opens it; ckptfix's restricted unpickler (:mod:`ckptfix.parse.unpickler`) is the
second line.

>>> report = ckptfix.scan("model.pth")          # doctest: +SKIP
>>> report.ok, [g.name for g in report.globals if g.category == "unsafe"]
"""

from __future__ import annotations

import bz2
import lzma
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any

from . import dcp_policy
from ..parse import pickle_walk
from ..core import limits as _limits, locations
from ..core.units import SHOWN_ITEMS, few, listed, shown
from .allowlist import UNSAFE
from ..parse.checkpoint_dirs import find_index, load_index, locate, member_path
from .deepspeed_policy import optim_names
from ..errors import FormatError, NeedsLocalCopy, UnsafeCheckpointError, trust_advice
from ..parse.safetensors_header import check_file
from .file_scanners import (PICKLE, Collector, Finding, GlobalRef, ScanReport, scan_legacy, scan_tar, scan_zip,
                            starts_with_magic)
from ..parse.format_registry import DCP, DEEPSPEED, FORMATS, TORCH_ZIP
from ..parse.legacy_tar import opens_as_tar
from ..parse.disguise import compression, pickle_prefix
from ..parse.recognise import LEGACY_MAGIC, ZIP_MAGIC
from ..parse.sniff import resolve
from ..parse.zipdir import zip_directory

__all__ = ["ScanReport", "GlobalRef", "Finding", "scan", "ensure_safe"]

_CODE_KINDS = {"unsafe-global", "unsafe-construct", "torchscript-code", "malformed"}
#: what scan reads that is no checkpoint format (every other verb refuses it): a zip holding no data.pkl, a
#: compressed file, and a safetensors file that is a pickle too
ZIP, COMPRESSED, POLYGLOT = "zip", "compressed", "safetensors and pickle"
#: the scans of what is no checkpoint format: a plain pickle too (every other SCANNERS key is a registry scanner name)
NOT_FORMATS = frozenset({PICKLE, ZIP, COMPRESSED, POLYGLOT})
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {"gzip": lambda: zlib.decompressobj(wbits=47), "xz": lzma.LZMADecompressor,
                                                 "bz2": bz2.BZ2Decompressor}


def scan(path: Any, fmt: str | None = None, check_crc: bool = True, unpickled_by_caller: str | None = None) -> ScanReport:
    """Statically analyse ``path``: every pickle's globals and, for zips, the archive's structure.

    Raises FormatError when the file is unreadable (and nothing unsafe was seen before the
    damage). ``check_crc=False`` skips the CRC of tensor data (still checked for pickles).
    A remote ``path`` (``https://``, ``s3://``, ``hf://``: :mod:`ckptfix.core.locations`) is scanned from the byte
    ranges the checks read, without the CRC of tensor data; its report's ``bytes_fetched`` says what that cost.
    """
    path = os.fspath(path)
    _limits.current()  # a malformed CKPTFIX_MAX_* variable is an error of its own, not a finding
    with locations.session() as s, s.reporting():
        remote = locations.is_remote(path)
        path, fmt = (path, fmt) if fmt else _scan_format(path)
        spec = FORMATS.get(fmt)
        if spec is None and fmt not in (PICKLE, ZIP, COMPRESSED, POLYGLOT):
            raise FormatError(f"{path}: scan reads checkpoint files (torch zip or legacy, TorchScript, safetensors), "
                              f"sharded checkpoints and DCP directories, not {fmt}")
        scanner = spec.scanner if spec is not None else fmt
        if remote and (spec is None or "scan" not in spec.from_url):
            raise NeedsLocalCopy(path, f"scanning a {fmt} file", "a URL is scanned in place only as " + ", ".join(
                f.label or f.name for f in FORMATS.values() if "scan" in f.from_url))
        report = SCANNERS[scanner](path, fmt, check_crc and not remote, unpickled_by_caller)
        if remote:
            report.bytes_fetched = s.bytes_fetched
        return report


def _scan_safetensors(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """No pickle inside; a malformed header or contradicting aliases raise FormatError."""
    check_file(path)
    return Collector(path, fmt).finish()


def _scan_zip(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None, code: bool = False) -> ScanReport:
    """A torch zip (``code``: a TorchScript archive, whose code torch would run): its structure and pickles,
    the central directory parsed once for the scan and the read (:func:`ckptfix.parse.zipdir.zip_directory`)."""
    c = Collector(path, fmt)
    try:
        directory = zip_directory(path)
    except (ValueError, OSError, struct.error):  # the scan parses it again and reports the damage
        directory = None
    with locations.open_buffer(path, whole=check_crc) as buf:  # (without the CRCs: the pages it reads, no more)
        scan_zip(c, buf, len(buf), code, check_crc, unpickled_by_caller, directory=directory)
    return c.finish()


def _scan_torchscript(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    return _scan_zip(path, fmt, check_crc, unpickled_by_caller, code=True)


def _scan_legacy(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A legacy torch file: a tar when tarfile takes it (torch.load tries tar first), else its pickle stream."""
    c = Collector(path, fmt)
    with locations.open_buffer(path, whole=True) as buf:
        if opens_as_tar(path):
            scan_tar(c, legacy_too=starts_with_magic(buf))
        else:
            scan_legacy(c, buf, len(buf))
    return c.finish()


def _scan_pickle(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A plain pickle (not a checkpoint, but scannable): every pickle in it walked."""
    c = Collector(path, fmt)
    with locations.open_buffer(path, whole=True) as buf:
        size = len(buf)
        for w in pickle_walk.walk_stack(buf, 0, min(size, _limits.current().max_pickle_bytes), "pickle"):
            c.add_walk(w)
    return c.finish()


def _scan_other_zip(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A zip holding no data.pkl (no verb reads it as a checkpoint): every member that is a pickle, whatever its name."""
    c = Collector(path, fmt)
    with locations.open_buffer(path, whole=True) as buf:
        scan_zip(c, buf, len(buf), False, check_crc, every_pickle=True)
    return c.finish()


def _scan_polyglot(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A safetensors file whose bytes are a pickle too: the pickle's globals, and the finding."""
    c = Collector(path, fmt)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        w = pickle_prefix(path, False, f.read(4096), size)
    if w is not None:
        c.add_walk(w)
    c.find("polyglot", "file", "the file reads both as safetensors and as a pickle: safetensors readers see tensors, "
                               "pickle.loads and torch.load(weights_only=False) run the pickle")
    return c.finish()


def _scan_compressed(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A gzip/xz/bz2 file: decompressed in memory up to max_pickle_bytes, then scanned as what it holds (a torch
    zip, a legacy file or a plain pickle); torch.load reads none of them, whoever decompresses it might."""
    c = Collector(path, fmt)
    limit = _limits.current().max_pickle_bytes
    with open(path, "rb") as f:
        kind = compression(f.read(8)) or ""
        f.seek(0)
        inner, out = _DECOMPRESSORS[kind](), bytearray()
        try:
            while len(out) <= limit and (chunk := f.read(1 << 20)):
                out += inner.decompress(chunk, limit + 1 - len(out))
                while len(out) <= limit and (rest := _pending(inner)) is not None:
                    out += inner.decompress(rest, limit + 1 - len(out))
        except (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError) as e:
            raise FormatError(f"{path}: is a corrupt {kind} file ({e})") from None
    where = f"{kind}-compressed content"
    if len(out) > limit:
        c.find("resource-limit", where, f"{where}: {_limits.exceeded('max_pickle_bytes', 'decompressed content')}")
        return c.finish()
    data = bytes(out)
    if data.startswith(ZIP_MAGIC):
        scan_zip(c, data, len(data), False, check_crc, every_pickle=True)
    elif data[:1] == b"\x80" and pickle_walk.walk(data[:64], 0).value == LEGACY_MAGIC:
        scan_legacy(c, data, len(data))
    elif data[:1] == b"\x80":
        for w in pickle_walk.walk_stack(data, 0, len(data), where):
            c.add_walk(w)
    else:
        raise FormatError(f"{path}: is {kind}-compressed, and what it holds is neither a pickle nor a torch checkpoint")
    return c.finish()


def _pending(inner: Any) -> bytes | None:
    """What to feed a decompressor that stopped at its output bound to go on (None: it wants the next input)."""
    if hasattr(inner, "unconsumed_tail"):  # zlib keeps what it did not read
        return inner.unconsumed_tail or None
    return None if inner.eof or inner.needs_input else b""  # lzma and bz2 keep it inside


def _scan_sharded(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """Every shard an index lists, scanned as a file of its own; ``where`` names the shard."""
    index = find_index(path) or path
    root = locations.dirname(index)
    c = Collector(path, fmt)
    shards = list(dict.fromkeys(load_index(index).values()))
    locations.warm([locations.join(root, shard) for shard in shards])  # remote shards: opened at once
    for shard in shards:
        c.merge_report(shard, scan(member_path(root, shard, index), check_crc=check_crc))
    return c.finish()


def _scan_deepspeed(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A DeepSpeed checkpoint's tag directory: every model_states and optim_states file as a torch zip of
    its own, DeepSpeed's loss scaler, ZeRO stage and fragment address allowed in the optim_states files
    (ckptfix loads them as inert stand-ins; DeepSpeed's zero_to_fp32.py unpickles them fully)."""
    layout = locate(path)
    c = Collector(path, DEEPSPEED)
    for file in [*layout.model_files, *layout.optim_files]:
        part = Collector(os.path.basename(file), TORCH_ZIP)
        with locations.open_buffer(file, whole=True) as buf:
            scan_zip(part, buf, len(buf), False, check_crc, also=optim_names() if file in layout.optim_files
                      else frozenset())
        c.merge(part)
    return c.finish()


def _scan_dcp(path: str, fmt: str, check_crc: bool, unpickled_by_caller: str | None) -> ScanReport:
    """A DCP directory: ``.metadata`` (which torch's own DCP loader unpickles with plain pickle) walked
    with DCP's metadata classes allowed, then every record it lists (torch.save zips inside the
    ``.distcp`` files) checked and walked like a torch zip of its own."""
    c = Collector(path, DCP)
    meta_path = locations.join(path, dcp_policy.METADATA)
    data = dcp_policy.read_bytes(meta_path)
    also = dcp_policy.metadata_names()
    walks = pickle_walk.walk_stack(data, 0, len(data), ".metadata")
    for w in walks:
        c.add_walk(w, also)
    if walks and walks[0].end is not None and walks[0].end < len(data):
        c.find("trailing-data", ".metadata", f"{len(data) - walks[0].end} bytes follow the pickle in .metadata")
    meta_pt = locations.join(path, "meta.pt")  # Lightning's sharded checkpoints: everything but the weights
    if locations.is_file(meta_pt):
        c.merge_report("meta.pt", scan(meta_pt, check_crc=check_crc))
    if c.findings or any(g.category == UNSAFE for g in c.globals.values()):
        return c.finish()  # the records' places come from .metadata: not read unless it is clean
    records = dcp_policy.record_ranges(path)
    locations.warm(list(records))
    for file, ranges in records.items():
        with locations.open_buffer(file, whole=check_crc) as buf:
            for what, start, length in ranges:
                record = Collector(f"{os.path.basename(file)} [{what}]", TORCH_ZIP)
                scan_zip(record, locations.window(buf, start, length), length, False, check_crc)
                c.merge(record)
    return c.finish()


#: the registry's ``scanner`` names (and the plain pickle) → the scan each runs
SCANNERS = {"safetensors": _scan_safetensors, "torch-zip": _scan_zip, "torchscript": _scan_torchscript,
             "torch-legacy": _scan_legacy, PICKLE: _scan_pickle, "sharded": _scan_sharded, "dcp": _scan_dcp,
             "deepspeed": _scan_deepspeed, ZIP: _scan_other_zip, COMPRESSED: _scan_compressed,
             POLYGLOT: _scan_polyglot}


def ensure_safe(path: str, fmt: str, structure_only: bool = False, unpickled_by_caller: str | None = None,
                placeholders: bool = False) -> None:
    """Raise UnsafeCheckpointError naming every unsafe global (sorted) and structural problem.

    Called before every untrusted torch load. ``structure_only`` checks just the zip structure,
    for readers that execute nothing themselves (the TorchScript inspector).
    ``unpickled_by_caller`` (``"data.pkl"``) skips walking that one member: the caller unpickles it
    with torch's weights_only unpickler, which refuses any global outside the allow-list before
    building it, checks that nothing follows its STOP, and calls ``ensure_safe`` again without the
    skip when anything fails, so the refusal still names every global. This halves the pure-Python
    pickle work of a streaming conversion of a checkpoint with many tensors.
    ``placeholders``: the caller's unpickler makes globals outside the allow-list inert placeholders
    (:mod:`ckptfix.parse.inert`) and refuses them inside the state dict, so those of the checkpoint's own
    pickle are no finding here; every other finding (another pickle, the archive, a misused allowed
    global, a call of a computed object) still is.
    """
    report = scan(path, fmt, check_crc=False, unpickled_by_caller=unpickled_by_caller)
    findings = [f for f in report.findings if not (structure_only and f.kind in _CODE_KINDS)
                and not (placeholders and report.extractable)]
    if not findings:
        return
    if unpickled_by_caller:  # refused anyway: scan everything so the message names every global
        return ensure_safe(path, fmt, structure_only, placeholders=placeholders)
    whole = None if structure_only else _whole_module_message(path, report, findings)
    if whole is not None:
        raise UnsafeCheckpointError(whole, report.unsafe_globals)
    parts = []
    if report.unsafe_globals and not structure_only:
        parts.append("it references globals outside the safe allow-list: " + few(report.unsafe_globals, SHOWN_ITEMS))
    others = [f.message for f in findings if f.kind != "unsafe-global"]
    parts += [listed(others, SHOWN_ITEMS, "; ")] if others else []
    raise UnsafeCheckpointError(
        f"{path}: refused: loading it could run code or read the wrong bytes: {'; '.join(parts)}. "
        f"{trust_advice()}; "
        f"`ckptfix scan {path}` lists everything it references.",
        [] if structure_only else report.unsafe_globals,
    )


#: the opcodes that name a class or create it with ``cls.__new__`` (what pickling an nn.Module uses), never a call
_CLASS_OPS = {"GLOBAL", "STACK_GLOBAL", "NEWOBJ", "NEWOBJ_EX"}


def _whole_module_message(path: str, report: ScanReport, findings: list[Finding]) -> str | None:
    """The refusal of a whole pickled model (``torch.save(model)``: torch.nn module classes created with NEWOBJ) in
    one short line naming its class and the fix, instead of every layer class; None for any other file.

    Only module classes are summarised: any other unsafe global (a function called with REDUCE) is still named,
    and the findings that are not about those classes are counted, for ``ckptfix scan`` to list."""
    unsafe = [g for g in report.globals if g.category == UNSAFE]
    if not any(g.name.startswith("torch.nn.modules.") for g in unsafe):
        return None
    classes = list(dict.fromkeys(g.name for g in unsafe if set(g.ops) <= _CLASS_OPS))
    if not classes:
        return None
    root = shown(classes[0])  # the first class the pickle names: the object torch.save was given (or its first module)
    calls = sorted({g.name for g in unsafe} - set(classes))
    made = [f"creates a {name}," for name in classes]
    others = [f for f in findings if f.kind not in ("unsafe-global", "malformed")
              and not any(m in f.message for m in made)
              and "calls a computed object" not in f.message]  # legacy files name module classes by persistent id
    also = f"; it also calls {few(calls, SHOWN_ITEMS)}" if calls else ""
    more = f"; {len(others)} other finding(s)" if others else ""
    return (f"{path}: refused: a whole pickled model (torch.save(model)) of class {root}"
            f"{f' and {len(classes) - 1} other module class(es)' if len(classes) > 1 else ''}, not a state dict: "
            f"loading it runs that code{also}{more}. Load it with the model's code and save model.state_dict() "
            f"instead; or, if you trust this file and its author and {root} is importable here, "
            f"{trust_advice().split(', ', 1)[1]}. `ckptfix scan {path}` lists everything it references.")


def _scan_format(path: str) -> tuple[str, str]:
    """What is scanned (a save_pretrained directory: its one file) and its format, or ``pickle`` for a plain pickle
    (not a checkpoint, but scannable)."""
    try:
        return resolve(path)
    except FormatError as e:
        if locations.is_remote(path):
            raise
        not_checkpoint = e
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        head = b""
    if len(head) >= 2 and head[0] == 0x80 and head[1] <= 5:
        return path, PICKLE
    if compression(head) is not None:
        return path, COMPRESSED
    if head.startswith(ZIP_MAGIC) and "no data.pkl" in str(not_checkpoint):
        return path, ZIP
    if head[8:9] == b"{" and pickle_prefix(path, False, head, os.path.getsize(path)) is not None:
        return path, POLYGLOT
    raise not_checkpoint
