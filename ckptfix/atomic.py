"""Atomic output: write a temp file beside dst, fsync, rename over dst; on any failure clean up.

Nothing new ever appears at dst unless the whole write succeeded; an existing dst is untouched
unless ``force``; dst may never be the source (also through symlinks or hard links).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

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


@contextlib.contextmanager
def atomic_path(dst: str) -> Iterator[str]:
    """Yield a temp path in dst's directory; on clean exit fsync it and rename it onto dst.

    On any exception (KeyboardInterrupt included) the temp file is removed and dst untouched.
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
        os.replace(tmp, dst)
        _fsync_dir(parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "write" in str(e).lower()):
            raise DestinationError(f"{dst}: write failed: {e.strerror or e}; nothing was written") from None
        raise


def _output_mode(dst: str) -> int:
    """An existing dst's permissions, else what a plain ``open()`` would give (0o666 & ~umask)."""
    try:
        return os.stat(dst).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


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
