"""The bytes a load replaced, kept until it is kept or rolled back: what makes ``load_into`` all or nothing.

A file can change while it is read (another process truncates it): a read that comes up short is known only
after earlier reads already wrote into the model. Nothing on an ordinary filesystem keeps another process from
shrinking a file, and the bytes a truncation removes are gone, so a load that must leave the model as it was
after any failed read needs the old bytes of everything it overwrote. :class:`Undo` keeps them in an unlinked
temporary file (``TMPDIR``): each chunk's old bytes are written there just before the read overwrites them, by
the thread that reads it (the chunk is in its cache), so anonymous memory grows by nothing and the kernel may
write the log out under memory pressure; a load that succeeds closes the file, never read back.

The log costs a second copy of what is read. On Linux a load can keep its files from shrinking instead, for free:
:class:`Leases` takes a read lease on each (``F_SETLEASE``), and while it is held another process's open for writing
or truncate of the file waits, up to ``/proc/sys/fs/lease-break-time``. Where a lease can't be had (the file open for
writing elsewhere, another user's file, a filesystem without leases, a URL) the load keeps the log.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import threading
from typing import Any

from ..errors import LoadError

try:
    import fcntl
except ImportError:  # Windows: no leases, the log
    fcntl = None  # type: ignore[assignment]

#: ``fcntl``'s lease command (Linux only; elsewhere None: the log)
SETLEASE: int | None = getattr(fcntl, "F_SETLEASE", None)
#: why a lease is refused: open for writing elsewhere, not the owner, no leases on this filesystem or disabled
_NO_LEASE = {errno.EAGAIN, errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOLCK, errno.ENOSYS}


class Undo:
    """Old bytes of tensors about to be overwritten (:meth:`save`, :meth:`save_tensor`), put back by
    :meth:`restore`; attributes replaced as objects (:meth:`keep`) are set back first. Thread-safe saves."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._end = 0
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, Any]] = []  # (numpy byte view, or a tensor restored by copy_; its offset in
        # the log, or a quantized tensor's copy in memory)
        self._objects: list[tuple[Any, str, Any]] = []  # (module, attribute name, the object it held)

    def save(self, raw: Any) -> None:
        """Keep the bytes of ``raw`` (a numpy uint8 view of memory a read is about to overwrite)."""
        if raw.nbytes:
            self._saved_at(raw, raw)

    def save_tensor(self, t: Any) -> None:
        """Keep the values of ``t`` (any device, any layout), about to be copied into."""
        import torch

        if t.is_quantized:  # its scale and zero point are the object's own: the object itself restored, in memory
            with self._lock:
                self._saved.append((t, t.detach().clone()))
            return
        t = t.detach()
        if t.numel() == 0:
            return
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            self.save(t.reshape(-1).view(torch.uint8).numpy())
            return
        copy = t.resolve_conj().resolve_neg().to("cpu", copy=True).contiguous()  # (one tensor in flight)
        self._saved_at(t, copy.reshape(-1).view(torch.uint8).numpy())

    def keep(self, module: Any, name: str) -> None:
        """``module.<name>`` may be replaced by another object: :meth:`restore` sets it back."""
        self._objects.append((module, name, getattr(module, name)))

    def _saved_at(self, target: Any, raw: Any) -> None:
        with self._lock:
            if self._fd is None:
                self._fd = _temp_fd()
            offset, self._end = self._end, self._end + raw.nbytes
        try:
            _all(os.pwritev, self._fd, raw, offset)
        except OSError as e:
            raise LoadError(f"no room to keep the {self._end} bytes this load replaces until it completes "
                            f"({tempfile.gettempdir()}: {e.strerror}); nothing was loaded; set TMPDIR to a "
                            "filesystem with room") from e
        with self._lock:
            self._saved.append((target, offset))

    def restore(self) -> None:
        """Everything saved back in place, the latest first (the model as it was before the first save)."""
        import torch

        for module, name, value in reversed(self._objects):
            setattr(module, name, value)
        for target, offset in reversed(self._saved):
            try:
                if isinstance(offset, torch.Tensor):  # a quantized tensor's copy (copy_ sets its quantizer too)
                    with torch.no_grad():
                        target.copy_(offset)
                elif isinstance(target, torch.Tensor):
                    staged = torch.empty(target.shape, dtype=target.dtype)
                    _all(os.preadv, self._fd, staged.reshape(-1).view(torch.uint8).numpy(), offset)
                    with torch.no_grad():
                        target.copy_(staged)
                else:
                    _all(os.preadv, self._fd, target, offset)
            except OSError as e:
                raise LoadError(f"the bytes this load replaced could not be read back from {tempfile.gettempdir()} "
                                f"({e.strerror}): the model is partly loaded") from e

    def close(self) -> None:
        """Drop the log (its file was never linked: closing it frees it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._saved.clear()
        self._objects.clear()


def _temp_fd() -> int:
    """A descriptor of a new temporary file no other process can open by name (O_TMPFILE, or unlinked at once)."""
    with tempfile.TemporaryFile() as f:
        return os.dup(f.fileno())


def _all(call: Any, fd: int | None, raw: Any, offset: int) -> None:
    """``os.pwritev`` / ``os.preadv`` of all of ``raw`` at ``offset`` (a short transfer continued; none: an error)."""
    assert fd is not None
    done = 0
    while done < raw.nbytes:
        got = call(fd, [raw[done:]], offset + done)
        if got <= 0:
            raise OSError(0, "the undo log ends early")
        done += got


class Leases:
    """Read leases on the local files a load reads (path -> the size the load checked), held from construction to
    :meth:`release`. ``held``: every file leased and still its checked size, so none can shrink until the release
    (or until lease-break-time after a writer asks: :func:`break_time`); False: nothing held, keep the :class:`Undo`
    log (``files`` None: a source that is not a local file)."""

    def __init__(self, files: dict[str, int] | None) -> None:
        self._fds: list[int] = []
        try:
            self.held = files is not None and all(self._lease(path, size) for path, size in files.items())
        except BaseException:
            self.release()
            raise
        if not self.held:
            self.release()

    def _lease(self, path: str, size: int) -> bool:
        fd = lease(path)
        if fd is None:
            return False
        self._fds.append(fd)
        return os.fstat(fd).st_size == size  # shrunk (or grown) since the plan checked it: the log's path

    def intact(self) -> bool:
        """Every lease still unbroken (False once a writer waits on one)."""
        return all(intact(fd) for fd in self._fds)

    def release(self) -> None:
        """Let the writers in: closing a descriptor drops its lease."""
        while self._fds:
            drop(self._fds.pop())


def break_time() -> int | None:
    """How long the kernel lets a leased file's writer wait, in seconds (``/proc/sys/fs/lease-break-time``)."""
    try:
        with open("/proc/sys/fs/lease-break-time") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def lease(path: str) -> int | None:
    """A new read-only descriptor of ``path`` holding a read lease (``F_SETLEASE``), which closing it drops; None where
    none can be had (see :data:`_NO_LEASE`; not Linux). While it is held, another process's open of the file for
    writing, or its truncation, waits (up to :func:`break_time`); so does this process's own, on another descriptor."""
    if SETLEASE is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # a break is announced by a signal, SIGIO unless told otherwise, and SIGIO's default ends the process:
        # SIGURG's default is to ignore it (the writer waits all the same)
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        os.close(fd)
        if e.errno in _NO_LEASE:
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    _LEASED.add(fd)
    return fd


def drop(fd: int) -> None:
    """End the lease ``fd`` holds (:func:`lease`): close it — in this process only; a forked child's copy is closed
    at the fork (:func:`_forked`), never here."""
    if fd in _LEASED:
        _LEASED.discard(fd)
        os.close(fd)


#: the descriptors holding a lease in this process. A lease lives as long as any copy of its descriptor: a child forked
#: while one is held (a DataLoader worker started beside a load) would keep it for its life, and every later
#: ``torch.save`` to the file would wait out lease-break-time. A forked child closes its copies at once.
_LEASED: set[int] = set()


def _forked() -> None:
    for fd in list(_LEASED):
        try:
            os.close(fd)
        except OSError:
            pass
    _LEASED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def intact(fd: int) -> bool:
    """The lease ``fd`` holds is unbroken (False once a writer waits on it)."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK)
