"""Where a checkpoint's tensor bytes are, for a loader: mapped CPU views, or exact positional reads.

A structure read (tensors on ``meta``, each storage's ``StorageRef`` or ``PiecedRef``) says where every
element of every tensor sits in which file. From it a loader gets either a zero-copy CPU view of the
mapped file (what ``torch.load(mmap=True)`` or ``safetensors.safe_open`` would give), or — for one rank's
shard of a tensor — the exact byte runs of a box of elements, read straight into the destination. A
remote file (a URL: the reader's opener is ``locations.open_source``) can't be mapped: each storage is
fetched once into fresh CPU memory (tied tensors stay views of one storage).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..core import locations
from ..core.checksums import crc32
from ..core.devices import storage_id
from ..core.positional import PositionalReader
from ..errors import FormatError
from ..formats.base import PiecedRef, StorageRef

#: a run of bytes in one file: (path, offset, nbytes)
Segment = tuple[str, int, int]
#: remote storages fetched at once (a large one fetches its parts concurrently too: core.positional.WORKERS)
AHEAD = 8


class Sources:
    """The tensors of one structure read (``refs``: storage id → ref), as views or byte runs."""

    def __init__(self, refs: dict[int, Any], reader: PositionalReader):
        self.refs = refs
        self.reader = reader
        self._maps: dict[str, Any] = {}
        self._pieces: dict[int, Any] = {}
        self._fetched: dict[Segment, Any] = {}  # a remote storage's byte range -> its bytes in CPU memory
        self._checked: set[Segment] = set()  # the fetched ranges whose zip record's CRC-32 matched
        self._crcs = locations.fetched()  # the session's CRC-32s of fetched ranges (its threads don't see the session)
        self._mapped: dict[int, Segment] = {}  # a mapped storage slice's address -> its run of the file
        self._private: dict[int, Any] = {}  # the same address -> its bytes read into memory (:meth:`private`)

    def has_bytes(self, t: Any) -> bool:
        """A meta tensor whose storage a ref places in files (else the loader reads the file with torch)."""
        return not t.is_meta or self.refs.get(storage_id(t)) is not None

    def segments(self, t: Any) -> list[Segment] | None:
        """The file runs whose concatenation is ``t``'s storage, or None (computed bytes)."""
        ref = self.refs.get(storage_id(t))
        if isinstance(ref, StorageRef) and ref.path is not None:
            return [(ref.path, ref.offset, ref.nbytes)]
        if isinstance(ref, PiecedRef):
            return ref.segments()
        return None

    def check_bounds(self) -> None:
        """Every referenced byte lies inside its file (a truncated file is refused before anything is loaded)."""
        for ref in self.refs.values():
            segs = ([(ref.path, ref.offset, ref.nbytes)] if isinstance(ref, StorageRef) and ref.path is not None
                    else ref.segments() if isinstance(ref, PiecedRef) else None) or []
            for path, offset, nbytes in segs:
                if offset + nbytes > self.reader.size(path):
                    raise FormatError(f"{path}: a tensor's bytes {offset}..{offset + nbytes} lie past the end of the "
                                      f"file ({self.reader.size(path)} bytes): the file is truncated; nothing was loaded")

    def view(self, t: Any) -> Any:
        """``t`` with its bytes: a zero-copy view of the mapped file (a remote file's storage: fetched once; a
        DCP tensor split over files: read whole once); ``t`` itself when it isn't on meta. A conjugate or negative
        view (``is_conj``/``is_neg``: the values are the stored ones conjugated or negated, as torch rebuilds them) keeps
        its bit."""
        import torch

        if not t.is_meta:
            return t
        out = torch.empty(0, dtype=t.dtype)
        if self.refs[storage_id(t)].nbytes:
            out.set_(self.storage(t), t.storage_offset(), t.shape, t.stride())
        else:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        if t.is_conj():
            out = out.conj()
        if t.is_neg():
            out = torch._neg_view(out)
        return out

    def storage(self, t: Any) -> Any:
        """The CPU ``UntypedStorage`` holding the bytes of the meta tensor ``t``'s storage (exactly its ref's
        ``nbytes``): a slice of the mapped file, a remote file's range fetched once, or a DCP tensor's pieces."""
        sid = storage_id(t)
        ref = self.refs[sid]
        if isinstance(ref, StorageRef) and ref.path is not None:
            if self.reader.is_remote(ref.path):
                return self._fetched_checked(ref)
            mapped = self._map(ref.path)[ref.offset : ref.offset + ref.nbytes]
            self._mapped[mapped.data_ptr()] = (ref.path, ref.offset, ref.nbytes)
            return mapped
        if sid not in self._pieces:
            segs = ref.segments() if isinstance(ref, PiecedRef) else None
            if segs and any(self.reader.is_remote(path) for path, _o, _n in segs):  # a remote DCP tensor's chunks
                self._pieces[sid] = self._fetch_runs(segs, ref.nbytes)
            else:
                self._pieces[sid] = ref.materialize().untyped_storage()
        return self._pieces[sid]

    def private(self, view: Any) -> Any:
        """``view`` (from :meth:`view`) over its bytes read into memory of its own, where it is a view of a mapped file
        (else ``view``): a copy from it can't meet the file cut short meanwhile as SIGBUS — the read comes up short, a
        FormatError naming the file. For a load that holds no lease on its file (its undo log's case)."""
        import torch

        key = view.untyped_storage().data_ptr()
        run = self._mapped.get(key) if view.device.type == "cpu" and view.layout == torch.strided \
            and not view.is_quantized else None
        if run is None:
            return view
        if key not in self._private:
            path, offset, nbytes = run
            buf = torch.empty(nbytes, dtype=torch.uint8)
            try:
                self.reader.read_into(path, offset, byte_view(buf), count=False)
            except FormatError:  # (the plan checked its size: it shrank since)
                now = os.stat(path).st_size if os.path.exists(path) else 0
                raise FormatError(f"{path}: ends at byte {now}, but bytes {offset}..{offset + nbytes} are needed: the file "
                                  "was truncated while it was read") from None
            self._private[key] = buf.untyped_storage()
        out = torch.empty(0, dtype=view.dtype).set_(self._private[key], view.storage_offset(), view.shape, view.stride())
        if view.is_conj():
            out = out.conj()
        if view.is_neg():
            out = torch._neg_view(out)
        return out

    def _fetch_runs(self, runs: list[Segment], nbytes: int) -> Any:
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        out, pos = byte_view(buf), 0
        for path, offset, n in runs:
            self.reader.read_into(path, offset, out[pos : pos + n], count=False)
            pos += n
        if pos != nbytes:
            raise FormatError(f"{runs[0][0] if runs else 'checkpoint'}: a tensor's pieces hold {pos} bytes, it needs {nbytes}")
        return buf.untyped_storage()

    def fetch_ahead(self, tensors: Iterable[Any] | None = None) -> None:
        """Fetch the remote storages of ``tensors`` (meta tensors; None: every ref) at once, :data:`AHEAD` at a
        time (a large one in concurrent parts of its own), so a checkpoint of many small tensors costs a few
        round trips, not one per tensor; :meth:`storage` then finds them fetched. Local files and refs that
        aren't one byte range are left to :meth:`storage`."""
        refs = self.refs.values() if tensors is None else [self.refs.get(storage_id(t)) for t in tensors if t.is_meta]
        wanted = list(dict.fromkeys((ref.path, ref.offset, ref.nbytes) for ref in refs
                                    if isinstance(ref, StorageRef) and ref.path is not None and ref.nbytes
                                    and self.reader.is_remote(ref.path)))
        wanted = [key for key in wanted if key not in self._fetched]
        if len(wanted) < 2:
            return
        for path in {path for path, _o, _n in wanted}:
            self.reader.size(path)  # (opened here: the pool's threads don't see the verb's session)
        with ThreadPoolExecutor(min(AHEAD, len(wanted))) as pool:
            list(pool.map(lambda key: self._fetch(*key), wanted))

    def _fetched_checked(self, ref: StorageRef) -> Any:
        """A remote storage's bytes, fetched once; where they are exactly one zip record, its CRC-32 checked against
        the one the zip records (the bytes came over a network: a damaged or altered record is refused, nothing
        loaded)."""
        data = self._fetch(ref.path, ref.offset, ref.nbytes)
        record, key = ref.record, (ref.path, ref.offset, ref.nbytes)
        if record is not None and record.recorded and (record.offset, record.size) == (ref.offset, ref.nbytes) \
                and key not in self._checked:
            crc = self.crc32(*key)
            if record.mismatch(crc):
                raise damaged(record, crc)
            self._checked.add(key)
        return data

    def _fetch(self, path: str, offset: int, nbytes: int) -> Any:
        import torch

        key = (path, offset, nbytes)
        if key not in self._fetched:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:  # (counted where the loader counts views: by the tensors' bytes)
                self.reader.read_into(path, offset, byte_view(buf), count=False)
                self._crcs.add(path, offset, byte_view(buf))  # (for the digest check: no second fetch)
            self._fetched[key] = buf.untyped_storage()
        return self._fetched[key]

    def crc32(self, path: str, offset: int, size: int) -> int:
        """CRC-32 of ``path[offset : offset + size]`` (a zip record): of the bytes already fetched for a remote
        storage of exactly that range, else as the reader reads them."""
        fetched = self._fetched.get((path, offset, size))
        if fetched is not None:
            import torch

            return crc32(byte_view(torch.empty(0, dtype=torch.uint8).set_(fetched)))
        return self.reader.crc32(path, offset, size)

    def place(self, t: Any) -> tuple[str, int] | None:
        """``(path, byte offset)`` of the meta tensor ``t``'s elements when they are one contiguous run of a local
        file (a loader may read them straight into a tensor), else None (remote, pieced, computed, strided)."""
        ref = self.refs.get(storage_id(t)) if t.is_meta else None
        if not isinstance(ref, StorageRef) or ref.path is None or self.reader.is_remote(ref.path) \
                or not t.is_contiguous():
            return None
        return ref.path, ref.offset + t.storage_offset() * t.element_size()

    def _map(self, path: str) -> Any:
        import torch

        if path not in self._maps:
            locations.hold(path)
            self._maps[path] = torch.UntypedStorage.from_file(path, shared=False, nbytes=self.reader.size(path))
        return self._maps[path]

    def box_runs(self, t: Any, offsets: Sequence[int], sizes: Sequence[int]) -> list[Segment] | None:
        """The file runs holding the box ``t[offsets : offsets + sizes]`` in row-major order (their
        concatenation is the box as a contiguous tensor), or None where ``t`` isn't stored contiguously."""
        segs = self.segments(t)
        if segs is None or not t.is_contiguous():
            return None
        if math.prod(sizes) == 0:
            return []
        shape, item, strides = list(t.shape), t.element_size(), t.stride()
        if not shape:
            return list(_slice(segs, t.storage_offset() * item, item))

        def whole(d: int) -> bool:
            return offsets[d] == 0 and sizes[d] == shape[d]

        # k: the last dimension the box cuts; every dimension after it is whole, so each run is contiguous
        k = next(d for d in range(len(shape)) if all(whole(e) for e in range(d + 1, len(shape))))
        run = sizes[k] * math.prod(shape[k + 1:])
        runs: list[Segment] = []
        for index in itertools.product(*(range(offsets[d], offsets[d] + sizes[d]) for d in range(k))):
            first = t.storage_offset() + sum(i * s for i, s in zip(index, strides)) + offsets[k] * strides[k]
            runs.extend(_slice(segs, first * item, run * item))
        return _merge(runs)

    def read_runs(self, runs: list[Segment], out: memoryview) -> None:
        """Read ``runs`` one after another into ``out`` (exactly their total size)."""
        pos = 0
        for path, offset, nbytes in runs:
            self.reader.read_into(path, offset, out[pos : pos + nbytes])
            pos += nbytes
        if pos != out.nbytes:
            raise AssertionError(f"read {pos} bytes into a buffer of {out.nbytes}")


