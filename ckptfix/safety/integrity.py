"""Integrity: whether a file is the one that was written — its SHA-256, the CRC-32s a zip stores for
each member, and the per-tensor digests ckptfix's outputs record (:mod:`.digests`; signatures: :mod:`.signing`).
The hashing primitive is :func:`ckptfix.core.atomic.sha256_file`; this module says what a report records and what
counts as a finding. ``verify`` hashes on a thread while it reads the file (:class:`HashAlongside`): the digest
costs no pass of its own.

>>> file_sha256("model.safetensors")          # doctest: +SKIP
'4dddd5d4…'
"""

from __future__ import annotations

import os
import threading

from ..core.atomic import sha256_file
from ..core.checksums import Tally
from ..core.progress import Progress
from ..errors import FormatError
from ..parse.format_registry import get as format_of
from . import digests, scanner


def file_sha256(path: str, progress: str | None = None) -> str | None:
    """``path``'s SHA-256 as a report records it: None for a directory or a URL (no one file to hash). With
    ``progress`` (the verb, ``"verify"``): a progress line on a terminal (a multi-GB release takes seconds)."""
    if not os.path.isfile(path):
        return None
    with Progress(os.path.getsize(path), 1, enabled=progress is not None, label=f"{progress}: SHA-256") as bar:
        digest = sha256_file(path, bar.advance)
        bar.tensor_done()
    return digest


class HashAlongside:
    """``path``'s SHA-256 computed on a thread while the caller reads the same file (``verify``'s read of the values):
    hashlib releases the GIL, and the two go over the same pages, so the hash costs no pass of its own.

    >>> with HashAlongside(path) as digest: read(path)           # doctest: +SKIP
    >>> digest.result()   # joins the thread: the hex digest, None where ``path`` is no one local file
    """

    def __init__(self, path: str):
        self.path = path
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckptfix-sha256", daemon=True)
        if os.path.isfile(path):
            self._thread.start()

    def _run(self) -> None:
        try:
            self._digest = sha256_file(self.path)
        except BaseException as e:  # raised again where the digest is asked for
            self._error = e

    def result(self) -> str | None:
        """The digest (None for a directory or a URL): waits for the thread; its error, if any, raised here."""
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest


def crc_findings(path: str, fmt: str) -> tuple[list[str], list[str]]:
    """``(failures, unchecked)``: a failure per zip member whose stored CRC-32 doesn't match its bytes, in a torch
    zip or TorchScript file or each torch-zip shard of a sharded checkpoint: the file changed after it was written;
    the line per zip whose records carry no CRC-32 (torch's CRC-less saves: no damage, but nothing to check them
    against; the read's note too). Reads every byte once (safetensors, legacy and DCP files carry no checksums)."""
    if not format_of(fmt).zip:
        return [], []

    report = scanner.scan(path, check_crc=True)
    return ([f"integrity: {f.where}: its CRC-32 does not match its bytes: the file was damaged or altered after "
             "it was written (a truncated copy, a bad download or disk); copy or download it again from the original"
             for f in report.findings if f.kind == "crc-mismatch"],
            report.no_crc)


def digest_failures(path: str, fmt: str, fetched: Tally | None = None) -> list[str]:
    """One line per tensor whose bytes don't match the digest a ckptfix output records for it (a safetensors file,
    a torch zip, each shard of a sharded checkpoint); none where the file records none. Reads every digested byte
    (a URL's: those ``fetched`` holds no CRC-32 of)."""
    try:
        return digests.failures(path, fmt, fetched)
    except FormatError as e:  # malformed digests: the file was altered, or not written by ckptfix
        return [f"integrity: {e}"]
