"""Atomic output: write a temp file beside dst, fsync, rename over dst; on any failure clean up.

Nothing new ever appears at dst unless the whole write succeeded; an existing dst is untouched
unless ``force``; dst may never be the source (also through symlinks or hard links). A directory
output replaces, with ``force``, only the files that output consists of (:class:`DirOutput`).
SIGINT, SIGTERM and SIGHUP clean up like any failure (:mod:`ckptfix.core.interrupts`); only SIGKILL or
a power loss can leave a temp behind, and the next write into that directory sweeps it
(:func:`sweep_stale_temps`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

from . import interrupts
from ..errors import NOTHING_WRITTEN, CkptfixError, DestinationError, pass_flag

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, so no sweep either
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".ckptfix-tmp"  # files: .NAME.XXXXXXXX.ckptfix-tmp; directories: .NAME.ckptfix-tmp-XXXXXXXX
_TEMP_FILE = re.compile(r"\..+\.[a-z0-9_]{8}\.ckptfix-tmp")
_TEMP_DIR = re.compile(r"\..+\.ckptfix-tmp-[a-z0-9_]{8}")


def check_destination(src: str, dst: str, force: bool) -> None:
    """Refuse dst == src (by inode, so links count) and an existing dst without force."""
    if os.path.lexists(dst):
        if _same_file(src, dst):
            raise DestinationError(f"{dst}: is the source file itself; write to a new path")
        if os.path.isdir(dst):
            raise DestinationError(f"{dst}: is a directory; give a file path")
        if not force:
            raise DestinationError(f"{dst}: already exists; {pass_flag('force')} to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DestinationError(f"{dst}: directory {parent} does not exist")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def sha256_file(path: str, advance: Callable[[int], None] | None = None) -> str:
    """Hex SHA-256 of a file, read in bounded chunks; ``advance(nbytes)`` after each (a progress line)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 * 2**20), b""):
            h.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return h.hexdigest()


def hashed_name(dst: str, sha256: str) -> str:
    """``resnet18.pth`` → ``resnet18-1a2b3c4d.pth``: torch.hub's ``check_hash`` file-name convention."""
    head, name = os.path.split(dst)
    stem, dot, ext = name.partition(".")
    stem = re.sub(r"-[0-9a-f]{8,}$", "", stem)  # re-hashing replaces an old hash
    return os.path.join(head, f"{stem}-{sha256[:8]}{dot}{ext}")


@contextlib.contextmanager
def atomic_path(dst: str, finalize: Callable[[str], str] | None = None, notes: list[str] | None = None) -> Iterator[str]:
    """Yield a temp path in dst's directory; on clean exit fsync it and rename it onto dst.

    ``finalize(tmp)`` may name a different final path (e.g. with a hash in it) once the data is
    written. On any exception (KeyboardInterrupt, SIGTERM and SIGHUP included: see
    :mod:`ckptfix.core.interrupts`) the temp file is removed and dst untouched. Temp files that killed
    runs left in the directory are swept first (``notes`` says which).
    """
    parent = os.path.dirname(os.path.abspath(dst)) or "."
    with interrupts.signals_as_interrupts():
        _note_swept(sweep_stale_temps(parent), parent, notes)
        try:
            tmp, lock = _locked_temp(lambda: _mkstemp(dst, parent))
        except OSError as e:
            raise DestinationError(f"{dst}: can't create a file in {parent}: {e.strerror or e}") from None
        try:
            os.chmod(tmp, _output_mode(dst))
            yield tmp
            _fsync_path(tmp)
            final = finalize(tmp) if finalize is not None else dst
            with interrupts.held(written=True):
                os.replace(tmp, final)
                _fsync_dir(parent)
        except BaseException as e:
            with interrupts.held():
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            reraise_write_failure(e, dst)
        finally:
            os.close(lock)


def _mkstemp(dst: str, parent: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dst)}.", suffix=TEMP_SUFFIX, dir=parent)
    os.close(fd)
    return tmp


def reraise_write_failure(e: BaseException, dst: str) -> NoReturn:
    """Raise what a failed write means once its temp output is gone: the interrupt behind it, a
    DestinationError for an I/O failure, else the error itself."""
    interrupt = interrupts.cause(e)
    if interrupt is not None and interrupt is not e:
        raise interrupt from None
    foreign = not isinstance(e, CkptfixError)  # DestinationError is an OSError, LoadError a RuntimeError too
    if foreign and (isinstance(e, OSError) or (isinstance(e, RuntimeError) and "write" in str(e).lower())):
        raise DestinationError(f"{dst}: write failed: {getattr(e, 'strerror', None) or e}; {NOTHING_WRITTEN}") from None
    raise e


