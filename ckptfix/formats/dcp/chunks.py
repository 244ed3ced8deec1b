"""The chunks of a DCP checkpoint: located, checked against ``.metadata``, read or copied.

Each tensor chunk is a ``torch.save`` record inside a ``.distcp`` file. A tensor stored as one
chunk is mapped from its file (no copy); a sharded one (FSDP2, …) is assembled chunk by chunk in a
file-backed scratch mapping under TMPDIR (:class:`Scratch`), so anonymous memory stays bounded by
one chunk. A conversion needs neither: where a tensor's chunks tile it row-major (FSDP2 splits
dim 0; one chunk) and each holds plain contiguous bytes, the tensor's bytes are those byte ranges
one after another, and :class:`TensorRef` hands them to the writers to copy in the kernel.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from typing import Any

from ...core import limits, locations
from ...errors import CkptfixError, ConversionError, FormatError
from ...parse.checkpoint_dirs import METADATA, member_path
from ...parse.format_registry import DCP
from ...parse.zipdir import RangeFile
from ..base import PiecedRef
from ..torchsave.torch_io import torch_load, translate_load_error


def whole(md: Any) -> bool:
    """Stored as one chunk covering the whole tensor."""
    if len(md.chunks) != 1:
        return False
    chunk = md.chunks[0]
    return list(chunk.offsets) == [0] * len(md.size) and list(chunk.sizes) == list(md.size)


def tensor_nbytes(md: Any) -> int:
    import torch

    return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()


def aligned(n: int) -> int:
    return (n + 63) // 64 * 64


def tiling_problem(fqn: str, size: Any, chunks: list[tuple[Any, Any]]) -> str | None:
    """Why the chunks ``[(offsets, sizes), …]`` don't tile a tensor of ``size`` exactly (each inside it,
    no two overlapping, every element covered), with what to do; None where they do. Counting elements
    alone would pass two chunks that overlap and leave a gap of the same size (that torch's loader
    fills with whatever the target held)."""
    size = list(size)
    boxes: list[tuple[list[int], list[int]]] = []
    for offsets, sizes in chunks:
        offsets, sizes = list(offsets), list(sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
            return f"{fqn!r} chunk {offsets}+{sizes} falls outside its size {size}{_DAMAGED}"
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    # sweep along the dimension where the chunks start at the most places: FSDP's dim 0, TP's dim 1
    dim = max(range(len(size)), key=lambda d: len({o[d] for o, _ in boxes}), default=None)
    boxes.sort(key=lambda box: 0 if dim is None else box[0][dim])
    open_: list[tuple[list[int], list[int]]] = []
    for offsets, sizes in boxes:
        if dim is not None:
            open_ = [(o, n) for o, n in open_ if o[dim] + n[dim] > offsets[dim]]
        for o, n in open_:
            if all(a < b + m and b < a + k for a, k, b, m in zip(offsets, sizes, o, n)):
                return f"{fqn!r} chunks {o}+{n} and {offsets}+{sizes} overlap{_DAMAGED}"
        open_.append((offsets, sizes))
    covered, total = sum(math.prod(n) for _, n in boxes), math.prod(size)
    if covered != total:
        return f"the chunks of {fqn!r} leave {total - covered} of its {size} elements uncovered{_DAMAGED}"
    return None


_DAMAGED = ": the chunks must tile the tensor exactly; the checkpoint is damaged (save it again)"


class Scratch:
    """One file-backed shared mapping (its file unlinked at once) that sharded tensors are
    assembled in: its pages are the page cache's to write back, not anonymous memory."""

    def __init__(self, nbytes: int):
        self.storage: Any = None
        self.pos = 0
        if nbytes == 0:
            return
        import torch

        tmpdir = tempfile.gettempdir()
        try:
            fd, name = tempfile.mkstemp(prefix="ckptfix-dcp-", suffix=".scratch", dir=tmpdir)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS mid-copy
                else:
                    os.ftruncate(fd, nbytes)
                self.storage = torch.UntypedStorage.from_file(name, shared=True, nbytes=nbytes)
            finally:
                os.close(fd)
                os.unlink(name)
        except OSError as e:
            raise ConversionError(
                f"can't reserve {nbytes} bytes of scratch space in {tmpdir} to consolidate the sharded "
                f"tensors ({e.strerror or e}); point TMPDIR at a disk with room"
            ) from None

    def take(self, shape: list[int], dtype: Any, nbytes: int) -> Any:
        import torch

        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        t: Any = torch.empty(0, dtype=dtype)  # set_ with no stride: contiguous (torch's stubs lack it)
        t.set_(self.storage[self.pos : self.pos + nbytes], 0, shape)
        self.pos += aligned(nbytes)
        return t


