"""safetensors files: read (tensors mapped from the file, no copy), described without torch, written with
torch or, from :class:`~ckptfix.core.tensorinfo.TensorInfo` values, without it (the header written here, the
tensor bytes copied from their source in the kernel).

Written files carry ``{"format": "pt"}`` and, under the ``ckptfix`` metadata key, what
safetensors itself can't hold: aliases (tied weights written once), the key order, and the
state dict's ``_metadata``. ckptfix's reader restores all three; other readers ignore them.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ..core import bytecopy, filefill, locations, outputs
from ..core.checksums import crc32, crc32_combine
from ..core.devices import storage_id
from ..core.tensorinfo import StorageInfo, TensorInfo, math_bits
from ..core.torch_free import NeedsTorch
from ..core.units import dtype_name
from ..errors import ConversionError
from ..parse.format_registry import SAFETENSORS
from ..safety import digests
from ..parse.safetensors_header import (DTYPES, META_KEY, PACKED, assemble, ckptfix_meta, header_shape, read_header,
                                         torch_shape)
from .base import (CastRef, PiecedRef, RawRead, Reader, StorageRef, WritePlan, check_expansion, contiguous_strides,
                   source_record, stored_bytes, view_like)


def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """The file's tensors mapped from it (no copy), on ``plan``'s device; on meta, structure and ``refs`` only. On a
    GPU each tensor is read from the file through pinned staging windows (:func:`~ckptfix.core.filefill.fill_staged`),
    never copied from the mapping."""
    import torch

    start, header, meta = read_header(path)
    ckptfix_meta(path, meta)  # a malformed entry is refused before anything is mapped
    dev = plan.target("cpu") if plan.user_fn is None else "cpu"
    size = locations.size_of(path)
    staged = torch.device(dev).type == "cuda"
    whole: Any = None
    if dev != "meta" and size > start:
        locations.hold(path)
        if not staged:
            whole = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)

    tensors: dict[str, Any] = {}
    refs: dict[int, StorageRef] = {}
    fills: list[tuple[Any, int, Any]] = []  # (a GPU tensor, its bytes' offset, the dtype stored)
    for key, e in header.items():
        dtype = getattr(torch, DTYPES[e["dtype"]])
        shape = torch_shape(e)
        b, end = e["data_offsets"]
        t: Any  # (set_ with no stride makes it contiguous: torch's stubs lack that form)
        if dev == "meta":
            t = torch.empty(shape, dtype=dtype, device="meta")
            refs[storage_id(t)] = StorageRef(path, start + b, end - b, "cpu")
        elif staged:
            t = torch.empty(shape, dtype=dtype, device=dev)
            fills.append((t, start + b, dtype))
        else:
            t = torch.empty(0, dtype=dtype)
            if end > b:
                t.set_(whole[start + b : start + end], 0, shape)
            else:
                t = torch.empty(shape, dtype=dtype)
            if dev != "cpu":
                t = t.to(dev)
        tensors[key] = t
    if fills:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            filefill.fill_staged([(t, fd, offset, dtype, path) for t, offset, dtype in fills], check=False)
        finally:
            os.close(fd)
    sd = assemble(path, header, meta, tensors)
    tags = {storage_id(t): "cpu" for t in sd.values()}
    return RawRead(obj=sd, format=SAFETENSORS, tags=tags, refs=refs)


def describe(path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead:
    """The header only, without torch: one storage per stored tensor, ckptfix's aliases and key order restored."""
    start, header, meta = read_header(path)
    tensors: dict[str, Any] = {}
    for key, e in header.items():
        b, end = e["data_offsets"]
        shape = torch_shape(e)
        storage = StorageInfo(path, key, start + b, end - b, "cpu")
        tensors[key] = TensorInfo(DTYPES[e["dtype"]], shape, contiguous_strides(shape), 0, storage)
    sd = assemble(path, header, meta, tensors)
    tags = {id(t.storage): "cpu" for t in sd.values()}
    return RawRead(obj=sd, format=SAFETENSORS, tags=tags)


_ST_NAMES = {v: k for k, v in DTYPES.items()}


def _alias(of: str, dtype: str, shape: Any) -> dict[str, Any]:
    """ckptfix's metadata for a tied tensor written once: the key it is, and its header dtype and shape."""
    st_dtype = _ST_NAMES[dtype]
    return {"of": of, "dtype": st_dtype, "shape": header_shape(st_dtype, shape)}


