"""What the benchmarks measure with, in one place: peak anonymous memory (RssAnon, from /proc/PID/status:
file-backed and shared pages excluded, so a mapped checkpoint doesn't count, a copy of it does), sampled
every 5 ms from outside the process, and a file's pages dropped from the page cache for a cold read.

    from measure import measure             # a command's wall seconds and peak RssAnon
    from measure import AnonSampler         # RssAnon of running processes over time
    from measure import drop_from_page_cache, read_through
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

INTERVAL = 0.005


def rss_anon(pid: int | str = "self") -> int | None:
    """The process's resident anonymous memory in bytes; None once it has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(cmd: list[str], env: dict[str, str] | None = None, settle: float = 0.0) -> tuple[float, int]:
    """Wall seconds and peak RssAnon (bytes) of one command, sampled every 5 ms; a command that prints
    ``call_s=SECONDS`` (bench/convert.py's ``API_CALL``) gives that instead of its wall time. ``settle``:
    seconds to pause after a ``sync`` first, so the last command's writeback doesn't land on this one."""
    if settle:
        os.sync()
        time.sleep(settle)
    start = time.perf_counter()
    stdout = tempfile.TemporaryFile()  # a file, not a pipe: a long output can't block the command
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, rss_anon(proc.pid) or 0)
        time.sleep(INTERVAL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()}")
    stdout.seek(0)
    call = [line for line in stdout.read().decode().splitlines() if line.startswith("call_s=")]
    return (float(call[0].split("=")[1]) if call else wall), peak


class AnonSampler:
    """Samples the RssAnon of the processes it is given every 5 ms on a thread, with ``time.monotonic()``
    stamps (one clock for every process on the machine), so a process can report the window of one call
    and :meth:`peak` gives the highest sample inside it.

        with AnonSampler() as s:
            s.watch(proc.pid)
            ...
        s.peak(proc.pid, start, end)
    """

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        with self._lock:
            self.samples.setdefault(pid, [])

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pids = list(self.samples)
            for pid in pids:
                value = rss_anon(pid)
                if value is not None:
                    self.samples[pid].append((time.monotonic(), value))
            self._stop.wait(self.interval)

    def peak(self, pid: int, start: float, end: float) -> int | None:
        """The highest sample of ``pid`` taken between ``start`` and ``end`` (monotonic seconds)."""
        with self._lock:
            inside = [v for t, v in self.samples.get(pid, []) if start <= t <= end]
        return max(inside, default=None)

    def forget(self, pid: int) -> None:
        with self._lock:
            self.samples.pop(pid, None)


def read_through(path: str | os.PathLike[str]) -> None:
    """Read the whole file once, so its pages are in the page cache (a warm run)."""
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """How many of the file's bytes sit in the page cache (mincore(2) over a mapping of it)."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            if libc.mincore(addr, size, pages) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(p & 1 for p in pages) * mmap.PAGESIZE


def drop_from_page_cache(path: str | os.PathLike[str]) -> int:
    """``os.sync()``, then POSIX_FADV_DONTNEED over the whole file (a cold run); returns the bytes that
    stayed cached: 0 unless a process still maps them or the file system keeps files in memory (tmpfs)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(path)
