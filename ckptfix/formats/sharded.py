"""Sharded checkpoints in the Hugging Face layout: an index json plus safetensors or torch shards.

Layout (transformers ``save_pretrained`` / huggingface_hub ``split_torch_state_dict_into_shards``)::

    model.safetensors.index.json    {"metadata": {"total_size": N}, "weight_map": {key: shard}}
    model-00001-of-00003.safetensors  ...          (torch: pytorch_model-00001-of-00003.bin,
                                                    index pytorch_model.bin.index.json)

``total_size`` is the bytes of every tensor, counting a storage shared by several keys once. One
shard only: ``model.safetensors`` (``pytorch_model.bin``) and no index, as transformers writes.
Reading checks the index before using a shard: shards inside the directory and present, keys
unique, every listed key in its shard and every tensor a shard stores listed for it.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..core import bytecopy, locations
from ..core.atomic import DirOutput, atomic_dir
from ..core.devices import storage_id
from ..core.tensorinfo import TensorInfo, layout_name, sparse_parts
from ..errors import ConversionError, FormatError
from ..parse import format_registry as registry, inert
from ..parse.checkpoint_dirs import find_index, load_index, member_path
from ..parse.safetensors_header import read_header
from ..parse.sniff import sniff
from ..safety.scanner import ensure_safe
from .base import RawRead, Reader, WritePlan





def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """Validate the index, read every shard with ``read_part(shard_path, shard_format)`` (the registry's
    reader: mapped, or structure only on meta), merge.

    The state dict follows the weight_map's order; ``refs`` (structure reads) are kept only when
    every shard gave them, so a writer either copies everything from the shards or nothing.
    """
    return _merge(str(find_index(path)), read_part)


def describe(path: str, fmt: str, select: str | None, describe_part: Reader) -> RawRead:
    """:func:`read` without torch: every shard described by ``describe_part`` (NeedsTorch from any: all)."""
    return _merge(str(find_index(path)), describe_part)


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Any]:
    """Every shard's zip records with their CRC-32s (``part_members(shard_path, shard_format)``: the registry's),
    for a torch read of the shards to be checked against; none for safetensors shards (no CRC-32s)."""
    index_path = str(find_index(path))
    root = os.path.dirname(os.path.abspath(index_path))
    shards = dict.fromkeys(load_index(index_path).values())
    out: list[Any] = []
    for shard in shards:
        shard_path = member_path(root, shard, index_path)
        out += part_members(shard_path, sniff(shard_path), None)
    return out


def _merge(index_path: str, read_part: Reader) -> RawRead:
    root = locations.dirname(index_path)
    weight_map = load_index(index_path)
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(key)
    locations.warm([locations.join(root, shard) for shard in by_shard])  # remote shards: their headers fetched at once
    paths = {shard: member_path(root, shard, index_path) for shard in by_shard}
    kinds = {shard: sniff(path) for shard, path in paths.items()}
    sharded_as = {registry.get(k).shards_as for k in kinds.values()}
    if len(sharded_as) > 1 or None in sharded_as:
        found = ", ".join(f"{s}: {k}" for s, k in kinds.items())
        raise FormatError(f"{index_path}: shards must all be safetensors or all torch files ({found})")
    merged: dict[str, Any] = {}
    aliases_after: dict[str | None, list[str]] = {}
    alias_shard: dict[str, str] = {}  # an alias the index doesn't list -> the shard that restores it
    raw = RawRead(obj=None, format=str(sharded_as.pop()))
    module_metadata: OrderedDict = OrderedDict()
    unusable: Any = None  # a shard's _metadata that is not a dict
    refs_complete = True
    for shard, keys in by_shard.items():
        part = read_part(paths[shard], kinds[shard])
        sd = part.obj
        if inert.find(sd):  # a shard is state dict through and through: no placeholder in it
            ensure_safe(paths[shard], kinds[shard])  # (refuses, naming every global outside the allow-list)
        if not isinstance(sd, dict):
            raise FormatError(f"{index_path}: shard {shard} holds a {type(sd).__name__}, not a state dict")
        _check_shard(index_path, shard, keys, _stored_keys(paths[shard], kinds[shard], sd), sd, weight_map)
        _check_aliases(index_path, shard, sd, weight_map, alias_shard)
        previous: str | None = None
        for key in sd:  # keys the shard restores beyond its stored tensors: ckptfix's tied aliases
            if key not in weight_map:
                aliases_after.setdefault(previous, []).append(key)
            previous = key
        merged.update(sd)
        meta = getattr(sd, "_metadata", None)
        if isinstance(meta, dict):
            module_metadata.update(meta)
        elif meta is not None:
            unusable = unusable if unusable is not None else meta  # (refused as the state dict's: statedict.metadata)
        raw.tags.update(part.tags)
        raw.notes.extend(part.notes)
        refs_complete = refs_complete and bool(part.refs or not sd)
        raw.refs.update(part.refs)
    raw.obj = _in_order(weight_map, merged, aliases_after)
    if module_metadata or unusable is not None:
        raw.obj._metadata = unusable if unusable is not None else module_metadata
    if not refs_complete:
        raw.refs = {}
    raw.notes.insert(0, f"{len(by_shard)} shard(s) listed by {os.path.basename(index_path)}")
    first, *others = (str(registry.get(fmt).index_name) for fmt in registry.SHARDED)
    for other in others:
        if os.path.basename(index_path) == first and locations.is_file(locations.join(root, other)):
            raw.notes.append(f"the directory also holds {other}; read the safetensors index (pass {other} to read that)")
    return raw


def _check_shard(index_path: str, shard: str, keys: list[str], stored: list[str], sd: dict,
                 weight_map: dict[str, str]) -> None:
    """Every key the index lists for ``shard`` is in it, and every tensor it stores is listed for it."""
    for key in keys:
        if key not in sd:
            raise FormatError(f"{index_path}: lists {key!r} in {shard}, but {shard} has no such tensor")
    listed = set(keys)
    for key in stored:
        if key not in listed:
            elsewhere = f" (the index puts it in {weight_map[key]})" if key in weight_map else ""
            raise FormatError(f"{index_path}: {shard} holds {key!r}, which the index does not list there{elsewhere}")


def _check_aliases(index_path: str, shard: str, sd: dict, weight_map: dict[str, str], alias_shard: dict[str, str]) -> None:
    """Each key comes from one shard: a key ``shard`` restores beyond what it stores (ckptfix's tied
    alias) is one the index lists for ``shard`` or for none, and that no other shard restores too."""
    for key in sd:
        origin = weight_map.get(key, alias_shard.get(key, shard))
        if origin != shard:
            raise FormatError(
                f"{index_path}: {shard} records {key!r} as an alias of a tensor it stores, but {key!r} comes from "
                f"{origin}: each key must come from one shard (drop the alias from {shard} or fix the index)"
            )
        if key not in weight_map:
            alias_shard[key] = shard


def _stored_keys(path: str, kind: str, sd: dict) -> list[str]:
    """Keys a shard physically stores (safetensors aliases written by ckptfix are not)."""
    if registry.get(kind).stores_aliases:
        return list(read_header(path)[1])
    return list(sd)


def _in_order(weight_map: dict[str, str], merged: dict[str, Any],
              aliases_after: dict[str | None, list[str]]) -> OrderedDict:
    """The weight_map's order, each alias right after the key it followed in its shard."""
    out: OrderedDict = OrderedDict()

    def put(key: str | None) -> None:
        if key is not None:
            out[key] = merged[key]
        for alias in aliases_after.pop(key, []):
            put(alias)

    put(None)
    for key in weight_map:
        put(key)
    for rest in list(aliases_after.values()):
        for alias in rest:
            out[alias] = merged[alias]
    return out


