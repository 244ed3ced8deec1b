"""Write-path faults: a full disk, Ctrl-C, SIGTERM, SIGHUP, a read-only directory, dst == src, kill -9.

Whatever happens, the old dst (if any) is intact, nothing new appears at dst, and no temp file is
left behind — except after ``kill -9``, which no process can clean up after: then dst is still
absent, the only leftover is the hidden ``.NAME.*.ckptfix-tmp`` file, and the next write into that
directory sweeps it (never a live writer's).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import DestinationError

# (source fixture, output name): the streamed zip and safetensors writers, and the in-memory ones.
ROUTES = [("mlp_ddp.pth", "out.safetensors"), ("mlp_ddp.pth", "out.pth"),
          ("mlp_legacy.pth", "out.pth"), ("mlp_legacy.pth", "out.safetensors")]


class _Disk:
    """Lets ``limit`` bytes through every write path, then raises ``error``."""

    def __init__(self, limit: int, error: BaseException):
        self.left, self.error, self.written = limit, error, 0

    def take(self, n: int) -> None:
        if n > self.left:
            raise self.error
        self.left -= n
        self.written += n


class _File:
    def __init__(self, f: Any, disk: _Disk):
        self._f, self._disk = f, disk

    def write(self, data: Any) -> int:
        self._disk.take(len(memoryview(data).cast("B")))
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def _fail_writes(monkeypatch: pytest.MonkeyPatch, disk: _Disk) -> None:
    """Route every write ckptfix's writers make (file objects, pwrite, copy_file_range) through ``disk``."""
    import builtins

    from ckptfix.formats import safetensors as safetensors_file
    from ckptfix.formats.torchsave import torch_io as torchfile, records

    real_open, real_pwrite, real_cfr = builtins.open, os.pwrite, os.copy_file_range

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return _File(f, disk) if "w" in mode else f

    def pwrite(fd: int, data: Any, offset: int) -> int:
        disk.take(len(data))
        return real_pwrite(fd, data, offset)

    def copy_file_range(src: int, dst: int, count: int, *args: Any) -> int:
        disk.take(count)
        return real_cfr(src, dst, count, *args)

    for module in (torchfile, safetensors_file, records):
        monkeypatch.setattr(module, "open", fake_open, raising=False)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "copy_file_range", copy_file_range)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("existing", [False, True], ids=["new-dst", "replace-dst"])
