"""The one interface a URL scheme implements: :class:`Backend`.

A backend is registered for its scheme (:func:`ckptfix.core.remote.register`); :mod:`ckptfix.core.locations` and
:mod:`ckptfix.core.upload` ask it, and nothing else, about that scheme's URLs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...errors import DestinationError
from ..positional import ByteSource


class Backend(ABC):
    """How ckptfix reaches the files of one URL scheme. The verbs call, in this order:

    1. :meth:`open` — every verb, once per URL in its session: the :class:`ByteSource` the readers slice (a ranged
       fetch per missing block, each checked against the validator of the first; a new version refused).
    2. :meth:`is_dir` / :meth:`listdir` — sniffing and the directory formats (a sharded index, DCP's ``.metadata``).
    3. ``convert`` to a URL: :meth:`check_writable` before anything is read, :meth:`check_destination` for a
       one-file output, then :meth:`upload` of the finished local temp file.

    Only :meth:`open` is required: by default a scheme lists nothing (its files are asked for by name) and is
    written to by nothing. Import client libraries inside the methods, never at module level: ``ckptfix --help``
    and a local ``inspect`` import no client."""

    @abstractmethod
    def open(self, location: str) -> ByteSource:
        """``location``'s bytes; MissingFileError for a file that isn't there, RemoteError for any other failure."""

    def listdir(self, location: str) -> tuple[list[str], int] | None:
        """The names directly under ``location`` (folders end in ``/``) and the bytes the listing took; None where
        the scheme can't list."""
        return None

    def is_dir(self, location: str) -> bool | None:
        """Whether ``location`` is a directory, where the URL alone says; None: it is one if its listing isn't empty."""
        return None

    def check_writable(self, location: str, directory: bool = False) -> None:
        """Refuse (DestinationError, saying what to do instead) an output this scheme can't take; ``directory``: a
        sharded or DCP directory output."""
        scheme = location.partition("://")[0]
        raise DestinationError(f"{location}: ckptfix does not write {scheme}:// URLs; write a local file")

    def check_destination(self, src: str, dst: str, force: bool) -> None:
        """Before anything is read: a one-file output can go to ``dst`` (not the source, nothing there unless
        ``force``). Called after :meth:`check_writable` passed; by default only the source itself is refused."""
        if src.rstrip("/") == dst.rstrip("/"):
            raise DestinationError(f"{dst}: is the source itself; write to a new key")

    def upload(self, path: str, url: str, replace: bool) -> tuple[int, int]:
        """The local file ``path`` put at ``url`` as one step (nothing visible there if it fails), replacing an object
        only if ``replace``; (bytes sent, parts)."""
        self.check_writable(url)
        raise NotImplementedError(f"{type(self).__name__}.upload")
