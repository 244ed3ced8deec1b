"""What the benchmarks measure with, in one place: peak anonymous memory (RssAnon, from /proc/PID/status:
file-backed and shared pages excluded, so a mapped checkpoint doesn't count, a copy of it does), sampled
every 5 ms from outside the process, and a file's pages dropped from the page cache for a cold read.

    from measure import measure             # a command's wall seconds and peak RssAnon
    from measure import AnonSampler         # RssAnon of running processes over time
    from measure import drop_from_page_cache, read_through
"""

from __future__ import annotations

import os
import sys
import subprocess
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests/page_cache.py, standard library only
from tests.page_cache import drop_from_page_cache, resident_bytes  # noqa: E402,F401  (re-exported for the benches)

INTERVAL = 0.005


def _proc_kib(pid: int | str, table: str, field: str) -> int | None:
    """``field`` (a ``kB`` line) of ``/proc/PID/TABLE`` in bytes; None once the process has gone, or without it."""
    try:
        with open(f"/proc/{pid}/{table}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_anon(pid: int | str = "self") -> int | None:
    """The process's resident anonymous memory in bytes; None once it has gone."""
    return _proc_kib(pid, "status", "RssAnon")


def pss_anon(pid: int | str = "self") -> int | None:
    """The process's proportional share of anonymous memory in bytes (``Pss_Anon``, smaps_rollup): a page a forked
    child still shares with its parent counts half in each, so a process tree's sum counts it once; None once gone
    (or on a kernel without the field)."""
    return _proc_kib(pid, "smaps_rollup", "Pss_Anon")


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


def busy(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` CPU-bound processes, spinning before the run starts (a machine whose cores are shared: a server's
    other workers, a CI neighbour)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    if spinners:
        time.sleep(0.3)
    return spinners