@pytest.mark.parametrize("src, dst_name", ROUTES)
def test_disk_full_mid_write(src: str, dst_name: str, existing: bool, tmp_path: Path, fixtures_dir: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / dst_name
    if existing:
        dst.write_bytes(b"the old file")
    disk = _Disk(1500, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    _fail_writes(monkeypatch, disk)
    with pytest.raises(DestinationError, match="nothing was written"):
        ckptfix.convert(fixtures_dir / src, dst, force=existing)
    assert disk.written > 0  # it failed mid-write, not before
    assert _leftovers(tmp_path) == ([dst_name] if existing else [])
    if existing:
        assert dst.read_bytes() == b"the old file"


@pytest.mark.parametrize("src, dst_name", ROUTES)
def test_keyboard_interrupt_mid_write(src: str, dst_name: str, tmp_path: Path, fixtures_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch, cli_runner) -> None:
    dst = tmp_path / dst_name
    dst.write_bytes(b"the old file")
    disk = _Disk(1500, KeyboardInterrupt())
    _fail_writes(monkeypatch, disk)
    with pytest.raises(KeyboardInterrupt):
        ckptfix.convert(fixtures_dir / src, dst, force=True)
    assert disk.written > 0
    assert _leftovers(tmp_path) == [dst_name] and dst.read_bytes() == b"the old file"
    disk.left = 1500
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / src), str(dst), "--force", "-q"])
    assert res.exit_code == 130 and "interrupted; nothing was written" in res.stderr
    assert _leftovers(tmp_path) == [dst_name] and dst.read_bytes() == b"the old file"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory no one can create files in: mode 0555, or for root (which ignores modes) +i."""
    d = tmp_path / "ro"
    d.mkdir()
    (d / "out.pth").write_bytes(b"the old file")
    undo: list[str] = []
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
        undo = ["chattr", "-i", str(d)]
    else:
        pytest.skip("running as root without chattr: no way to make a read-only directory here")
    try:
        probe = d / "probe"
        with pytest.raises(OSError):
            probe.write_bytes(b"")
        yield d
    finally:
        if undo:
            subprocess.run(undo, check=True)
        d.chmod(0o755)


def test_read_only_destination_directory(read_only_dir: Path, fixtures_dir: Path, cli_runner) -> None:
    for dst in (read_only_dir / "new.pth", read_only_dir / "out.pth"):
        res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(dst), "--force", "-q"])
        assert res.exit_code == 1 and f"can't create a file in {read_only_dir}" in res.stderr
        assert res.stderr.count("\n") == 1
    assert _leftovers(read_only_dir) == ["out.pth"] and (read_only_dir / "out.pth").read_bytes() == b"the old file"


def test_read_only_destination_simulated(tmp_path: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(DestinationError, match="Permission denied"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["same-path", "dot-slash", "symlink", "symlinked-directory", "hardlink"])
def test_dst_is_src(how: str, tmp_path: Path, fixtures_dir: Path, cli_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src.pth"
    shutil.copy(fixtures_dir / "mlp_ddp.pth", src)
    before = src.read_bytes()
    monkeypatch.chdir(tmp_path)
    if how == "same-path":
        dst = str(src)
    elif how == "dot-slash":
        dst = "./src.pth"
    elif how == "symlink":
        os.symlink(src, tmp_path / "link.pth")
        dst = str(tmp_path / "link.pth")
    elif how == "symlinked-directory":
        os.symlink(tmp_path, tmp_path / "alias")
        dst = str(tmp_path / "alias" / "src.pth")
    else:
        os.link(src, tmp_path / "hard.pth")
        dst = str(tmp_path / "hard.pth")
    listing = _leftovers(tmp_path)
    for extra in ([], ["--force"]):
        res = cli_runner.invoke(cli, ["convert", "src.pth", dst, "-q", *extra])
        assert res.exit_code == 1 and "is the source file itself" in res.stderr
    assert src.read_bytes() == before and _leftovers(tmp_path) == listing


def test_existing_dst_without_force(tmp_path: Path, fixtures_dir: Path, cli_runner) -> None:
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"the old file")
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(dst), "-q"])
    assert res.exit_code == 1 and "already exists; pass --force" in res.stderr
    assert dst.read_bytes() == b"the old file" and _leftovers(tmp_path) == ["out.safetensors"]


@pytest.mark.slow
def test_kill_9_mid_write_leaves_nothing_at_dst(tmp_path: Path) -> None:
    src, dst = tmp_path / "big.pth", tmp_path / "out" / "big.safetensors"
    dst.parent.mkdir()
    torch.save({"w": torch.zeros(64 * 2**20 // 4 * 4)}, src, _use_new_zipfile_serialization=False)  # 256 MiB
    proc = subprocess.Popen([sys.executable, "-m", "ckptfix", "convert", str(src), str(dst), "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    tmp: list[Path] = []
    while not tmp and proc.poll() is None and time.monotonic() < deadline:
        tmp = list(dst.parent.glob(".big.safetensors.*.ckptfix-tmp"))
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert tmp and proc.returncode == -signal.SIGKILL, "the write finished before the kill"
    assert not dst.exists()
    assert all(p.name.startswith(".big.safetensors.") and p.name.endswith(".ckptfix-tmp")
               for p in dst.parent.iterdir())


# --- SIGTERM / SIGHUP / SIGINT mid-write, a real process; the next run sweeps what SIGKILL left ---

# ckptfix's CLI in a child whose first file write (ckptfix's writers, or torch.save inside DCP)
# completes, touches $READY and then waits: a signal then lands mid-output, temp data on disk.
SLOW_CHILD = """
import os, sys, time
import torch
import ckptfix.formats as formats
from ckptfix.formats import base

def slow(real):
    def first_write_then_wait(*args, **kwargs):
        out = real(*args, **kwargs)
        if not os.path.exists(os.environ["READY"]):
            open(os.environ["READY"], "w").close()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)
        return out
    return first_write_then_wait