def write(obj: Any, path: str, fmt: str, refs: dict | None = None, archive: str = "archive",
          force: bool = False) -> list[str]:
    """Write a flat state dict ``obj`` as the file ``path``; returns notes for the report. (``fmt``,
    ``archive``, ``force``: the family interface's; a safetensors file has no archive name.)

    Tied tensors (same storage, same view) are written once and recorded as aliases; other views
    are written as their own contiguous bytes. Tensors whose storage is in ``refs`` (a structure
    read) are copied from the source file's byte range; others are written from memory.
    """
    return _write_tensors(obj, path, refs)


def _write_tensors(state_dict: Any, path: str, refs: dict | None) -> list[str]:
    import torch

    refs = refs or {}
    notes: list[str] = []
    canonical: dict[tuple, str] = {}
    aliases: dict[str, dict] = {}
    tensors: list[tuple[str, Any]] = []
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ConversionError(
                f"{key!r} is a {type(t).__name__}, not a tensor: safetensors holds tensors only; "
                "write .pth instead (--format pth)"
            )
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            kind = "quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            raise ConversionError(f"{key!r}: a {kind} tensor can't be stored in safetensors; write .pth instead")
        name = dtype_name(t.dtype)
        if name not in _ST_NAMES:
            raise ConversionError(f"{key!r}: dtype {name} has no safetensors equivalent; write .pth instead")
        sid = storage_id(t)
        if t.device.type == "meta" and sid not in refs:
            raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a file")
        view = (sid, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, math_bits(t))
        if view in canonical and t.numel() > 0:
            aliases[key] = _alias(canonical[view], name, t.shape)
            continue
        canonical[view] = key
        if not t.is_contiguous():
            notes.append(f"{key!r} was not contiguous; written contiguous")
        tensors.append((key, t))

    check_expansion(tensors, refs, "")
    raw = encode_header(state_dict, tensors, aliases, notes)
    _write_data(path, raw, tensors, refs)
    return notes


