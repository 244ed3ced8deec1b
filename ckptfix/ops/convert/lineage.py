"""A convert's lineage, as every output it writes records it (:mod:`ckptfix.safety.digests`): the ckptfix version,
the transform (the convert flags that change what is written, as one short string) and the source's identity —
its SHA-256 where the convert hashes it anyway (``checksums``, on with ``--json``), else its size and validator
(a URL's ETag or commit, a local file's mtime: touching the source changes the lineage, by design)."""

from __future__ import annotations

import functools
import os
import shlex
from dataclasses import fields
from typing import Any

from ... import __version__
from ...core import locations
from ...parse import checkpoint_dirs, format_registry as registry
from ...safety import integrity
from ..convert_options import ConvertOptions, flag_of

#: options that change how or where a convert runs, not what it writes
_NOT_TRANSFORMS = frozenset({"map_location", "hash", "force", "progress", "trust", "allow", "checksums"})


def of(req: Any) -> dict[str, Any]:
    """The lineage of the convert ``req`` (a ``steps.Request``): the same request of the same source is the
    same dict, key for key."""
    return {"ckptfix": __version__, "transform": transform(req), "source": source(req.src, req.fmt_in, req.checksums)}


def transform(options: ConvertOptions) -> str:
    """The flags that differ from their defaults, as ``ckptfix convert`` spells them (``--to single --dtype bf16``)."""
    parts: list[str] = []
    for f in fields(ConvertOptions):
        value = getattr(options, f.name)
        if f.name in _NOT_TRANSFORMS or value == f.default or value is None:
            continue
        flag = flag_of(f)
        if flag.is_flag:
            parts.append(flag.decls[0])
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            parts += [flag.decls[0], shlex.quote(str(item))]
    return " ".join(parts)


def source(src: str, fmt: str, hashed: bool) -> dict[str, Any]:
    """``src``'s identity: its name, size and SHA-256 (``hashed``, a local file) or validator (a remote directory:
    its index's; none for one without)."""
    name = src.rstrip("/").rsplit("/", 1)[-1]
    if locations.is_remote(src):
        spec = registry.get(fmt)
        one = checkpoint_dirs.find_index(src) if spec.index_name else None if spec.directory_output else src
        if one is None:
            return {"name": name}
        opened = locations.open_source(one)
        validator = opened.validator
        return {"name": name, "size": opened.size, **({"validator": str(validator)} if validator is not None else {})}
    st = os.stat(src)
    if hashed and os.path.isfile(src):
        return {"name": name, "size": st.st_size, "sha256": source_sha256(src)}
    return {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def source_sha256(src: str) -> str | None:
    """``src``'s SHA-256 as reports record it, hashed once per version of the file (the lineage and the report)."""
    if not os.path.isfile(src):
        return integrity.file_sha256(src)
    st = os.stat(src)
    return _sha256(os.path.realpath(src), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str | None:
    return integrity.file_sha256(path)