def _output_mode(dst: str) -> int:
    """An existing dst's permissions, else what a plain ``open()`` would give (0o666 & ~umask)."""
    try:
        return os.stat(dst).st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _fsync_path(path: str) -> None:
    """fsync ``path`` through a read-only descriptor where fsync takes one (POSIX): an open for writing would break a
    read lease on it (``locations.hold``) and wait on it, this process's own included."""
    with open(path, "rb" if os.name == "posix" else "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_destination_dir(src: str, dst: str, force: bool, output: DirOutput | None = None) -> None:
    """For directory outputs (sharded, DCP): refuse a dst that is or holds the source, is a file,
    or is a non-empty directory without force (with force, one holding a symlink or directory
    under one of ``output``'s names)."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_src == real_dst or real_src.startswith(real_dst.rstrip(os.sep) + os.sep):
        raise DestinationError(f"{dst}: is or holds the source {src}; write to a new directory")
    _check_dir_dst(dst, force)
    if output is not None and os.path.isdir(dst):
        _check_replaceable(dst, output)


def _check_dir_dst(dst: str, force: bool) -> None:
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise DestinationError(f"{dst}: is a file; sharded and DCP checkpoints are written to a directory")
    if os.path.isdir(dst) and os.listdir(dst) and not force:
        raise DestinationError(f"{dst}: is a non-empty directory; {pass_flag('force')} to write into it "
                               "(the files of the output's own names are replaced, everything else is kept)")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DestinationError(f"{dst}: directory {parent} does not exist")


@dataclass(frozen=True)
class DirOutput:
    """The files a directory output consists of: ``force`` replaces these and nothing else.

    ``names`` matches every file name the writer may produce (full match); ``manifest`` is the one
    readers start from (an index json, DCP's ``.metadata``): the old one is removed first and the
    new one moved in last, so a crash in between leaves no manifest naming a mix of old and new files.
    """

    label: str
    names: re.Pattern[str]
    manifest: str


@contextlib.contextmanager
def atomic_dir(dst: str, force: bool, output: DirOutput, notes: list[str] | None = None) -> Iterator[str]:
    """Yield a fresh temp directory beside dst to write ``output``'s files into; on clean exit fsync
    them and move them into place.

    A missing or empty dst: the temp directory is renamed onto it (atomic). A non-empty dst (only
    with ``force``): each file is renamed into it, old files of ``output``'s names that the new
    output doesn't have are removed, and everything else (the user's files, subdirectories,
    symlinks) is kept; ``notes`` says what was kept and removed. On any exception (KeyboardInterrupt,
    SIGTERM and SIGHUP included) the temp directory is removed and dst untouched.
    """
    dst = os.path.abspath(dst)
    parent = os.path.dirname(dst)
    _check_dir_dst(dst, force)
    with interrupts.signals_as_interrupts():
        _note_swept(sweep_stale_temps(parent), parent, notes)
        merge = os.path.isdir(dst) and (bool(os.listdir(dst)) or os.path.islink(dst))
        if merge:
            _check_replaceable(dst, output)
        try:
            tmp, lock = _locked_temp(lambda: tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}{TEMP_SUFFIX}-", dir=parent))
        except OSError as e:
            raise DestinationError(f"{dst}: can't create a directory in {parent}: {e.strerror or e}") from None
        try:
            # mkdtemp makes 0o700: give what the empty dst it replaces had, or what mkdir would
            os.chmod(tmp, os.stat(dst).st_mode & 0o777 if os.path.isdir(dst) else 0o777 & ~_umask())
            yield tmp
            for entry in os.scandir(tmp):
                if entry.is_file(follow_symlinks=False):
                    _fsync_path(entry.path)
            _fsync_dir(tmp)
            if merge:
                _check_produced(tmp, dst, output)
            with interrupts.held(written=True):  # a signal now waits until every file is in place
                if merge:
                    removed = _move_files_into(tmp, dst, output)
                    os.rmdir(tmp)
                    if notes is not None:
                        notes += _merge_notes(dst, output, removed)
                else:
                    _rename_dir(tmp, dst)
                _fsync_dir(parent)
        except BaseException as e:
            with interrupts.held():
                shutil.rmtree(tmp, ignore_errors=True)
            reraise_write_failure(e, dst)
        finally:
            os.close(lock)


def _rename_dir(tmp: str, dst: str) -> None:
    try:
        os.rename(tmp, dst)  # atomic; also replaces an empty directory
    except OSError as e:
        raise DestinationError(f"{dst}: can't be replaced ({e.strerror or e}); {NOTHING_WRITTEN}") from None


def _owned(dst: str, output: DirOutput) -> list[os.DirEntry]:
    return sorted((e for e in os.scandir(dst) if output.names.fullmatch(e.name)), key=lambda e: e.name)


def _check_replaceable(dst: str, output: DirOutput) -> None:
    """Entries of ``output``'s names in dst must be plain files: a symlink or directory there is not ckptfix's."""
    for entry in _owned(dst, output):
        if not entry.is_file(follow_symlinks=False):
            kind = "a symlink" if entry.is_symlink() else "a directory" if entry.is_dir() else "not a regular file"
            raise DestinationError(
                f"{entry.path}: is {kind}, where the {output.label} output has a file of that name; ckptfix "
                "replaces only regular files it would write: move it away, or write to another directory"
            )


def _check_produced(tmp: str, dst: str, output: DirOutput) -> None:
    for entry in os.scandir(tmp):
        if not (entry.is_file(follow_symlinks=False) and output.names.fullmatch(entry.name)):
            raise DestinationError(f"{dst}: the {output.label} writer made {entry.name!r}, which ckptfix does not move "
                                   f"into an existing directory; nothing in {dst} was changed (a bug in ckptfix)")


def _move_files_into(tmp: str, dst: str, output: DirOutput) -> list[str]:
    """Old manifest out, stale files of ``output``'s names out, new files in, new manifest last.

    Returns the old files removed (not replaced by a new file of the same name).
    """
    new = sorted(os.listdir(tmp))
    old = {e.name for e in _owned(dst, output)}
    removed = sorted(old - set(new))
    step = "removing the old " + output.manifest
    try:
        if output.manifest in old:
            os.unlink(os.path.join(dst, output.manifest))
        step = "removing old files"
        for name in removed:
            if name != output.manifest:
                os.unlink(os.path.join(dst, name))
        step = "moving the new files in"
        for name in sorted(new, key=lambda n: n == output.manifest):
            os.replace(os.path.join(tmp, name), os.path.join(dst, name))
    except OSError as e:
        raise DestinationError(
            f"{dst}: {step} failed ({e.strerror or e}): {dst} holds no complete {output.label} checkpoint now "
            "(its other files are untouched); run the conversion again"
        ) from None
    _fsync_dir(dst)
    return removed


def _merge_notes(dst: str, output: DirOutput, removed: list[str]) -> list[str]:
    notes = []
    kept = [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in sorted(os.scandir(dst), key=lambda e: e.name)
            if not output.names.fullmatch(e.name)]
    if kept:
        notes.append(f"kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} in {dst} that are not part of a "
                     f"{output.label} output, untouched: {_names(kept)}")
    if removed:
        notes.append(f"removed {len(removed)} file(s) of the previous {output.label} output that the new one doesn't "
                     f"have: {_names(removed)}")
    return notes


def _names(names: list[str], limit: int = 10) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _locked_temp(make: Callable[[], str]) -> tuple[str, int]:
    """Create a temp file or directory with ``make`` and take an exclusive flock on it, held until the
    returned fd is closed: a later run's sweep deletes only temps whose lock it can take.

    If a sweep took the new temp in the instant before the lock (it is then gone), make another.
    """
    for _ in range(10):
        path = make()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if os.path.isdir(path) else 0))
        except FileNotFoundError:
            continue
        if fcntl is None:
            return path, fd
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while a sweep holds it
        with contextlib.suppress(OSError):
            if os.path.samestat(os.lstat(path), os.fstat(fd)):
                return path, fd
        os.close(fd)
    raise DestinationError(f"{path}: a temp file ckptfix made keeps disappearing; is something deleting files there?")


def sweep_stale_temps(directory: str) -> list[str]:
    """Delete the temp files and directories that killed ckptfix runs (SIGKILL, power loss) left in
    ``directory``: names of ckptfix's temp patterns only, and only those whose lock no live writer
    holds. Returns the names removed."""
    if fcntl is None:
        return []
    try:
        entries = [e for e in os.scandir(directory) if _TEMP_FILE.fullmatch(e.name) or _TEMP_DIR.fullmatch(e.name)]
    except OSError:
        return []
    swept = []
    for entry in entries:
        is_dir = bool(_TEMP_DIR.fullmatch(entry.name))
        try:  # O_NOFOLLOW: a symlink of that name is not ours; O_NONBLOCK: nor is a FIFO
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_DIRECTORY if is_dir else 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            if not os.path.samestat(os.lstat(entry.path), st):
                continue
            if is_dir:
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            swept.append(entry.name + ("/" if is_dir else ""))
        except OSError:
            continue
        finally:
            os.close(fd)
    return swept


def _note_swept(swept: list[str], directory: str, notes: list[str] | None) -> None:
    if swept and notes is not None:
        notes.append(f"removed {len(swept)} temp file(s) a killed ckptfix run left in {directory}: {_names(swept)}")


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
