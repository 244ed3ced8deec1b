"""Another writer cutting a file while a verb reads it: a ckptfix CLI command run in a child process (a SIGBUS kills
the child, not the test run), with a hook that truncates the file the first time the verb reaches a given point.

Two ways, as a file is found in the world:

- ``leased``: the cut is another process's ``os.truncate``, started at the hook; the hook goes on once that writer
  is seen waiting on the verb's read lease (``/proc/locks`` says the lease is BREAKING) or, with no lease, once it
  has cut. The verb should finish on the file as it was, the writer still waiting; its cut lands after.
- not leased (``rollback.SETLEASE`` off in the child, as on a filesystem without leases): the hook cuts the file
  itself, at once.

The hooks: ``map`` (just after a mapping of the file is made: ``torch.UntypedStorage.from_file`` or ``mmap.mmap``,
before the verb reads through it), ``crc`` (the CRC-32 pass: ``positional.crc32``), ``copy`` (the convert's copy:
``os.copy_file_range`` / ``os.pwrite``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD = r"""
import json, mmap, os, subprocess, sys, threading, time
spec = json.loads(sys.argv[1])
path, size = spec["path"], os.path.getsize(spec["path"])
ino = os.stat(path).st_ino
from ckptfix.core import positional, rollback
if not spec["leased"]:
    rollback.SETLEASE = None
state, lock = {}, threading.Lock()
CUT = "import os, sys, time; os.truncate(sys.argv[1], int(sys.argv[2])); print(time.monotonic(), flush=True)"
real_drop = rollback.drop

def drop(fd):  # the last release of this file's lease, timed (CLOCK_MONOTONIC: the writer's clock too)
    if os.fstat(fd).st_ino == ino:
        state["released"] = time.monotonic()
    real_drop(fd)

rollback.drop = drop

def breaking():
    with open("/proc/locks") as f:
        return any(f" {os.getpid()} " in line and "BREAKING" in line and line.split()[5].endswith(f":{ino}")
                   for line in f)

def cut():
    with lock:
        if "cut" in state:
            return
        state["cut"] = True
        if not spec["leased"]:
            os.truncate(path, size // 4)
            return
        writer = subprocess.Popen([sys.executable, "-c", CUT, path, str(size // 4)], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while writer.poll() is None and not breaking() and time.monotonic() < deadline:
            time.sleep(0.005)
        state["writer"] = writer
        state["waited"] = writer.poll() is None and breaking()

def hooked(real):
    def call(*args, **kwargs):
        cut()
        return real(*args, **kwargs)
    return call

if spec["hook"] == "map":
    import torch
    real_from_file, real_mmap = torch.UntypedStorage.from_file, mmap.mmap
    def from_file(name, *args, **kwargs):
        made = real_from_file(name, *args, **kwargs)
        if os.path.abspath(name) == path:
            cut()
        return made
    class Mapped(real_mmap):  # (a class still: readers ask isinstance(buf, mmap.mmap))
        def __new__(cls, fd, *args, **kwargs):
            made = super().__new__(cls, fd, *args, **kwargs)
            if fd >= 0 and os.fstat(fd).st_ino == ino:
                cut()
            return made
    torch.UntypedStorage.from_file, mmap.mmap = staticmethod(from_file), Mapped
elif spec["hook"] == "crc":
    positional.crc32 = hooked(positional.crc32)
else:
    os.copy_file_range, os.pwrite = hooked(os.copy_file_range), hooked(os.pwrite)
from ckptfix.cli import main
sys.argv = ["ckptfix", *spec["argv"]]
try:
    main()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
else:
    code = 0
writer, still = state.get("writer"), False
if writer is not None:  # the writer's cut landed only after the verb's last lease on the file was released
    cut_at = writer.communicate(timeout=60)[0].strip()
    still = bool(cut_at) and "released" in state and float(cut_at) >= state["released"]
print(json.dumps({"code": code, "cut": "cut" in state, "waited": state.get("waited", False), "waiting_at_end": still,
                  "size_after": os.path.getsize(path)}))
sys.exit(0)
"""


def run(path: Path, argv: list[str], hook: str, leased: bool, timeout: float = 300) -> dict[str, Any]:
    """``ckptfix ARGV`` in a child, ``path`` cut to a quarter at ``hook``: the child's outcome (``code``: the command's
    exit code; ``cut``: the hook ran; ``waited``: the writer was seen waiting on the verb's lease; ``size_after``),
    with its ``stderr``; ``signal`` where the child was killed (SIGBUS: -7)."""
    spec = {"path": str(Path(path).resolve()), "argv": argv, "hook": hook, "leased": leased}
    run_ = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in run_.stdout.splitlines() if line.startswith("{")]
    if run_.returncode != 0 or not lines:
        return {"signal": run_.returncode, "stderr": run_.stderr[-3000:]}
    return {**json.loads(lines[-1]), "stderr": run_.stderr[-3000:], "stdout": run_.stdout[-3000:]}


def leases_work(folder: Path) -> bool:
    """A read lease can be taken on a file in ``folder`` (Linux, a filesystem with leases, this user's file)."""
    from ckptfix.core import rollback

    probe = folder / "lease-probe"
    probe.write_bytes(b"x")
    fd = rollback.lease(str(probe))
    if fd is None:
        return False
    rollback.drop(fd)
    return True