def encode_header(state_dict: Any, tensors: list[tuple[str, Any]], aliases: dict[str, Any], notes: list[str]) -> bytes:
    """The safetensors header for ``tensors`` (sorted here, larger element sizes first: every tensor stays
    aligned to its element size, as safetensors does) with ckptfix's metadata entry: key order, aliases and
    ``_metadata``. Tensors are torch tensors or TensorInfo; notes say what was tied or dropped."""
    tensors.sort(key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {}
    offset = 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        st_dtype = _ST_NAMES[dtype_name(t.dtype)]
        if st_dtype in PACKED and not t.shape:
            raise ConversionError(f"{key!r}: a 0-dimensional {dtype_name(t.dtype)} tensor has no safetensors form "
                                  f"({st_dtype} counts values along the last dimension); write .pth instead")
        header[key] = {"dtype": st_dtype, "shape": header_shape(st_dtype, t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    extra: dict[str, Any] = {"version": 1, "order": list(state_dict.keys())}
    if aliases:
        extra["aliases"] = aliases
        notes.append(f"{len(aliases)} tied tensor(s) written once: " + ", ".join(f"{a} -> {c['of']}" for a, c in aliases.items()))
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        try:
            extra["module_metadata"] = json.loads(json.dumps(meta))
            versioned = _versions_that_matter(extra["module_metadata"], state_dict.keys())
            if versioned:
                notes.append(
                    f"_metadata: {', '.join(versioned)} record a state-dict version that load_state_dict reads "
                    "differently without it; kept in the ckptfix metadata entry: ckptfix.load restores it, "
                    "safetensors.torch.load_file and other loaders don't"
                )
        except (TypeError, ValueError):
            notes.append("_metadata dropped: it holds values JSON can't represent")
    header["__metadata__"] = {"format": "pt", META_KEY: json.dumps(extra, separators=(",", ":")),
                              **_provenance([key for key, _t in tensors])}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _provenance(names: list[str]) -> dict[str, str]:
    """The digests entry, every CRC-32 a placeholder (:func:`write_file` fills them in once the bytes are
    written), and the lineage of the current write (:mod:`ckptfix.safety.digests`)."""
    lineage = digests.lineage()
    return {digests.DIGESTS_KEY: digests.tensors_entry(dict.fromkeys(names, 0)),
            **({digests.LINEAGE_KEY: lineage} if lineage is not None else {})}


def _versions_that_matter(meta: Any, keys: Any) -> list[str]:
    """The modules whose ``_metadata`` version changes what ``load_state_dict`` loads, as ``'1' (version 2)``.

    A loader that drops ``_metadata`` passes every module version None. torch's modules load the same tensors
    then as at version 1 (nn.Module's default), and BatchNorm (version 2) as well unless it has running stats
    without num_batches_tracked (then version 2 makes a strict load fail where None fills the buffer in).
    A version above 2 is a module class of its own rules (quantized Linear …): it matters."""
    if not isinstance(meta, dict):
        return []
    present = set(keys)
    found = []
    for prefix, entry in meta.items():
        version = entry.get("version") if isinstance(entry, dict) else None
        if type(version) is not int or version <= 1:
            continue
        dot = f"{prefix}." if prefix else ""
        if version == 2 and (f"{dot}running_mean" not in present or f"{dot}num_batches_tracked" in present):
            continue  # BatchNorm with its buffer, or without running stats: loads the same without the version
        found.append(f"{prefix!r} (version {version})")
    return found[:5] + ([f"… (+{len(found) - 5} more)"] if len(found) > 5 else [])


Body = Callable[[int, bytecopy.Sources, int], tuple[int, list[int]]]


def write_file(path: str, header: bytes, names: list[str], body: Body, known: list[int | None] | None = None) -> None:
    """The file: its header, then ``body(out_fd, sources, pos) -> (end, CRC-32s)`` writes the data from ``pos``
    (``sources(path)`` opens each source file once: a descriptor, or a URL's queued copies, run by the body's
    ``CrcCheck.verify``) and gives each tensor's CRC-32 (``names``, in the header's order: from the source's bytes
    as they are copied, or from memory, never read back); the file ends at ``end``. The CRC-32s then replace the
    digests' placeholders in the header — or, where ``known`` gives every one before the copy (each tensor a whole
    zip record: the CRC-32 its zip records, which the body's check confirms), the header is final from the start,
    and the file can be hashed behind the copy (:class:`~ckptfix.core.outputs.Output`). Both writers use it."""
    placeholder = _escaped(digests.tensors_entry(dict.fromkeys(names, 0)))
    at = header.index(placeholder)
    ahead = known is not None and all(crc is not None for crc in known)
    first = _with_digests(header, at, names, known) if ahead and known is not None else header
    with bytecopy.Sources() as sources, outputs.create(path) as (f, out):
        f.write(struct.pack("<Q", len(header)) + first)
        f.flush()
        if ahead:
            out.final(8 + len(header))
        end, found = body(f.fileno(), sources, 8 + len(header))
        f.seek(end)
        f.truncate(end)
        if not ahead or found != known:  # (a hash made behind the copy is then void: the file is hashed again)
            final = _with_digests(header, at, names, found)[at : at + len(placeholder)]
            bytecopy.write_all(f.fileno(), memoryview(final), 8 + at)


def _with_digests(header: bytes, at: int, names: list[str], crcs: Sequence[int | None]) -> bytes:
    """``header`` with the digests' placeholder (at ``at``) replaced by ``crcs`` (same length: fixed-width hex)."""
    entry = _escaped(digests.tensors_entry({n: c or 0 for n, c in zip(names, crcs)}))
    return header[:at] + entry + header[at + len(entry) :]


def _escaped(value: str) -> bytes:
    """``value`` as it appears inside the header's JSON (a string, escaped as json.dumps escapes it)."""
    return json.dumps(value).encode("utf-8")[1:-1]


def _copied_from(t: Any, ref: Any) -> list[tuple[str, int, int]] | None:
    """The source ranges ``[(path, offset, size), …]`` whose bytes, one after another, are ``t``'s as stored (a
    tensor in chunks: its chunks), or None where they are computed in memory (a cast, a view to make contiguous)."""
    n = t.numel() * t.element_size()
    if isinstance(ref, PiecedRef):
        segments = ref.segments()
        whole = t.is_contiguous() and t.storage_offset() == 0 and n == ref.nbytes
        return list(segments) if segments is not None and whole else None
    if ref is None or isinstance(ref, CastRef) or not t.is_contiguous() or any(math_bits(t)):
        return None
    return [(ref.path, ref.offset + t.storage_offset() * t.element_size(), n)]


def _in_memory(t: Any, ref: Any) -> Any:
    """``t``'s bytes as a flat uint8 array (a cast computed now, chunks assembled, a view made contiguous)."""
    import torch

    if isinstance(ref, CastRef):  # a dtype cast: computed now, one tensor in memory
        t = ref.materialize()
    elif isinstance(ref, PiecedRef):  # chunks to assemble (file-backed scratch), then t's view of them
        t = torch.empty(0, dtype=t.dtype).set_(ref.materialize().untyped_storage(), t.storage_offset(), t.shape,
                                               t.stride())
    elif ref is not None:  # a view of a storage still in the source file, not its bytes as they are
        t = view_like(stored_bytes(ref), t)
    flat = t.detach().cpu().resolve_conj().resolve_neg().reshape(-1)  # (a conjugate or negative view's values)
    if flat.stride(0) != 1:  # contiguous() keeps a 1-element view's stride; view() needs 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy()


def _write_data(path: str, header: bytes, tensors: list[tuple[str, Any]], refs: dict) -> None:
    plans = [(t, refs.get(storage_id(t))) for _key, t in tensors]
    copied = [_copied_from(t, ref) for t, ref in plans]

    def body(out: int, source_fd: bytecopy.Sources, pos: int) -> tuple[int, list[int]]:
        ranges = [r for c in copied if c is not None for r in c]
        found: list[Callable[[], int]] = []
        with bytecopy.CrcCheck((source_record(ref) for _t, ref in plans), source_fd, ranges) as check:
            for (t, ref), segments in zip(plans, copied):
                if segments is not None:  # the stored bytes, copied in the kernel (chunk after chunk)
                    pos += bytecopy.copy_segments([(source_fd(p), o, k) for p, o, k in segments], out, pos)
                    found.append(functools.partial(_joined, check, segments))
                    continue
                data = _in_memory(t, ref)
                bytecopy.write_all(out, memoryview(data), pos)
                pos += data.nbytes
                found.append(functools.partial(int, crc32(data)))
            check.verify()  # (runs the queued remote copies first)
            return pos, [get() for get in found]

    known = [_recorded_crc(source_record(ref), segments) for (_t, ref), segments in zip(plans, copied)]
    write_file(path, header, [key for key, _t in tensors], body, known)


def _joined(check: bytecopy.CrcCheck, segments: list[tuple[str, int, int]]) -> int:
    """The CRC-32 of ``segments``' bytes one after another, from each one's (no byte read again)."""
    crc = 0
    for segment in segments:
        crc = crc32_combine(crc, check.crc(*segment), segment[2])
    return crc


# -- without torch ------------------------------------------------------------------------------------

def plan_write(obj: Any, fmt: str, archive: str = "archive", keep_keys: bool = True) -> WritePlan:
    """Plan writing TensorInfo values ``obj`` without torch (NeedsTorch, nothing written, for what only the
    torch writer reproduces: a non-contiguous view, a value that is not a tensor safetensors holds)."""
    header, tensors, notes = _safetensors_layout(obj)

    def write_safetensors(path: str) -> list[str]:
        _write_safetensors(path, header, tensors)
        return notes

    return WritePlan(write_safetensors)


def _safetensors_layout(state_dict: Any) -> tuple[bytes, list[tuple[str, TensorInfo]], list[str]]:
    """Header, tensors to copy and notes, as :func:`write` makes them."""
    notes: list[str] = []
    canonical: dict[tuple, str] = {}
    aliases: dict[str, dict] = {}
    tensors: list[tuple[str, TensorInfo]] = []
    for key, t in state_dict.items():
        if type(t) is not TensorInfo or t.dtype not in _ST_NAMES:
            raise NeedsTorch(f"{key!r}: not a tensor safetensors holds")
        view = (id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype)
        if view in canonical and t.numel() > 0:
            aliases[key] = _alias(canonical[view], t.dtype, t.shape)
            continue
        canonical[view] = key
        if not t.is_contiguous():
            raise NeedsTorch(f"{key!r} is not contiguous")
        tensors.append((key, t))
    raw = encode_header(state_dict, tensors, aliases, notes)
    return raw, tensors, notes


def _write_safetensors(path: str, header: bytes, tensors: list[tuple[str, TensorInfo]]) -> None:
    spans = [(t.storage.path, t.storage.offset + t.storage_offset * t.element_size(), t.nbytes) for _key, t in tensors]
    known = [_recorded_crc(t.storage.record, [span]) for (_key, t), span in zip(tensors, spans)]

    def body(out: int, source_fd: bytecopy.Sources, pos: int) -> tuple[int, list[int]]:
        with bytecopy.CrcCheck((t.storage.record for _key, t in tensors), source_fd, spans) as check:
            for src, offset, n in spans:
                bytecopy.copy_range(source_fd(src), out, offset, pos, n)
                pos += n
            check.verify()  # (runs the queued remote copies first)
            return pos, [check.crc(*span) for span in spans]

    write_file(path, header, [key for key, _t in tensors], body, known)


def _recorded_crc(record: bytecopy.Recorded | None, segments: list[tuple[str, int, int]] | None) -> int | None:
    """The CRC-32 a tensor's bytes have by its source zip's record, where they are that whole record (else None:
    computed as they are copied)."""
    if record is None or segments is None or len(segments) != 1:
        return None
    return record.known if segments[0] == (record.path, record.offset, record.size) else None


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Any]:
    """None: a safetensors file records no CRC-32s."""
    return []