def _slice(segs: list[Segment], start: int, length: int) -> Iterator[Segment]:
    """The file runs of bytes ``start .. start + length`` of a storage made of ``segs``."""
    pos = 0
    for path, offset, nbytes in segs:
        lo, hi = max(start, pos), min(start + length, pos + nbytes)
        if lo < hi:
            yield path, offset + lo - pos, hi - lo
        pos += nbytes
        if pos >= start + length:
            return
    if pos < start + length:
        raise FormatError(f"{segs[0][0] if segs else 'checkpoint'}: a tensor needs bytes past the end of its storage")


def _merge(runs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for path, offset, nbytes in runs:
        if out and out[-1][0] == path and out[-1][1] + out[-1][2] == offset:
            out[-1] = (path, out[-1][1], out[-1][2] + nbytes)
        else:
            out.append((path, offset, nbytes))
    return out


def byte_view(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def damaged(record: Any, crc: int) -> FormatError:
    """The error for a zip record whose bytes' CRC-32 (``crc``) isn't the one its zip records."""
    return FormatError(f"{record.path}: record {record.name} does not match the CRC-32 its zip records ({crc:08x}, "
                       f"recorded {record.crc:08x}): the file was damaged or altered after it was written; nothing "
                       "was loaded; restore it from a good copy")
