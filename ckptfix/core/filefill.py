"""Built CPU tensors filled straight from a file, each chunk checked for NaN/Inf as it lands (``load_into`` of a
CPU-built model): the file's bytes go into the tensor's own memory, no staging copy, no mapped view kept. A cast, and
any tensor on a GPU, go through staging windows instead (:func:`fill_staged`).

A fill is split into jobs of :data:`JOB_BYTES`, shared by a few threads (:func:`~ckptfix.core.tensorcopy.run_jobs`:
torch's thread count at most, none started for a small load); each job reads :data:`~ckptfix.core.tensorcopy.READ_BYTES`
at a time and checks each chunk (:func:`~ckptfix.core.tensorcopy.bits_finite`) just after it landed, while it is in that
core's cache. A file that ends first is a :class:`~ckptfix.errors.FormatError` naming it and the range, not SIGBUS.
A file not in the page cache is asked for ahead of the reads (``POSIX_FADV_WILLNEED``), found out with
``RWF_NOWAIT``: nothing is asked of the kernel when the file is cached.

With the compiled kernels (:func:`~ckptfix.core.tensorcopy.native`) and every file leased (``rollback.Leases``: no
writer can shrink it while the lease holds), a job whose first read found its pages cached copies the rest from a
mapping of the file instead: each element checked between its load and its store, by non-temporal stores (no read of
the destination's old lines). Measured here (bench/RESULTS.md, wave 8), 1 GiB, the check included: steady in one
process 0.88× of torch's unchecked copy from a mapping (108.7 against 124.1 ms, each mapping made and unmapped); a
fresh process's whole first call 6.8–18.5 ms below the plain loader's. Without the kernels this was measured and not
taken (wave 6): a numpy copy from the mapping then a check took about what the reads do. A job asks whether its leases
still hold first: a writer that breaks one waits lease-break-time (:data:`MIN_BREAK_SECONDS` at least) — the job's
milliseconds — before it can shrink the file, and the jobs after it read instead.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

from ..errors import FormatError
from . import rollback, tensorcopy
from .tensorcopy import all_finite, bit_rule, bits_finite, checks_values, copy_checked, native, run_jobs, workers_for

#: bytes per job of :func:`fill_from_file`'s threads: a run of reads, each checked as it lands,
#: under one dispatch (the job queue's lock and numpy's error state are Python under the GIL, which the threads take
#: in turn: one per job instead of one per read saves 1.5–3 µs of CPU per read here, 3–6 ms per GiB)
JOB_BYTES = 4 * 2**20
#: bytes asked for ahead of the reads (``POSIX_FADV_WILLNEED``) where the file isn't in the page cache
READAHEAD_BYTES = 64 * 2**20
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: the least lease-break-time (seconds) under which a leased file is copied from its mapping (a job takes milliseconds)
MIN_BREAK_SECONDS = 10
#: a GPU fill's (:func:`fill_staged`) readers — threads reading the file into pinned windows, at most this many and
#: the cores this process may run on; not torch's thread count, which torchrun sets to 1 per rank —, the pinned windows
#: per reader at most (a reader fills its next window while the last one's copies run), and the bytes of each window.
#: Measured on an H200 (bench/load_gpu.py --sweep, bench/RESULTS.md wave 10): 4 readers took 1.3–1.4× the time of 8,
#: 16 were 0–10 % faster on fp32 and 15–25 % slower on a cast; a second window per reader gained 0–3 %; 32 MiB windows
#: nothing, 8 MiB ones cost 17 %, 4 MiB ones up to 2×
DEVICE_READERS = 8
DEVICE_WINDOWS_PER_READER = 2
DEVICE_WINDOW_BYTES = 16 * 2**20
#: where each piece starts in a window (a view of it as any dtype is aligned)
_ALIGN = 64


def fill_from_file(fills: list[tuple[Any, int, int, str]], check: bool = True, undo: Any = None,
                   tally: Any = None, leases: Any = None) -> list[bool]:
    """Fill each contiguous CPU tensor ``dst`` of ``fills`` — ``(dst, fd, offset, name)`` — with the bytes of the
    file ``fd`` from ``offset`` (``dst.nbytes`` of them; ``name`` names the file in errors), in chunks by up to
    :data:`~ckptfix.core.tensorcopy.MAX_READERS` threads; with ``check``, each chunk is checked for NaN/Inf just after
    it landed. Returns, per fill, whether its values are all finite (True unchecked or for integer tensors). A file
    that ends first is a FormatError naming it and the range. With ``undo`` (a ``rollback.Undo``: the files are not
    leased), each chunk's old bytes are saved there just before its read, so the caller can put back what the reads
    replaced; with ``tally`` (a ``checksums.Tally``), each chunk's CRC-32 is taken too, while it is in cache
    (digests). With ``leases`` (a held ``rollback.Leases`` on every file read: none can shrink) and the compiled
    kernels (:func:`~ckptfix.core.tensorcopy.native`), a job whose first read found its pages cached copies the rest
    from a mapping of the file, checked as it is copied (:func:`_copy_mapped`)."""
    import torch

    jobs = []  # (fill index, byte view of the span, file offset, bytes per read): a span of reads per job
    for n, (dst, _fd, offset, _name) in sorted(enumerate(fills), key=lambda f: (f[1][1], f[1][2])):
        if dst.numel() == 0:
            continue
        raw = dst.reshape(-1).view(torch.uint8).numpy()
        step = max(1, tensorcopy.READ_BYTES // dst.element_size()) * dst.element_size()
        span = max(1, JOB_BYTES // step) * step
        jobs += [(n, raw[i : i + span], offset + i, step) for i in range(0, raw.size, span)]
    finite = [True] * len(fills)
    own = {fd: _sequential(fd) for fd in {f[1] for f in fills}}
    reader = _Reader([(d, own[fd], o, name) for d, fd, o, name in fills], jobs, finite, check, undo, tally)
    mapped = _Mapped(own.values(), leases, undo)
    reader.maps, reader.leases = mapped.views, leases
    try:
        run_jobs(len(jobs), reader.job, workers_for(sum(job[1].nbytes for job in jobs)))
    finally:
        mapped.close()
        for fd, mine in own.items():
            if mine != fd:
                os.close(mine)
    for n, (dst, _fd, _offset, _name) in enumerate(fills):  # a float kind the bit table doesn't know: torch's test
        if check and checks_values(dst) and bit_rule(dst.dtype) is None:
            finite[n] = all_finite(dst)
    return finite


def fill_staged(fills: list[tuple[Any, int, int, Any, str]], check: bool = True, undo: Any = None,
                tally: Any = None, leases: Any = None) -> list[bool]:
    """Fill each contiguous tensor ``dst`` of ``fills`` — ``(dst, fd, offset, dtype, name)``: its values stored as
    ``dtype`` in the file ``fd`` from ``offset`` — through staging windows: a cast on the CPU, any tensor on a GPU.
    Each window's bytes are read (``preadv``, never a mapping: a file that ends first is a FormatError naming it, not
    SIGBUS; never a copy from a mapping to a device, safetensors#729), their CRC-32s taken into ``tally`` (if any),
    then copied into the tensors, cast as torch casts, each piece's old values saved in ``undo`` first (if any). The
    windows are read by a few threads (:class:`_Staging`: on a GPU :data:`DEVICE_READERS` at most). With ``leases``
    held on every file and no ``undo``, a bf16 piece cast into fp32 whose first page is cached is widened by the
    compiled kernel straight from a mapping of the file instead (:meth:`_Staging.mapped`). Returns, per fill, whether
    its values are all finite (True unchecked or for integer tensors)."""
    finite = [True] * len(fills)
    groups: dict[Any, list[int]] = {}  # (a window's copies go to one device)
    for n, fill in enumerate(fills):
        groups.setdefault(fill[0].device, []).append(n)
    for numbers in groups.values():
        staging = _Staging([fills[n] for n in numbers], check, undo, tally, leases)
        try:
            run_jobs(len(staging.jobs), staging.job, staging.readers)
            for n, ok in zip(numbers, staging.finite_all()):
                finite[n] = ok
        finally:
            staging.close()
    return finite


class _Staging:
    """The shared state of :func:`fill_staged`'s threads. Each job is a window: pieces of the tensors (whole small
    ones, a large one in window-sized runs) in file order, read into the window, then copied out. On the CPU a window
    is :data:`JOB_BYTES`, the thread's own (1 MiB windows took 1.2–1.9× the time of 4 MiB ones here, per-call costs),
    each piece cast as torch casts — bf16 into fp32 by the compiled kernel, each value's bits shifted and checked in
    one pass, its stores streamed —; checked on its stored bytes where the cast widens (:func:`widens`: half the
    bytes of the values it makes), else as it is cast (:func:`copy_checked`). With a tensor on a GPU the windows are
    pinned, of :data:`DEVICE_WINDOW_BYTES`, at most :data:`DEVICE_WINDOWS_PER_READER` per reader, and each piece is
    copied asynchronously on a side stream (cast on the device), its NaN/Inf reduction queued behind it; a window is
    reused once an event says its copies are done, so reads of the next windows overlap the transfers. At the end the
    caller's stream waits for the side stream, which is synchronised (whatever happened: nothing is in flight once
    this returns), and the reductions are read at once."""

    def __init__(self, fills: list[tuple[Any, int, int, Any, str]], check: bool, undo: Any, tally: Any,
                 leases: Any = None) -> None:
        import torch

        self.fills, self.undo, self.tally = fills, undo, tally
        self.check = [check and checks_values(f[0]) for f in fills]
        self.on_source = [c and widens(f[3], f[0].dtype) and bit_rule(f[3]) is not None for c, f in zip(self.check, fills)]
        self.widen = [native() is not None and f[3] == torch.bfloat16 and f[0].dtype == torch.float32
                      and f[0].device.type == "cpu" for f in fills]
        self.finite = [True] * len(fills)
        self.sums: list[list[tuple[Any, Any]]] = [[] for _ in fills]  # per fill: (device piece, its reduction)
        self.device = fills[0][0].device if fills[0][0].device.type != "cpu" else None  # (one device: the caller's)
        window = DEVICE_WINDOW_BYTES if self.device is not None else JOB_BYTES
        widths = [torch.empty((), dtype=f[3]).element_size() for f in fills]
        self.jobs: list[list[tuple[int, int, int, int]]] = []  # per window: (fill, first element, count, window byte)
        self.nbytes, used = 0, window
        for n, (dst, _fd, _offset, _dtype, _name) in sorted(enumerate(fills), key=lambda f: (f[1][1], f[1][2])):
            per = max(1, window // max(widths[n], dst.element_size()))
            for first in range(0, dst.numel(), per):
                count = min(per, dst.numel() - first)
                at = -(-used // _ALIGN) * _ALIGN
                if at + count * widths[n] > window and used:
                    self.jobs.append([])
                    at = 0
                self.jobs[-1].append((n, first, count, at))
                used = at + count * widths[n]
                self.nbytes += count * widths[n]
        self.widths, self.window = widths, window
        self.own = {fd: _sequential(fd) for fd in {f[1] for f in fills}}
        self.reader = _Reader([], [], [], False)
        self.local = threading.local()  # a CPU window per thread
        self.stream: Any = None
        self.readers = workers_for(self.nbytes)
        self.free: list[tuple[Any, Any]] = []  # GPU: (pinned window, the event after its last copies)
        self.ready = threading.Condition()
        self.allocated = self.most = 0
        self.leases = leases
        self.maps = _Mapped(self.own.values() if any(self.widen) else (), leases, undo)  # (for the widened pieces)
        if self.device is not None:
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (the tensors' allocations, earlier work)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            self.readers = max(1, min(DEVICE_READERS, cores, len(self.jobs), self.nbytes // tensorcopy.THREAD_BYTES))
            self.most = min(self.readers * DEVICE_WINDOWS_PER_READER, len(self.jobs))  # (allocated as needed: _take)

    def job(self, j: int) -> None:
        import torch

        kernels = native()
        window = self._take()
        try:
            for n, first, count, at in self.jobs[j]:
                dst, fd, offset, dtype, name = self.fills[n]
                width = self.widths[n]
                start = offset + first * width
                raw = window[at : at + count * width]
                src = self.mapped(n, start, raw.numpy()) if self.widen[n] else None
                if src is None:
                    src = raw.numpy()
                    self.reader._read(self.own[fd], src, start, name)
                if self.tally is not None:
                    self.tally.add(name, start, src)
                out = dst.detach().view(-1)[first : first + count]
                if self.undo is not None:
                    self.undo.save_tensor(out)
                staged = raw.view(dtype)
                if self.stream is None:
                    if self.widen[n]:  # bf16 → fp32 by the compiled kernel: shifted and checked in one pass
                        if kernels.widen_bf16(out.view(torch.uint8).numpy(), src, self.check[n], True):
                            self.finite[n] = False
                    elif self.on_source[n]:  # (its stored bytes checked, half a widened copy's, then cast unchecked)
                        if self.finite[n] and not bits_finite(raw.numpy(), dtype):
                            self.finite[n] = False
                        with torch.no_grad():
                            out.copy_(staged)
                    elif not copy_checked(out, staged, self.check[n]):
                        self.finite[n] = False
                    continue
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
                    out.copy_(staged, non_blocking=True)  # (a cast: the bytes sent as stored, cast on the device)
                    if self.check[n]:
                        self.sums[n].append((out, tensorcopy.reduction(out)))
        finally:
            self._give(window)

    def mapped(self, n: int, start: int, probe: Any) -> Any:
        """The bytes of fill ``n`` from ``start`` (``probe``'s length) in the mapping of its leased file, for the kernel
        to widen from; None (read them) where its file isn't mapped, a lease is broken (a writer waits lease-break-time,
        :data:`MIN_BREAK_SECONDS` at least, for a piece's milliseconds), or their first page isn't cached (a cold file
        is read, with readahead). ``probe`` takes that first page."""
        mine = self.own[self.fills[n][1]]
        source = self.maps.views.get(mine)
        if source is None or not self.reader.nowait or not self.leases.intact():
            return None
        first = min(probe.nbytes, 4096)
        try:
            if os.preadv(mine, [probe[:first]], start, self.reader.nowait) < first:
                return None
        except OSError:  # (BlockingIOError: not cached; unsupported here: the reads)
            return None
        return source[start : start + probe.nbytes]

    def _take(self) -> Any:
        """A window to read into: this thread's own on the CPU; on a GPU a pinned one whose copies are done, else a new
        one while fewer than ``most`` are (a reader that finds its last window's copies done, the H2D copy being faster
        than the read, pins no second one: pinning costs 0.4 ms per MiB, bench/RESULTS.md), else the
        oldest, once its copies are done."""
        import torch

        if self.stream is None:
            window = getattr(self.local, "window", None)
            if window is None:
                window = self.local.window = torch.empty(self.window, dtype=torch.uint8)
            return window
        window = event = None
        with self.ready:
            while True:
                done = next((n for n, (_w, e) in enumerate(self.free) if e.query()), None)
                if done is not None:  # (a window whose copies are done)
                    return self.free.pop(done)[0]
                if self.allocated < self.most:  # (another window rather than a wait; pinning costs, once a process)
                    self.allocated += 1
                    break
                if self.free:
                    window, event = self.free.pop(0)
                    break
                self.ready.wait()
        if event is None:
            return torch.empty(self.window, dtype=torch.uint8, pin_memory=True)
        event.synchronize()  # (the GIL released while it waits)
        return window

    def _give(self, window: Any) -> None:
        import torch

        if self.stream is None:
            return
        done = torch.cuda.Event(blocking=True)  # (a thread waiting for it sleeps: the readers need the cores)
        done.record(self.stream)
        with self.ready:
            self.free.append((window, done))
            self.ready.notify()

    def finite_all(self) -> list[bool]:
        """Each fill's verdict; on a GPU, once the caller's stream waits for the copies (one sync for the checks)."""
        import torch

        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            for n, pieces in enumerate(self.sums):
                if pieces and not tensorcopy.finite_given([p for p, _s in pieces], [s for _p, s in pieces]):
                    self.finite[n] = False
        return self.finite

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # (a failed fill too: no copy into the model, nor out of a window, in flight)
        self.maps.close()
        for fd, mine in self.own.items():
            if mine != fd:
                os.close(mine)


def widens(stored: Any, dtype: Any) -> bool:
    """A cast from ``stored`` to ``dtype`` keeps every finite value finite and every NaN/Inf one (a float kind into one
    of at least its range): the stored bytes can be checked instead of the cast values."""
    import torch

    if not (stored.is_floating_point and dtype.is_floating_point) and not (stored.is_complex and dtype.is_complex):
        return False
    return bool(torch.finfo(dtype).max >= torch.finfo(stored).max)


def _mappable() -> bool:
    """Copies from a leased file's mapping can be made: the compiled kernels are here, and a writer that breaks a lease
    waits long enough (lease-break-time, at least :data:`MIN_BREAK_SECONDS`) for a job in flight to finish — each job
    asks whether its leases are unbroken first, so none reads a page a truncation took (SIGBUS)."""
    wait = rollback.break_time()
    return native() is not None and wait is not None and wait >= MIN_BREAK_SECONDS


class _Mapped:
    """The files' bytes mapped (``views``: descriptor → a uint8 view) for the compiled kernels to copy from: only where
    ``leases`` are held on every file, no undo log is kept (the log saves what a read replaces) and such copies can be
    made (:func:`_mappable`); else none."""

    def __init__(self, fds: Any, leases: Any, undo: Any) -> None:
        self.views: dict[int, Any] = {}
        self._maps: list[Any] = []
        if leases is not None and leases.held and undo is None and _mappable():
            for fd in set(fds):
                mapped = _mapping(fd)
                if mapped is not None:
                    self._maps.append(mapped)
                    self.views[fd] = _bytes_of(mapped)

    def close(self) -> None:
        self.views.clear()  # (the views first: a mapping with views can't be closed)
        for mapped in self._maps:
            _close(mapped)


def _mapping(fd: int) -> Any:
    """``fd``'s file mapped read-only; None for an empty file or where it can't be."""
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None


def _bytes_of(mapped: Any) -> Any:
    import numpy as np

    return np.frombuffer(mapped, dtype=np.uint8)


def _close(mapped: Any) -> None:
    try:
        mapped.close()
    except BufferError:  # a view still held (an exception's traceback): the mapping goes with it
        pass


def _sequential(fd: int) -> int:
    """A descriptor of ``fd``'s file of its own (the same file, reopened through /proc), with the kernel's
    readahead for a sequential read: the caller's may have it off (a positional reader's POSIX_FADV_RANDOM,
    which makes a cold whole-file read 1.5× slower here); ``fd`` itself where that can't be had."""
    try:
        mine = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return fd
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(mine, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return mine


class _Reader:
    """The shared state of :func:`fill_from_file`'s threads (:func:`run_jobs`): the readahead asked for per file."""

    def __init__(self, fills: list[tuple[Any, int, int, str]], jobs: list[Any], finite: list[bool],
                 check: bool, undo: Any = None, tally: Any = None) -> None:
        self.fills, self.jobs, self.finite, self.undo, self.tally = fills, jobs, finite, undo, tally
        self.checks = [check and checks_values(f[0]) and bit_rule(f[0].dtype) is not None for f in fills]
        self.lock = threading.Lock()
        self.ahead: dict[int, tuple[int, int]] = {}  # fd -> the range last asked for
        self.nowait = _NOWAIT
        self.maps: dict[int, Any] = {}  # fd -> its file's bytes, mapped (a leased file's, with the compiled kernels)
        self.leases: Any = None

    def job(self, j: int) -> None:
        """Read span ``j`` into its tensor a chunk at a time, each chunk checked just after its read, while it is
        still in this core's cache; once a read finds the file's pages cached, the rest of a leased file's span is
        copied from its mapping instead, checked as it is copied (:func:`_copy_mapped`)."""
        import numpy as np

        n, span, offset, step = self.jobs[j]
        dst, fd, _start, name = self.fills[n]
        mapped = self.maps.get(fd)
        with np.errstate(all="ignore"):  # once per span (:func:`~ckptfix.core.tensorcopy.bits_finite`)
            for i in range(0, span.nbytes, step):
                buf = span[i : i + step]
                if self.undo is not None:
                    self.undo.save(buf)  # the bytes this read replaces, while they are in this core's cache
                warm = self._read(fd, buf, offset + i, name)
                if self.checks[n] and self.finite[n] and not bits_finite(buf, dst.dtype):
                    self.finite[n] = False
                if self.tally is not None:
                    self.tally.add(name, offset + i, buf)
                if warm and mapped is not None and i + step < span.nbytes and self.leases.intact():
                    self._copy_mapped(n, span[i + step :], mapped, offset + i + step)
                    return

    def _copy_mapped(self, n: int, rest: Any, mapped: Any, offset: int) -> None:
        """``rest`` of a span copied from ``mapped`` (the file's bytes, the file leased) by the compiled kernel, each
        element checked between its load and its store; with no ``tally`` to read it back, by non-temporal stores (the
        destination's old lines aren't read first; 256 MiB here: 19.1 against 24.0 ms, bench/RESULTS.md wave 8)."""
        dst, _fd, _start, name = self.fills[n]
        rule = bit_rule(dst.dtype) if self.checks[n] else None
        width, mask, value = (rule.width, rule.mask, rule.value) if rule else (1, 0, 0)
        kernels = native()
        if self.tally is None:
            bad = kernels.copy(rest, mapped[offset : offset + rest.nbytes], width, mask, value, True)
        else:
            bad, step = False, tensorcopy.READ_BYTES // width * width
            for i in range(0, rest.nbytes, step):
                buf = rest[i : i + step]
                bad = kernels.copy(buf, mapped[offset + i : offset + i + buf.nbytes], width, mask, value, False) or bad
                self.tally.add(name, offset + i, buf)
        if bad:
            self.finite[n] = False

    def _read(self, fd: int, buf: Any, offset: int, name: str) -> bool:
        """``buf`` filled from ``fd`` at ``offset``; True when the page cache held it all (read without waiting)."""
        done, total = 0, buf.nbytes
        if self.nowait:  # the page cache first, without waiting: a miss means the file is cold, so read ahead
            try:
                done = max(0, os.preadv(fd, [buf], offset, self.nowait))
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.nowait = 0
            if done < total:
                self._advise(fd, offset + done)
        warm = done == total and self.nowait != 0
        while done < total:
            got = os.preadv(fd, [buf[done:]], offset + done)
            if got <= 0:
                raise FormatError(f"{name}: ends at byte {offset + done}, but bytes {offset}..{offset + total} are "
                                  "needed: the file was truncated while it was read")
            done += got
        return warm

    def _advise(self, fd: int, offset: int) -> None:
        """POSIX_FADV_WILLNEED from ``offset`` for :data:`READAHEAD_BYTES`, unless half of that is asked for."""
        with self.lock:
            start, end = self.ahead.get(fd, (0, 0))
            if start <= offset and offset + READAHEAD_BYTES // 2 <= end:
                return
            self.ahead[fd] = (offset, offset + READAHEAD_BYTES)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, READAHEAD_BYTES, os.POSIX_FADV_WILLNEED)
