"""Destinations: a local path written through :mod:`ckptfix.core.atomic`, or a URL through its scheme's backend
(:mod:`ckptfix.core.remote`; ``s3://`` is the one written: a one-file output as a multipart upload).

The writers seek (a zip's headers, a safetensors header), so a URL's output is first written to a local temp file
(in ``TMPDIR``: it needs the output's size free there), then handed to the backend's ``upload``, which puts it at
the URL as one step. Any failure, Ctrl-C, SIGTERM or SIGHUP removes the temp file (and the backend aborts its
upload). A scheme that can't be written (``https://``: no standard write; ``hf://``: ``huggingface-cli upload``),
and a directory output (sharded, DCP) to a URL, are refused before anything is read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from . import atomic, interrupts, remote
from ..errors import DestinationError


def check_scheme(dst: str) -> None:
    """Refuse a URL destination its scheme's backend can't write (only ``s3://`` is written)."""
    backend = remote.backend_for(dst)
    if backend is not None:
        backend.check_writable(dst)


def check_destination(src: str, dst: str, force: bool) -> None:
    """:func:`ckptfix.core.atomic.check_destination`, for a local path or a URL (asked of its backend: for ``s3://``,
    the bucket exists, the key names an object, is not the source, and holds nothing unless ``force``)."""
    backend = remote.backend_for(dst)
    if backend is None:
        atomic.check_destination(src, dst, force)
        return
    backend.check_writable(dst)
    backend.check_destination(src, dst, force)


def check_destination_dir(src: str, dst: str, force: bool, output: atomic.DirOutput | None = None) -> None:
    """:func:`ckptfix.core.atomic.check_destination_dir`; a directory output to a URL is refused by its backend."""
    backend = remote.backend_for(dst)
    if backend is not None:
        backend.check_writable(dst, directory=True)
        raise DestinationError(f"{dst}: ckptfix writes one file to a URL, not a sharded or DCP directory; write the "
                               "directory locally and upload it")
    atomic.check_destination_dir(src, dst, force, output)


@contextlib.contextmanager
def output_path(dst: str, finalize: Callable[[str], str] | None = None, notes: list[str] | None = None,
                force: bool = False) -> Iterator[str]:
    """:func:`ckptfix.core.atomic.atomic_path` for a local path or a URL its backend writes: yield a local temp path to
    write; on clean exit it is renamed onto ``dst`` (local) or uploaded to it (``finalize(tmp)`` may name another
    key). On any exception, interrupts included, the temp file is removed and any upload aborted."""
    backend = remote.backend_for(dst)
    if backend is None:
        with atomic.atomic_path(dst, finalize, notes) as tmp:
            yield tmp
        return
    backend.check_writable(dst)
    with interrupts.signals_as_interrupts():
        try:
            folder = tempfile.mkdtemp(prefix="ckptfix-upload-")
        except OSError as e:
            raise DestinationError(f"{dst}: can't create a temp directory for the upload in {tempfile.gettempdir()}: "
                                   f"{e.strerror or e}; set TMPDIR") from None
        try:
            tmp = os.path.join(folder, dst.rstrip("/").rsplit("/", 1)[-1])
            yield tmp
            final = finalize(tmp) if finalize is not None else dst
            sent, parts = backend.upload(tmp, final, replace=force)
            if notes is not None:
                notes.append(f"uploaded {sent} bytes to {final} ({parts} part{'s' if parts != 1 else ''}); it was "
                             f"written to a temp file in {tempfile.gettempdir()} first, now removed")
        except BaseException as e:
            with interrupts.held():
                shutil.rmtree(folder, ignore_errors=True)
            atomic.reraise_write_failure(e, dst)
        with interrupts.held():
            shutil.rmtree(folder, ignore_errors=True)
