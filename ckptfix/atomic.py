"""Atomic output: write a temp file beside dst, fsync, rename over dst; on any failure clean up.

Nothing new ever appears at dst unless the whole write succeeded; an existing dst is untouched
unless ``force``; dst may never be the source (also through symlinks or hard links).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator

from .errors import DestinationError


def check_destination(src: str, dst: str, force: bool) -> None:
    """Refuse dst == src (by inode, so links count) and an existing dst without force."""
    if os.path.lexists(dst):
        if _same_file(src, dst):
            raise DestinationError(f"{dst}: is the source file itself; write to a new path")
        if os.path.isdir(dst):
            raise DestinationError(f"{dst}: is a directory; give a file path")
        if not force:
            raise DestinationError(f"{dst}: already exists; pass --force (library: force=True) to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DestinationError(f"{dst}: directory {parent} does not exist")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in bounded chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(16 * 2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def hashed_name(dst: str, sha256: str) -> str:
    """``resnet18.pth`` → ``resnet18-1a2b3c4d.pth``: torch.hub's ``check_hash`` file-name convention."""
    head, name = os.path.split(dst)
    stem, dot, ext = name.partition(".")
    stem = re.sub(r"-[0-9a-f]{8,}$", "", stem)  # re-hashing replaces an old hash
    return os.path.join(head, f"{stem}-{sha256[:8]}{dot}{ext}")


@contextlib.contextmanager
def atomic_path(dst: str, finalize: Callable[[str], str] | None = None) -> Iterator[str]:
    """Yield a temp path in dst's directory; on clean exit fsync it and rename it onto dst.

    ``finalize(tmp)`` may name a different final path (e.g. with a hash in it) once the data is
    written. On any exception (KeyboardInterrupt included) the temp file is removed and dst untouched.
    """
    parent = os.path.dirname(os.path.abspath(dst)) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dst)}.", suffix=".ckptfix-tmp", dir=parent)
    except OSError as e:
        raise DestinationError(f"{dst}: can't create a file in {parent}: {e.strerror or e}") from None
    os.close(fd)
    try:
        os.chmod(tmp, _output_mode(dst))
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, finalize(tmp) if finalize is not None else dst)
        _fsync_dir(parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "write" in str(e).lower()):
            raise DestinationError(f"{dst}: write failed: {getattr(e, 'strerror', None) or e}; nothing was written") from None
        raise


def _output_mode(dst: str) -> int:
    """An existing dst's permissions, else what a plain ``open()`` would give (0o666 & ~umask)."""
    try:
        return os.stat(dst).st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _fsync_path(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_destination_dir(src: str, dst: str, force: bool) -> None:
    """For directory outputs (sharded, DCP): refuse a dst that is or holds the source, is a file,
    or is a non-empty directory without force."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_src == real_dst or real_src.startswith(real_dst.rstrip(os.sep) + os.sep):
        raise DestinationError(f"{dst}: is or holds the source {src}; write to a new directory")
    _check_dir_dst(dst, force)


def _check_dir_dst(dst: str, force: bool) -> None:
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise DestinationError(f"{dst}: is a file; sharded and DCP checkpoints are written to a directory")
    if os.path.isdir(dst) and os.listdir(dst) and not force:
        raise DestinationError(f"{dst}: is a non-empty directory; pass --force (library: force=True) to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise DestinationError(f"{dst}: directory {parent} does not exist")


@contextlib.contextmanager
def atomic_dir(dst: str, force: bool) -> Iterator[str]:
    """Yield a fresh temp directory beside dst; on clean exit fsync its files and rename it onto
    dst (a non-empty dst is replaced only with ``force``).

    On any exception (KeyboardInterrupt included) the temp directory is removed and dst untouched.
    """
    dst = os.path.abspath(dst)
    parent = os.path.dirname(dst)
    _check_dir_dst(dst, force)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.ckptfix-tmp-", dir=parent)
    except OSError as e:
        raise DestinationError(f"{dst}: can't create a directory in {parent}: {e.strerror or e}") from None
    try:
        # mkdtemp makes 0o700: give what the replaced dst had, or what mkdir would
        os.chmod(tmp, os.stat(dst).st_mode & 0o777 if os.path.isdir(dst) else 0o777 & ~_umask())
        yield tmp
        for entry in os.scandir(tmp):
            if entry.is_file(follow_symlinks=False):
                _fsync_path(entry.path)
        _fsync_dir(tmp)
        _replace_dir(tmp, dst, force)
        _fsync_dir(parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "write" in str(e).lower()):
            raise DestinationError(f"{dst}: write failed: {getattr(e, 'strerror', None) or e}; nothing was written") from None
        raise


def _replace_dir(tmp: str, dst: str, force: bool) -> None:
    """rename(tmp, dst); a non-empty dst (force only) is moved aside first and removed after."""
    try:
        os.rename(tmp, dst)  # atomic; also replaces an empty directory
        return
    except OSError as e:
        if not (force and os.path.isdir(dst)):
            raise DestinationError(f"{dst}: can't be replaced ({e.strerror or e}); nothing was written") from None
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.ckptfix-old-", dir=os.path.dirname(dst))
    os.rename(dst, os.path.join(aside, "old"))
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(os.path.join(aside, "old"), dst)
        os.rmdir(aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