class Chunks:
    """The records of one DCP directory: located (inside it), checked against the metadata, mapped."""

    def __init__(self, path: str, meta: Any):
        self.path = path
        self.meta_path = locations.join(path, METADATA)
        self.files: dict[str, str] = {}
        self.maps: dict[str, Any] = {}
        self.handles: dict[str, Any] = {}
        self.records: dict[tuple, Any] = {}
        self.shells: dict[tuple, tuple[Any, str, Any, int | None]] = {}
        self.expanded = 0  # bytes of chunks whose records hold less (stride 0): max_expand_bytes
        for index, info in meta.storage_data.items():
            offset = getattr(index, "offset", None)
            rel: Any = getattr(info, "relative_path", None)
            if rel not in self.files:
                self.files[rel] = member_path(path, rel, self.meta_path, what="chunk file")
            self.records[(getattr(index, "fqn", None), None if offset is None else tuple(offset))] = info

    def record(self, fqn: str, chunk: Any = None) -> Any:
        """The storage info of ``fqn`` (a chunk of it for tensors)."""
        info = self.records.get((fqn, None if chunk is None else tuple(chunk.offsets)))
        if info is None:
            where = "" if chunk is None else f" chunk at offset {list(chunk.offsets)}"
            raise FormatError(f"{self.meta_path}: {fqn!r}{where} is in the metadata but no .distcp file holds it")
        if getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"{self.meta_path}: {fqn!r} is stored with transforms {info.transform_descriptors} "
                "(compression?); ckptfix reads plain FileSystemWriter checkpoints only"
            )
        return info

    def check_geometry(self, fqn: str, md: Any) -> None:
        """Every chunk inside the tensor and stored somewhere, together covering it exactly."""
        problem = tiling_problem(fqn, md.size, [(c.offsets, c.sizes) for c in md.chunks])
        if problem is not None:
            raise FormatError(f"{self.meta_path}: {problem}")
        for c in md.chunks:
            self.record(fqn, c)

    def tensor(self, fqn: str, md: Any, scratch: Scratch | None) -> Any:
        """The whole tensor: on meta, mapped from its one chunk, or assembled in ``scratch``."""
        import torch

        size, dtype = list(md.size), md.properties.dtype
        if scratch is None:
            return torch.empty(size, dtype=dtype, device="meta")
        if whole(md):
            return self._chunk(fqn, md.chunks[0], dtype)
        full = scratch.take(size, dtype, tensor_nbytes(md))
        for c in md.chunks:
            if math.prod(c.sizes):
                full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))].copy_(self._chunk(fqn, c, dtype))
        return full

    def _blob(self, fqn: str, info: Any) -> RangeFile:
        file = self.files[info.relative_path]
        if file not in self.handles:
            self.handles[file] = locations.open_source(file)  # closed in close() (a remote one: by its session)
        source = self.handles[file]
        size = source.size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise FormatError(
                f"{file}: {fqn!r} is recorded at bytes {info.offset}..{info.offset + info.length} "
                f"but the file has {size}: truncated or from another save"
            )
        return RangeFile(lambda pos, n: source.read(info.offset + pos, n), info.length)

    def segments(self, fqn: str, md: Any) -> list[tuple[str, int, int]] | None:
        """``[(file, offset, nbytes), …]`` whose concatenation is the whole tensor's bytes, row-major;
        None unless its chunks tile it along dim 0 alone (FSDP2's shards; or it is one chunk), each a
        plain contiguous record of exactly its own elements."""
        size, dtype = list(md.size), md.properties.dtype
        if math.prod(size) == 0:
            return []
        chunks = [c for c in md.chunks if math.prod(c.sizes)]
        if not size:
            return None if len(chunks) != 1 else self._span(fqn, chunks[0], dtype)
        if any(list(c.offsets[1:]) != [0] * (len(size) - 1) or list(c.sizes[1:]) != size[1:] for c in chunks):
            return None
        out: list[tuple[str, int, int]] = []
        rows = 0
        for c in sorted(chunks, key=lambda c: c.offsets[0]):
            span = self._span(fqn, c, dtype) if c.offsets[0] == rows else None
            if span is None:
                return None
            out += span
            rows += c.sizes[0]
        return out if rows == size[0] else None

    def _span(self, fqn: str, chunk: Any, dtype: Any) -> list[tuple[str, int, int]] | None:
        """Where one chunk's elements lie in its file, row-major, or None (strided, a view of more)."""
        info, file, shell, offset = self._shell(fqn, chunk, dtype)
        n = shell.numel() * shell.element_size()
        if offset is None or not shell.is_contiguous() or shell.storage_offset() != 0 or shell.untyped_storage().nbytes() != n:
            return None
        return [(file, info.offset + offset, n)]

    def check_records(self, fqn: str, md: Any) -> None:
        """Load each chunk's record on meta (checked against the metadata and max_expand_bytes) before
        anything is sized by the metadata's word alone (a scratch mapping, an output)."""
        for c in md.chunks:
            self._shell(fqn, c, md.properties.dtype)

    def _shell(self, fqn: str, chunk: Any, dtype: Any) -> tuple[Any, str, Any, int | None]:
        """``(info, file, shell, offset)``: the chunk's record loaded on meta (its shape, dtype and
        layout checked against the metadata, and what it expands to beyond its storage against
        max_expand_bytes) and where its storage's bytes start in the record (None where torch
        doesn't say or it doesn't fit). Loaded once per chunk."""
        key = (fqn, tuple(chunk.offsets))
        if key not in self.shells:
            self.shells[key] = self._load_shell(fqn, chunk, dtype)
            shell = self.shells[key][2]
            nbytes = shell.numel() * shell.element_size()
            if nbytes > shell.untyped_storage().nbytes():  # a stride-0 record: 4 bytes standing for gigabytes
                self.expanded += nbytes
                if self.expanded > limits.current().max_expand_bytes:
                    raise limits.exceeded(
                        "max_expand_bytes", f"chunk records holding fewer bytes than they stand for (e.g. the chunk "
                        f"of {fqn!r} at {list(chunk.offsets)}, a stride-0 expansion) would be written out as",
                        self.expanded, self.path)
        return self.shells[key]

    def _load_shell(self, fqn: str, chunk: Any, dtype: Any) -> tuple[Any, str, Any, int | None]:
        import torch

        info = self.record(fqn, chunk)
        file = self.files[info.relative_path]
        blob = self._blob(fqn, info)
        if blob.read(4) != b"PK\x03\x04":
            raise FormatError(f"{file}: {fqn!r} is not a torch.save record (another DCP serialization format?)")

        try:
            blob.seek(0)
            shell = torch_load(blob, "meta", trust=False)  # structure only, no data
            if not isinstance(shell, torch.Tensor) or list(shell.shape) != list(chunk.sizes) or shell.dtype != dtype:
                got = f"{type(shell).__name__} {list(getattr(shell, 'shape', []))} {getattr(shell, 'dtype', '')}"
                raise FormatError(f"{file}: {fqn!r} chunk holds {got}, the metadata says {list(chunk.sizes)} {dtype}")
            nbytes = shell.untyped_storage().nbytes()
            # torch.load sets where the storage's bytes start in the record
            offset = getattr(shell.untyped_storage(), "_checkpoint_offset", None)
        except CkptfixError:
            raise
        except Exception as e:  # torch raises many types for a bad record
            raise translate_load_error(f"{file}: {fqn!r} chunk", DCP, e) from None
        if offset is not None and not 0 <= offset <= info.length - nbytes:
            offset = None
        return info, file, shell, offset

    def _chunk(self, fqn: str, chunk: Any, dtype: Any) -> Any:
        """One chunk (a torch.save record) mapped from its file without a copy; loaded if it can't be."""
        import torch

        info, file, shell, offset = self._shell(fqn, chunk, dtype)
        if offset is None or locations.is_remote(file):  # load it for real (a remote record: its bytes fetched)
            try:
                return torch_load(self._blob(fqn, info), "cpu", trust=False)
            except CkptfixError:
                raise
            except Exception as e:  # torch raises many types for a bad record
                raise translate_load_error(f"{file}: {fqn!r} chunk", DCP, e) from None
        nbytes = shell.untyped_storage().nbytes()
        if nbytes == 0:
            return torch.empty(shell.shape, dtype=dtype)
        if file not in self.maps:
            locations.hold(file)
            self.maps[file] = torch.UntypedStorage.from_file(file, shared=False, nbytes=os.path.getsize(file))
        start = info.offset + offset
        t = torch.empty(0, dtype=dtype)
        t.set_(self.maps[file][start : start + nbytes], shell.storage_offset(), shell.shape, shell.stride())
        return t

    def value(self, fqn: str, plan: Any, trust: bool, tags: dict[int, str]) -> Any:
        """A non-tensor entry (torch.save bytes) under the same safe policy as a torch file's own pickle: a global outside
        the allow-list an inert placeholder (never imported or called), refused inside the selected state dict."""
        info = self.record(fqn)
        if info.length > limits.current().max_pickle_bytes:
            raise limits.exceeded("max_pickle_bytes", f"entry {fqn!r}'s size", info.length, self.path)
        data = self._blob(fqn, info).read()
        try:  # (placeholders in what DCP writes, a torch.save zip; anything else read strictly)
            return torch_load(io.BytesIO(data), plan.torch_map_location(tags), trust=trust,
                              placeholders=data[:4] == b"PK\x03\x04")
        except CkptfixError:
            raise
        except Exception as e:  # all become FormatError / UnsafeCheckpointError
            raise translate_load_error(f"{self.path}: entry {fqn!r}", DCP, e) from None

    def close(self) -> None:
        """Close the files and drop the maps (reopened if the records are read again)."""
        handles, self.handles, self.maps = self.handles, {}, {}
        for f in handles.values():
            f.close()


