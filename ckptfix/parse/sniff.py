"""Name a checkpoint's format from its bytes (never its extension): each format's recogniser
(:mod:`ckptfix.parse.recognise`) asked in the registry's order, and what a file is when none claims it.

Pure Python below every reader: the safety scan (:mod:`ckptfix.safety`) sniffs before it scans, the format
readers (:mod:`ckptfix.formats`) before they read. The names it gives are the registered ones
(:mod:`ckptfix.parse.format_registry`, whose entries name their recognisers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..core import locations
from ..errors import FormatError, MissingFileError, NeedsLocalCopy, RemoteError
from . import format_registry as registry, recognise
from .safetensors_header import MAX_HEADER_BYTES
from .checkpoint_dirs import SINGLE_NAMES, single_weights
from .disguise import compression
from .legacy_tar import opens_as_tar
from .recognise import ZIP_MAGIC, Head, Listing

_LFS_PREFIX = b"version https://git-lfs.github.com/spec/"


def sniff(path: str) -> str:
    """Name the format of ``path`` (a local path, or a URL :mod:`ckptfix.core.locations` reads) from its bytes,
    or raise a FormatError that says what it is."""
    return resolve(path)[1]


def resolve(path: str) -> tuple[str, str]:
    """What a verb reads for ``path``, and its format: ``path`` itself, or for a ``save_pretrained`` directory (one
    ``model.safetensors`` or ``pytorch_model.bin``, no index) that file
    (:func:`~ckptfix.parse.checkpoint_dirs.single_weights`). Every verb opens its path through this."""
    remote = locations.is_remote(path)
    if not remote and not os.path.exists(path):
        raise MissingFileError(f"{path}: no such file", path)
    directory = locations.is_dir(path) if remote else os.path.isdir(path)
    if directory or path.endswith(".index.json"):
        fmt = _sniff_dir(path)
        if fmt is not None:
            return path, fmt
        single = single_weights(path) if directory else None
        if single is None:
            raise _not_a_directory_checkpoint(path, directory)
        path = single
    try:
        head, size = locations.read_head(path, 4096)
    except OSError as e:
        if isinstance(e, (MissingFileError, RemoteError)):
            raise
        raise FormatError(f"{path}: can't be read: {e.strerror or e}") from None
    if size == 0:
        raise FormatError(f"{path}: is empty (0 bytes): the save or the download did not finish")
    if head.startswith(_LFS_PREFIX):
        raise FormatError(f"{path}: this is a Git LFS pointer file, not the checkpoint; run `git lfs pull`")
    return path, _sniff_file(Head(path, remote, head, size))


def _recogniser(fmt: str) -> Callable[[Any], bool]:
    """The function of :mod:`ckptfix.parse.recognise` the registry names for ``fmt``."""
    found: Callable[[Any], bool] = getattr(recognise, registry.get(fmt).recogniser)
    return found


def _sniff_file(h: Head) -> str:
    """The one format whose recogniser claims the bytes (every one is asked); else the first damage a
    recogniser found; else what the file is instead of a checkpoint."""
    claims, damage = [], []
    for fmt in registry.RECOGNISED_BY_BYTES:
        try:
            if _recogniser(fmt)(h):
                claims.append(fmt)
        except (FormatError, NeedsLocalCopy) as e:  # its format's bytes, damaged, or not readable from a URL
            damage.append(e)
    if len(claims) > 1:
        raise FormatError(f"{h.path}: is ambiguous: its bytes read as {' and as '.join(claims)} (a file made to be "
                          "two formats at once?); refused: two readers could see two different checkpoints")
    if claims:
        return claims[0]
    if damage:
        raise damage[0]
    raise _not_a_checkpoint(h)


def _not_a_checkpoint(h: Head) -> FormatError:
    """What a file no recogniser claims is instead: a zip or a tar of something else, an HTML page, a JSON
    document, a plain pickle, or unknown."""
    path, head = h.path, h.head
    if head.startswith(ZIP_MAGIC):
        return FormatError(f"{path}: is a zip archive but not a torch checkpoint (no data.pkl inside)")
    if not h.remote and opens_as_tar(path):
        return FormatError(f"{path}: is a tar archive but not a torch checkpoint (no 'storages' member); "
                           "extract the checkpoint from it and give that file")
    packed = compression(head)
    if packed is not None:
        return FormatError(f"{path}: is {packed}-compressed, not a checkpoint: torch.load does not read it; "
                           f"decompress it first (`ckptfix scan {path}` looks inside)")
    low = head.removeprefix(b"\xef\xbb\xbf").lstrip()[:64].lower()  # (a UTF-8 byte order mark first)
    if low.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<!--")):
        return FormatError(
            f"{path}: is an HTML page, not a checkpoint (a failed or login-walled download?); "
            "download the file itself"
        )
    if low[:1] in (b"{", b"["):
        return FormatError(
            f"{path}: is a JSON document (starts with {low[:24]!r}), not a checkpoint: a server's error "
            "response saved in its place?"
        )
    if head[:1] == b"\x80":
        return FormatError(f"{path}: is a plain pickle, not a torch checkpoint (no torch magic number)")
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else None
    if n is not None and 0 < n <= MAX_HEADER_BYTES:  # (a small length first: what a safetensors file starts with)
        after = "the file ends there" if h.size <= 8 else f"what follows is not a JSON header (starts with {head[8:16]!r})"
        return FormatError(f"{path}: unknown format: its first 8 bytes read as a safetensors header length ({n} bytes), "
                           f"but {after}: a damaged safetensors file? (not a torch zip or torch legacy file either)")
    return FormatError(
        f"{path}: unknown format (starts with {head[:8]!r}): not a torch zip, torch legacy "
        "or safetensors file"
    )


def _sniff_dir(path: str) -> str | None:
    """The first format in the registry's order whose recogniser claims the directory (a
    torch.distributed.checkpoint, a DeepSpeed or a Hugging Face sharded one) or the index json; else None."""
    listing = Listing(path, locations.is_remote(path))
    return next((fmt for fmt in registry.RECOGNISED_BY_LISTING if _recogniser(fmt)(listing)), None)


def _not_a_directory_checkpoint(path: str, directory: bool) -> FormatError:
    """What a directory (or an index json) no recogniser claims, holding no ``save_pretrained`` file, lacks."""
    if not directory:
        return FormatError(f"{path}: is not a sharded-checkpoint index (expected a JSON file with a weight_map)")
    singles = " / ".join(SINGLE_NAMES)
    if locations.is_remote(path):
        return FormatError(f"{path}: is neither a torch.distributed.checkpoint (no .metadata), a sharded checkpoint "
                           "(no model.safetensors.index.json / pytorch_model.bin.index.json) nor a save_pretrained "
                           f"directory (no {singles}); give a file inside it")
    return FormatError(
        f"{path}: is a directory but neither a torch.distributed.checkpoint (no .metadata), a DeepSpeed checkpoint "
        f"(no latest), a sharded checkpoint (no model.safetensors.index.json / pytorch_model.bin.index.json) nor a "
        f"save_pretrained directory (no {singles})"
    )