formats.write = slow(formats.write)
base.WritePlan.write = slow(base.WritePlan.write)
torch.save = slow(torch.save)
from ckptfix.cli import main
sys.argv[0] = "ckptfix"
main()
"""

# output → (destination name, extra convert options)
SIGNAL_OUTPUTS = {"file": ("out.safetensors", []), "sharded": ("shards", ["--max-shard-size", "1KB"]),
                  "dcp": ("dcp_out", ["--format", "dcp"])}


def _start_slow(src: Path, dst: Path, extra: list[str], ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, "convert", str(src), str(dst), "-q", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "READY": str(ready)})
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), f"the child never started writing: {proc.communicate(timeout=60)}"
    return proc


def _error_line(stderr: str) -> str:
    """The one ``Error:`` line, checked to be the end of stderr and not after a traceback (a warning
    Python prints before it is not ckptfix's to silence)."""
    assert "Traceback" not in stderr and stderr.count("Error:") == 1 and stderr.endswith("\n"), stderr
    return stderr.splitlines()[-1]


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".ckptfix-tmp" in p.name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("output", SIGNAL_OUTPUTS)
def test_signal_mid_write_removes_the_temp(output: str, sig: signal.Signals, tmp_path: Path, fixtures_dir: Path) -> None:
    name, extra = SIGNAL_OUTPUTS[output]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _start_slow(fixtures_dir / "mlp_ddp.pth", out_dir / name, extra, tmp_path / "ready")
    assert _temps(out_dir)  # the temp output is there, part-written
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    word = "interrupted" if sig == signal.SIGINT else f"terminated ({sig.name})"
    assert proc.returncode == 128 + sig and _error_line(stderr) == f"Error: {word}; nothing was written" and stdout == ""
    assert list(out_dir.iterdir()) == []


def test_library_callers_get_a_keyboard_interrupt_and_their_handlers_back(tmp_path: Path, fixtures_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM mid-write in a library call: temp removed, ckptfix.errors.Interrupted (a KeyboardInterrupt)
    raised, the default handlers restored; an application's own handler is never replaced."""
    import ckptfix.formats as formats
    from ckptfix.errors import Interrupted
    from ckptfix.formats import base

    def then_sigterm(real: Any) -> Any:
        def write_then_sigterm(*args: Any, **kwargs: Any) -> Any:
            notes = real(*args, **kwargs)
            signal.raise_signal(signal.SIGTERM)
            return notes
        return write_then_sigterm

    monkeypatch.setattr(formats, "write", then_sigterm(formats.write))
    monkeypatch.setattr(base.WritePlan, "write", then_sigterm(base.WritePlan.write))  # torch-free writes
    with pytest.raises(KeyboardInterrupt) as info:
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.safetensors")
    assert isinstance(info.value, Interrupted) and info.value.exit_code == 143 and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.safetensors")  # the application's handler runs
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM] and (tmp_path / "o.safetensors").exists()


def test_signal_during_the_final_rename_lets_it_finish() -> None:
    from ckptfix.core import interrupts
    from ckptfix.errors import Interrupted

    done = []
    with pytest.raises(Interrupted) as info, interrupts.signals_as_interrupts():
        with interrupts.held(written=True):
            signal.raise_signal(signal.SIGHUP)
            done.append("renamed")
    assert done == ["renamed"] and info.value.written and info.value.exit_code == 129
    assert "the output was already complete" in info.value.describe()
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


def test_interruptible_inside_held_lets_signals_through_then_holds_again() -> None:
    """interruptible(): a signal held before it is raised on entry, one inside at once; held again after it, the
    next waits and says the held work's ``outcome``."""
    from ckptfix.core import interrupts
    from ckptfix.errors import Interrupted

    done = []
    with pytest.raises(Interrupted) as info, interrupts.signals_as_interrupts():
        with interrupts.held(outcome="the work was done first"):
            signal.raise_signal(signal.SIGHUP)
            with pytest.raises(Interrupted), interrupts.interruptible():
                done.append("never")
            with pytest.raises(Interrupted), interrupts.interruptible():
                signal.raise_signal(signal.SIGHUP)
                done.append("never")
            signal.raise_signal(signal.SIGHUP)
            done.append("held")
    assert done == ["held"] and str(info.value) == "terminated (SIGHUP); the work was done first"
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL


@pytest.mark.parametrize("signals", [("SIGINT",), ("SIGINT", "SIGINT"), ("SIGTERM",), ("SIGHUP",)], ids="+".join)
def test_a_held_region_that_can_be_cut_short(signals: tuple[str, ...]) -> None:
    """held(cut=...): one SIGINT waits for the work; a second, or SIGTERM or SIGHUP, raises at once saying ``cut``."""
    from ckptfix.core import interrupts
    from ckptfix.errors import Interrupted

    done = []
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted) as info, interrupts.signals_as_interrupts():
            with interrupts.held(outcome="done first", cut="cut short"):
                for name in signals:
                    signal.raise_signal(signal.Signals[name])
                done.append("all")
    finally:
        signal.signal(signal.SIGINT, previous)
    waited = signals == ("SIGINT",)
    assert done == (["all"] if waited else []) and info.value.signal_name == signals[-1]
    assert str(info.value).endswith("; done first" if waited else "; cut short")