_UNSET: Any = object()


class TensorRef(PiecedRef):
    """One DCP tensor for the writers: its chunks' byte ranges in order where they tile it row-major,
    else (2-D sharding, strided records, …) assembled on demand in its own scratch mapping."""

    def __init__(self, source: Chunks, fqn: str, md: Any):
        super().__init__(tensor_nbytes(md))
        self.source, self.fqn, self.md = source, fqn, md
        self._segments: Any = _UNSET
        self._pieces: Any = _UNSET

    def segments(self) -> list[tuple[str, int, int]] | None:
        if self._segments is _UNSET:
            try:
                self._segments = self.source.segments(self.fqn, self.md)
            finally:
                self.source.close()
        return self._segments

    def pieces(self) -> list[tuple[list[int], list[int], tuple[str, int, int]]] | None:
        """``[(offsets, sizes, (file, offset, nbytes)), …]``: each non-empty chunk's box of the tensor and where
        its elements lie, row-major, in its file — where every chunk is plain contiguous bytes (a reader of a box
        takes from each chunk only what it needs); None where one isn't (strided, a view of more)."""
        if self._pieces is _UNSET:
            try:
                dtype = self.md.properties.dtype
                out: list[tuple[list[int], list[int], tuple[str, int, int]]] | None = []
                for c in self.md.chunks:
                    span = self.source._span(self.fqn, c, dtype) if math.prod(c.sizes) else []
                    if span is None:
                        out = None
                        break
                    out += [(list(c.offsets), list(c.sizes), span[0])] if span else []  # type: ignore[operator]
                self._pieces = out
            finally:
                self.source.close()
        return self._pieces

    def materialize(self) -> Any:
        md, n = self.md, self.nbytes
        try:
            self.source.check_records(self.fqn, md)  # before the scratch mapping the metadata sizes
            t = self.source.tensor(self.fqn, md, Scratch(0 if whole(md) else n))
            if not (t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == n):
                t = Scratch(n).take(list(md.size), md.properties.dtype, n).copy_(t)  # one strided chunk
            return t
        finally:
            self.source.close()
