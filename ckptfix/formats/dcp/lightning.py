"""Lightning's sharded checkpoint directories: DCP files plus ``meta.pt``, read as one checkpoint.

With ``FSDPStrategy(state_dict_type="sharded")`` or ``ModelParallelStrategy()`` (its default
``save_distributed_checkpoint=True``), Lightning 2.x saves a checkpoint *directory*: DCP files holding
the weights — under ``model`` (FSDPStrategy) or ``state_dict`` (ModelParallelStrategy) — and each
optimizer as ``optimizer_0``, ``optimizer_1`` … keyed by parameter name, plus ``meta.pt``, a
``torch.save`` on rank 0 of everything else ``dump_checkpoint`` made (epoch, global_step, loops,
callbacks, lr_schedulers, hyper_parameters …). It is read here as the single ``.ckpt`` the Trainer
writes unsharded: ``state_dict`` and ``optimizer_states`` (``Optimizer.state_dict()``s, keyed by
parameter index) among meta.pt's entries, in ``dump_checkpoint``'s order. A Fabric directory
(``fabric.save``: meta.pt without a Lightning version) keeps its own keys, meta.pt's entries beside them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from ...core import locations
from ...errors import FormatError
from ...parse.format_registry import get
from ...parse.sniff import sniff
from ..base import RawRead, Reader

META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
WEIGHTS_KEYS = {"model": "FSDPStrategy", "state_dict": "ModelParallelStrategy"}  # the DCP entry each saves under
VERSION_KEYS = ("pytorch-lightning_version", "lightning_version")
_OPTIMIZER = re.compile(r"optimizer_(\d+)")
# what dump_checkpoint writes before each entry meta.pt lacks (lightning/pytorch/trainer/connectors/checkpoint_connector.py)
_AFTER = {"state_dict": ("epoch", "global_step", *VERSION_KEYS), "optimizer_states": ("loops", "callbacks")}


def with_meta(raw: RawRead, path: str, read_meta: Reader) -> RawRead:
    """``raw`` (a consolidated DCP directory) joined with the directory's ``meta.pt``, if it has one, read by
    ``read_meta(meta_path, fmt)`` (the registry's reader, or its describer for the torch-free read)."""
    meta_path = locations.join(path, META)
    if not locations.is_file(meta_path):
        return raw

    fmt = sniff(meta_path)
    if get(fmt).family != "torchsave":
        raise FormatError(f"{meta_path}: is {fmt}, not the torch.save file Lightning writes beside its DCP files")
    meta = read_meta(meta_path, fmt)  # the same safety checks and unpickler as any torch file
    if not isinstance(meta.obj, Mapping):
        raise FormatError(f"{meta_path}: holds a {type(meta.obj).__name__}, not the dict Lightning saves there")
    both = [k for k in meta.obj if k in raw.obj]
    if both:
        raise FormatError(f"{meta_path}: entry {both[0]!r} is also in the DCP files beside it: which is the checkpoint's?")
    if any(k in meta.obj for k in VERSION_KEYS):
        obj, note = _trainer_checkpoint(raw.obj, dict(meta.obj), path)
    else:
        obj = {**raw.obj, **meta.obj}
        note = f"{META}'s entries ({', '.join(map(str, meta.obj)) or 'none'}) joined with the DCP entries (a Fabric checkpoint)"
    # a structure read (on meta) streams when every tensor of both has its bytes' place (refs)
    refs = {**raw.refs, **meta.refs} if raw.refs and set(meta.tags) <= set(meta.refs) else {}
    return RawRead(obj=obj, format=raw.format, tags={**raw.tags, **meta.tags}, notes=[*raw.notes, note], refs=refs)


def _trainer_checkpoint(dcp: dict[str, Any], meta: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The Trainer's ``.ckpt`` layout from its sharded save, and a note saying what moved where."""
    weights = next((k for k in WEIGHTS_KEYS if k in dcp), None)
    optimizers = sorted((int(m.group(1)), k) for k in dcp if isinstance(k, str) and (m := _OPTIMIZER.fullmatch(k)))
    if [i for i, _ in optimizers] != list(range(len(optimizers))):
        raise FormatError(f"{source}: the DCP optimizer entries {[k for _, k in optimizers]} don't number 0..N-1")
    for key, moving in (("state_dict", weights is not None), ("optimizer_states", bool(optimizers))):
        if moving and key in meta:
            raise FormatError(f"{os.path.join(source, META)}: has {key!r}, which the DCP files beside it hold too")
    entries = list(meta.items())
    moved = []
    if weights is not None:
        _place(entries, "state_dict", dcp[weights])
        moved.append(f"{weights!r} → state_dict ({WEIGHTS_KEYS[weights]})")
    if optimizers:
        _place(entries, "optimizer_states", [by_parameter_index(dcp[k], f"{source}: {k}") for _, k in optimizers])
        moved.append(f"{', '.join(k for _, k in optimizers)} → optimizer_states (parameter names → indices)")
    taken = {weights, *(k for _, k in optimizers)}
    entries += [(k, v) for k, v in dcp.items() if k not in taken]
    note = f"Lightning sharded checkpoint read as one .ckpt: {'; '.join(moved) or 'no DCP entries moved'}; the rest from {META}"
    return dict(entries), note


def _place(entries: list[tuple[str, Any]], key: str, value: Any) -> None:
    """Insert ``(key, value)`` after the last entry ``dump_checkpoint`` writes before ``key``."""
    at = max((i + 1 for i, (k, _) in enumerate(entries) if k in _AFTER[key]), default=len(entries))
    entries.insert(at, (key, value))


def by_parameter_index(osd: Any, where: str) -> Any:
    """An optimizer state keyed by parameter name (``get_optimizer_state_dict``, FSDP's
    ``optim_state_dict``) in the form ``torch.optim.Optimizer.load_state_dict`` takes: each name
    becomes its position in ``param_groups`` (group after group, as ``Optimizer.state_dict`` numbers
    them), which is the order the optimizer was built with. Index-keyed states come back as they are.

    >>> by_parameter_index({"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}, "opt")
    {'state': {0: {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    if not (isinstance(osd, Mapping) and isinstance(osd.get("state"), Mapping) and isinstance(osd.get("param_groups"), list)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in osd["param_groups"])):
        raise FormatError(f"{where}: is not an optimizer state (a dict of 'state' and 'param_groups' with 'params')")
    names = [p for g in osd["param_groups"] for p in g["params"]]
    if all(isinstance(p, int) for p in names):
        return osd
    index = {name: i for i, name in enumerate(names)}
    if not all(isinstance(p, str) for p in names) or len(index) != len(names):
        raise FormatError(f"{where}: its param_groups' params are neither parameter names nor indices, each once")
    unknown = [k for k in osd["state"] if k not in index]
    if unknown:
        raise FormatError(f"{where}: holds state for {unknown[0]!r}, which no param_group lists")
    state = {index[k]: osd["state"][k] for k in sorted(osd["state"], key=index.__getitem__)}
    groups = [{k: ([index[p] for p in v] if k == "params" else v) for k, v in g.items()} for g in osd["param_groups"]]
    return {**osd, "state": state, "param_groups": groups}