def plan_shards(state_dict: Any, max_shard_size: int, refs: dict | None = None) -> tuple[list[list[str]], int]:
    """Keys per shard and total_size as huggingface_hub's ``split_state_dict_into_shards_factory``
    computes them: keys in order, a new shard when the next tensor would pass the limit, a tensor
    larger than the limit alone, keys sharing a storage in the shard of the first, counted once.
    Values are torch tensors or :class:`~ckptfix.core.tensorinfo.TensorInfo` (planned without torch)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    first_of: dict[int, str] = {}
    followers: dict[str, list[str]] = {}
    for key, t in state_dict.items():
        if type(t) is TensorInfo:
            sid, size = id(t.storage), t.nbytes
        else:
            sid, size = _torch_storage_and_size(key, t, refs)
        if sid in first_of:
            followers[first_of[sid]].append(key)
            continue
        first_of[sid], followers[key] = key, []
        total += size
        if size > max_shard_size:
            shards.append([key])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += size
    if current:
        shards.append(current)
    if not shards:
        raise ConversionError("the state dict holds no tensors: nothing to write")
    return [[k for key in shard for k in (key, *followers[key])] for shard in shards], total


def _torch_storage_and_size(key: str, t: Any, refs: dict | None) -> tuple[int, int]:
    """A torch tensor's storage identity and bytes; ConversionError for what a shard can't hold."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise ConversionError(
            f"{key!r} is a {type(t).__name__}, not a tensor: shards hold tensors only; write a single .pth"
        )
    sid = storage_id(t)
    if layout_name(t) is not None:  # sparse: its own identity, the bytes of its indices and values
        return sid, sum(p.numel() * p.element_size() for p in sparse_parts(t))
    if t.device.type == "meta" and sid not in (refs or {}):
        raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a file")
    return sid, t.numel() * t.element_size()


