"""A verb holds a read lease on every local file it reads until it is done (``locations.session``): another process
that truncates the file — ``torch.save`` to the same path, a training run's ``last.pth`` — waits, instead of cutting
what the verb has mapped (reading a mapped page past the new end is SIGBUS: the process killed, no message). Each
verb runs in a child process (tests/concurrent_writer.py) whose hook starts the writer just after the verb mapped
the file; the verb must finish on the file as it was, its exit code as on an untouched file, the writer still
waiting, and the cut must land after."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

from ckptfix.core import locations, rollback
from tests import concurrent_writer

#: (verb's arguments, FILE standing for the file cut, OTHER for an untouched copy of it), the formats it maps
VERBS = {
    "verify": (["verify", "FILE"], ("safetensors", "pth")),
    "verify --structure-only": (["verify", "FILE", "--structure-only"], ("pth",)),
    "scan": (["scan", "FILE"], ("pth",)),
    "inspect": (["inspect", "FILE"], ("pth",)),
    "diff": (["diff", "FILE", "OTHER"], ("safetensors", "pth")),
}
CASES = [(verb, fmt) for verb, (_argv, fmts) in VERBS.items() for fmt in fmts]


@pytest.fixture
def leasing(tmp_path: Path) -> Path:
    if not concurrent_writer.leases_work(tmp_path):
        pytest.skip(f"{tmp_path}: no read leases here")
    return tmp_path


def _save(folder: Path, fmt: str) -> Path:
    sd = {f"layer{i}.weight": torch.randn(512, 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    path = folder / f"m.{fmt}"  # 16 MiB: a mapped read over most of it after the cut would be SIGBUS
    st.save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    return path


@pytest.mark.parametrize("verb, fmt", CASES)
def test_a_writer_waits_for_the_verb(leasing: Path, verb: str, fmt: str) -> None:
    path = _save(leasing, fmt)
    other = leasing / f"other.{fmt}"
    shutil.copyfile(path, other)
    size = os.path.getsize(path)
    argv = [str(path) if a == "FILE" else str(other) if a == "OTHER" else a for a in VERBS[verb][0]]
    out = concurrent_writer.run(path, argv, "map", leased=True)
    assert "signal" not in out, out  # (-7: SIGBUS)
    assert out["cut"], "the verb never mapped the file"
    assert out["code"] == 0 and out["waited"] and out["waiting_at_end"], out
    assert out["size_after"] == size // 4


def test_a_holder_leases_each_local_file_once_and_releases_them(tmp_path: Path) -> None:
    if not concurrent_writer.leases_work(tmp_path):
        pytest.skip(f"{tmp_path}: no read leases here")
    path = _save(tmp_path, "safetensors")
    with locations.holding() as h, locations.session():
        assert h.hold(str(path)) and h.hold(str(tmp_path / "." / path.name))  # the same file: one lease
        assert not h.hold(str(tmp_path))  # a directory: none
        locations.open_source(str(path)).close()  # (inside a session: held by the holder it joined)
        fds = [fd for fd in h.leases.values() if fd is not None]
        assert len(fds) == 1 and rollback.intact(fds[0])
        temp = tmp_path / ".out.pth.x.ckptfix-tmp"  # an output of this process's: never held
        temp.write_bytes(b"x")
        assert not h.hold(str(temp))
    assert h.leases == {}
    with pytest.raises(OSError):
        os.fstat(fds[0])  # closed: the lease dropped


def test_no_lease_where_the_file_is_open_for_writing(tmp_path: Path) -> None:
    """A writer that has the file open already: no lease (F_SETLEASE refuses), the verb reads as before."""
    path = _save(tmp_path, "safetensors")
    with open(path, "r+b"), locations.holding() as h:
        assert not h.hold(str(path))
        assert h.leases == {os.path.realpath(path): None}


def test_a_child_forked_while_a_lease_is_held_does_not_keep_it(tmp_path: Path) -> None:
    """A child forked while a verb holds a lease (a DataLoader worker started beside a load) closes its copy of the
    lease's descriptor: once the verb is done, a writer goes on at once — not after lease-break-time (45 s) — though
    the child lives on."""
    if not concurrent_writer.leases_work(tmp_path):
        pytest.skip(f"{tmp_path}: no read leases here")
    path = _save(tmp_path, "safetensors")
    r, w = os.pipe()
    with locations.holding() as h:
        assert h.hold(str(path))
        pid = os.fork()
        if pid == 0:  # the child: lives until the test is done
            try:
                os.close(w)
                os.read(r, 1)
            finally:
                os._exit(0)
    os.close(r)
    try:
        cut = "import os, sys; os.truncate(sys.argv[1], 10)"
        subprocess.run([sys.executable, "-c", cut, str(path)], check=True, timeout=40)  # (waiting: 45 s)
        assert os.path.getsize(path) == 10
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