def test_next_run_sweeps_a_killed_writers_temps_but_not_a_live_writers(tmp_path: Path, fixtures_dir: Path,
                                                                       cli_runner) -> None:
    out = tmp_path / "out"
    out.mkdir()
    src = fixtures_dir / "mlp_ddp.pth"
    live = _start_slow(src, out / "live.safetensors", [], tmp_path / "ready-live")
    live_temp = _temps(out)
    # two writers at once (each one's sweep finds the other's temp locked), then both SIGKILLed
    procs = [_start_slow(src, out / f"killed-{name}", extra, tmp_path / f"ready{i}")
             for i, (name, extra) in enumerate([SIGNAL_OUTPUTS["file"], SIGNAL_OUTPUTS["sharded"]])]
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    killed = [t for t in _temps(out) if t not in live_temp]
    assert len(live_temp) == 1 and len(killed) == 2 and {t.endswith(".ckptfix-tmp") for t in killed} == {True, False}
    os.symlink(src, out / ".decoy.abcdefgh.ckptfix-tmp")  # ckptfix's naming, but a symlink: not ckptfix's
    (out / ".notes.ckptfix-tmp.txt").write_text("a user's file")
    try:
        res = cli_runner.invoke(cli, ["convert", str(src), str(out / "next.safetensors"), "-q"])
        assert res.exit_code == 0, res.output
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [*live_temp, "next.safetensors", ".decoy.abcdefgh.ckptfix-tmp", ".notes.ckptfix-tmp.txt"])
        swept = next(line for line in res.output.splitlines() if "temp file(s) a killed ckptfix run left" in line)
        assert all(t in swept for t in killed) and live_temp[0] not in swept
    finally:
        live.send_signal(signal.SIGTERM)
        _stdout, stderr = live.communicate(timeout=60)
    assert live.returncode == 143 and "terminated (SIGTERM)" in stderr
    assert not (out / live_temp[0]).exists() and not (out / "live.safetensors").exists()


@pytest.mark.slow
def test_sigterm_mid_write_of_a_large_file(tmp_path: Path) -> None:
    """No monkeypatching: a 256 MiB conversion gets SIGTERM while its temp file is being written."""
    src, dst = tmp_path / "big.pth", tmp_path / "out" / "big.safetensors"
    dst.parent.mkdir()
    torch.save({"w": torch.zeros(64 * 2**20)}, src, _use_new_zipfile_serialization=False)  # 256 MiB, loaded, not streamed
    proc = subprocess.Popen([sys.executable, "-m", "ckptfix", "convert", str(src), str(dst), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in dst.parent.glob(".big.safetensors.*.ckptfix-tmp")) \
            and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    proc.send_signal(signal.SIGTERM)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, f"the write finished before the signal: {stderr}"
    assert _error_line(stderr) == "Error: terminated (SIGTERM); nothing was written" and list(dst.parent.iterdir()) == []


def test_disk_full_mid_dcp_write(tmp_path: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, cli_runner) -> None:
    """torch's DCP writer streams each record through torch.save's zip writer, which meets the OSError mid-record
    and raises its own RuntimeError ("unexpected pos …") on the way out: the full disk is still what is said."""
    import contextlib

    from torch.distributed.checkpoint import filesystem

    disk = _Disk(1500, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    real_create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real_create_stream(self, path, mode) as stream:
            yield _File(stream, disk) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    dst = tmp_path / "dcp_out"
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(dst), "--format", "dcp"])
    assert disk.written > 0  # it failed mid-write, not before
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("Error: ") and "No space left on device; nothing was written" in res.stderr, res.stderr
    assert _leftovers(tmp_path) == []