def shard_names(fmt: str, count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` … (``pytorch_model…bin``);
    ``fmt``: the sharded format."""
    pattern = str(registry.get(fmt).shard_pattern)
    if count == 1:
        return [pattern.format(suffix="")]
    return [pattern.format(suffix=f"-{i + 1:05d}-of-{count:05d}") for i in range(count)]


def dir_output(fmt: str) -> DirOutput:
    """The files a sharded ``fmt`` output consists of: the single shard, numbered shards and the
    index (all that ``force`` replaces or removes in an existing directory)."""
    spec = registry.get(fmt)
    stem, _, ext = str(spec.shard_pattern).partition("{suffix}")
    index = str(spec.index_name)
    names = re.compile(rf"{re.escape(stem)}(-\d{{5,}}-of-\d{{5,}})?{re.escape(ext)}|{re.escape(index)}")
    return DirOutput(spec.label, names, index)


def write_shards(state_dict: Any, dst_dir: str, fmt: str, max_shard_size: int, plan_shard: Callable[[Any, str], WritePlan],
          force: bool = False, refs: dict | None = None) -> list[str]:
    """Write ``state_dict`` as shards of at most ``max_shard_size`` bytes plus the index into the
    directory ``dst_dir``, atomically; ``fmt`` is the sharded format. With ``force`` an existing
    directory keeps every file that is not part of such an output.

    ``plan_shard(part, archive)`` (the registry's: the shard format's writer) plans each shard before the
    directory is touched, so one the torch-free writer refuses (NeedsTorch) leaves nothing written; the
    plans then write one shard at a time (tied tensors written once, ``refs``' storages copied from their
    source file; a URL's bytes fetched once, a tied tensor's copied from the shard that took them first). The state
    dict's ``_metadata`` rides in the first shard.
    """
    spec = registry.get(fmt)
    if max_shard_size <= 0:
        raise ConversionError(f"max shard size must be more than 0 bytes, not {max_shard_size}")
    shards, total_size = plan_shards(state_dict, max_shard_size, refs)
    names = shard_names(fmt, len(shards))
    meta = getattr(state_dict, "_metadata", None)
    parts: list[OrderedDict] = []
    for i, keys in enumerate(shards):
        part: OrderedDict = OrderedDict((k, state_dict[k]) for k in keys)
        if i == 0 and meta is not None:
            part._metadata = meta  # type: ignore[attr-defined]
        parts.append(part)
    archives = [os.path.splitext(name)[0] for name in names]
    plans = [plan_shard(part, archive) for part, archive in zip(parts, archives)]
    notes: list[str] = []
    shard_of: dict[str, str] = {}
    with atomic_dir(dst_dir, force, dir_output(fmt), notes) as tmp, bytecopy.reusing():  # (a URL's tied bytes: once)
        for name, keys, plan in zip(names, shards, plans):
            path = os.path.join(tmp, name)
            notes += plan.write(path)
            stored = set(read_header(path)[1]) if registry.get(str(spec.shard_format)).stores_aliases else set(keys)
            shard_of.update((k, name) for k in keys if k in stored)
        if len(shards) > 1:  # weight_map in the state dict's order, which reading restores
            weight_map = {k: shard_of[k] for k in state_dict if k in shard_of}
            index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
            with open(os.path.join(tmp, str(spec.index_name)), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2) + "\n")
    if len(shards) == 1:
        notes.append(f"fits in one shard: wrote {names[0]} and no index, as transformers' save_pretrained does")
    else:
        notes.append(f"{len(shards)} shards of at most {max_shard_size} bytes (a larger tensor alone), "
                     f"index {spec.index_name}")
    return notes
