"""DeepSpeed ZeRO checkpoints (stages 1–3): the fp32 master weights, consolidated as zero_to_fp32.py does.

``engine.save_checkpoint(DIR, TAG)`` writes ``DIR/latest`` (the tag), ``DIR/zero_to_fp32.py`` and, in
``DIR/TAG/``, model_states (``mp_rank_00_model_states.pt``; stage 3 one per rank,
``zero_pp_rank_R_mp_rank_00_model_states.pt``) and one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
per rank, holding that rank's slice of the fp32 master weights. Every file is read structure-only
(tensors on meta, each storage's byte range in its file); :mod:`.partitions` says which bytes make
each weight. A weight that lies in one file is then copied in the kernel as any other tensor; one
split across ranks (or a buffer upcast to fp32) is gathered while it is written, so memory stays
bounded by the largest tensor. Loading maps single-file weights from their file and builds the rest.

The optim_states files pickle three DeepSpeed classes; they load as inert stand-ins
(:mod:`ckptfix.safety.deepspeed_policy`) and deepspeed is never imported.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from ...core import locations
from ...core.devices import DevicePlan, storage_id
from ...core.torch_free import NeedsTorch
from ...core.units import dtype_name
from ...errors import CkptfixError, DeepSpeedZeroError, FormatError, UnsafeCheckpointError, trust_advice
from ...parse.checkpoint_dirs import Layout, locate
from ...parse.format_registry import DEEPSPEED, TORCH_ZIP
from ...safety import scanner
from ...safety.deepspeed_policy import optim_names, optim_policy
from ...statedict.locate import ZeroWeights, deepspeed_info
from ..base import CastRef, RawRead, StorageRef
from ..torchsave import read_file as read_torch, records
from ..torchsave.torch_io import torch_load, translate_load_error, unpickling_error
from . import partitions
from .partitions import Spec


class _Source:
    """The files a consolidation reads: each structure-read once (or loaded, trusted), mapped on demand."""

    def __init__(self, plan: Any, trust: bool):
        self.trust, self.meta = trust, plan.is_meta
        self.refs: dict[int, StorageRef] = {}
        self.tags: dict[int, str] = {}
        self.maps: dict[str, Any] = {}

    def load(self, path: str, policy: Any = None) -> Any:
        if self.trust:  # full unpickling: DeepSpeed's own classes (deepspeed must be importable)
            try:
                return torch_load(path, DevicePlan("meta" if self.meta else "cpu").torch_map_location(self.tags),
                                  trust=True, mmap=True)
            except Exception as e:  # torch raises many types for bad files
                raise translate_load_error(path, TORCH_ZIP, e) from None

        scanner.ensure_safe(path, TORCH_ZIP, unpickled_by_caller="data.pkl")  # data.pkl: the restricted unpickler
        try:
            raw = records.read_structure(path, policy)
        except NeedsTorch as e:
            raise FormatError(f"{path}: can't be read structure-only ({e}); pass --trust to load it whole") from None
        except CkptfixError as e:
            if policy is not None:
                _explain_refusal(path, e, optim_names())
            raise
        self.refs.update(raw.refs)
        self.tags.update(raw.tags)
        return raw.obj

    def real(self, t: Any) -> Any:
        """``t`` with its values: itself, or its view of the file's bytes (mapped, not read)."""
        import torch

        if t.device.type != "meta":
            return t
        ref = self.refs[storage_id(t)]
        if ref.path not in self.maps:
            locations.hold(ref.path)
            self.maps[ref.path] = torch.UntypedStorage.from_file(ref.path, shared=False, nbytes=os.path.getsize(ref.path))
        out = torch.empty(0, dtype=t.dtype)
        out.set_(self.maps[ref.path][ref.offset : ref.offset + ref.nbytes], t.storage_offset(), t.shape, t.stride())
        return out

    def tag(self, t: Any) -> str:
        return self.tags.get(storage_id(t), "cpu")


def _explain_refusal(path: str, e: CkptfixError, allowed: frozenset[str]) -> None:
    """A refused optim_states file: the generic scan that names every offending global doesn't know
    DeepSpeed's classes are allowed here, so name only the others, or else the unpickler's own reason."""
    import pickle

    if not isinstance(e, UnsafeCheckpointError):
        return
    names = [g for g in e.globals if g not in allowed]
    if names:
        raise UnsafeCheckpointError(
            f"{path}: refused: loading it could run code: it references globals outside the safe allow-list: "
            f"{', '.join(names)}. {trust_advice()}", names
        ) from None
    if isinstance(e.__context__, pickle.UnpicklingError):  # what the restricted unpickler refused
        raise unpickling_error(path, e.__context__) from None


class GatherRef(CastRef):
    """A weight no single byte range holds (split across ranks, or cast): built while it is written."""

    def __init__(self, spec: Any, source: _Source, key: str, out: Any):
        self.spec, self.gather, self.key = spec, source, key
        self.before = self.after = out
        self.source = self  # check_expansion reads source.nbytes
        self.nbytes = out.untyped_storage().nbytes()
        self.location = source.tag(spec.pieces[0][0]) if spec.pieces else "cpu"
        self.crc, self.path = None, None

    __eq__, __hash__ = object.__eq__, object.__hash__  # not CastRef's field-wise ones (source is self)

    def materialize(self) -> Any:
        return build(self.spec, self.gather)


def build(spec: Any, source: _Source) -> Any:
    """The tensor ``spec`` describes, on the CPU: a single same-dtype piece as a view of its mapped
    bytes (its own storage: writers see only those bytes), else a new contiguous tensor."""
    import torch

    parts = [source.real(t).reshape(-1)[s : s + n] for t, s, n in spec.pieces]
    if not parts:
        return torch.empty(spec.shape, dtype=spec.dtype)
    if len(parts) == 1 and parts[0].dtype == spec.dtype and parts[0].is_contiguous():
        p, size = parts[0], parts[0].element_size()
        out: Any = torch.empty(0, dtype=p.dtype)  # set_ with no stride: contiguous (torch's stubs lack it)
        return out.set_(p.untyped_storage()[p.storage_offset() * size : (p.storage_offset() + p.numel()) * size], 0, spec.shape)
    whole = torch.cat(parts) if len(parts) > 1 else parts[0]
    return whole.to(spec.dtype, copy=len(parts) == 1).reshape(spec.shape)


def read(path: str, plan: Any, trust: bool, select: str | None = "auto") -> RawRead:
    """The DeepSpeed checkpoint at ``path`` (its directory, a tag directory or a model_states file):
    the consolidated fp32 master weights for ``select='auto'``; otherwise, or with no optim_states
    files to consolidate from, rank 0's model_states file as it is (``module``: the training copy)."""
    layout = locate(path)
    if select in ("auto", None) and layout.optim_files:
        raw = _consolidate(path, layout, plan, trust)
        if raw is not None:
            return raw
    if os.path.isfile(path):
        return read_torch(path, TORCH_ZIP, plan, trust)
    raw = read_torch(layout.model_files[0], TORCH_ZIP, plan, trust)
    raw.format = DEEPSPEED
    why = "" if layout.optim_files else " (no *_optim_states.pt files to consolidate the fp32 weights from)"
    raw.notes.insert(0, f"read {os.path.relpath(layout.model_files[0], path)}{why}")
    return raw


def files_read(path: str, select: str | None = "auto") -> list[str]:
    """The files :func:`read` opens: every model_states and optim_states file when it consolidates, else the one
    model_states file it reads as it is."""
    layout = locate(path)
    if select in ("auto", None) and layout.optim_files:
        return [*layout.model_files, *layout.optim_files]
    return [path if os.path.isfile(path) else layout.model_files[0]]


def _consolidate(path: str, layout: Layout, plan: Any, trust: bool) -> RawRead | None:
    source = _Source(plan, trust)
    first = source.load(layout.model_files[0])
    info = deepspeed_info(first)
    if info is None:
        if os.path.isfile(path):
            return None  # named like DeepSpeed's, but not one: read as the torch file it is
        raise FormatError(f"{layout.model_files[0]}: is not a DeepSpeed model_states file (no 'module' beside 'ds_config')")
    states = [_optimizer_state(source.load(f, optim_policy()), f) for f in layout.optim_files]
    stage, world = _stage_and_world(states[0], layout)
    flat = [_groups(osd, stage, f) for osd, f in zip(states, layout.optim_files)]
    model_states = [first]
    if stage == 3 and first.get("frozen_param_shapes"):
        if len(layout.model_files) != world:
            raise DeepSpeedZeroError(f"{layout.tag_dir}: ZeRO-3 with frozen parameters needs every rank's model_states "
                                     f"file; there are {len(layout.model_files)} for {world} ranks")
        model_states += [source.load(f) for f in layout.model_files[1:]]
    try:
        specs = partitions.plan(stage, world, model_states, flat,
                                    states[0].get("param_alignment_paddings") if stage <= 2 else None, layout.tag_dir)
    except CkptfixError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise FormatError(f"{layout.tag_dir}: malformed DeepSpeed checkpoint ({type(e).__name__}: {e})") from None
    sd, refs, tags = _realize(specs, first["module"], source, plan)
    notes = _notes(path, layout, info, stage, world, specs, first)
    return RawRead(obj=ZeroWeights(first, sd), format=DEEPSPEED, tags=tags, notes=notes, refs=refs)


def _optimizer_state(obj: Any, path: str) -> Any:
    from collections.abc import Mapping

    osd = obj.get("optimizer_state_dict") if isinstance(obj, Mapping) else None
    if not isinstance(osd, Mapping):
        raise FormatError(f"{path}: is not a DeepSpeed ZeRO optim_states file (no optimizer_state_dict)")
    return osd


def _stage_and_world(osd: Any, layout: Layout) -> tuple[int, int]:
    stage, world = osd.get("zero_stage"), osd.get("partition_count")
    first = layout.optim_files[0]
    if stage is None:
        raise DeepSpeedZeroError(f"{first}: has no zero_stage: written by DeepSpeed's BF16_Optimizer (bf16 with fp32 "
                                 "gradient accumulation), which zero_to_fp32.py can't read either; pass --select module "
                                 "for the bf16 weights in 'module'")
    world = max(world) if isinstance(world, list) and world else world
    if not isinstance(stage, int) or stage not in (1, 2, 3) or type(world) is not int:
        raise FormatError(f"{first}: zero_stage {stage!r} / partition_count {world!r}: not a ZeRO 1-3 checkpoint")
    if world != len(layout.optim_files):
        raise DeepSpeedZeroError(f"{layout.tag_dir}: partition_count says {world} ranks but there are "
                                 f"{len(layout.optim_files)} *_optim_states.pt files: a rank's file is missing, or another "
                                 "save left files behind")
    return int(stage), world


def _groups(osd: Any, stage: int, path: str) -> list[Any]:
    import torch

    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    groups = osd.get(key)
    if not isinstance(groups, list) or not groups or not all(
            isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() for t in groups):
        raise FormatError(f"{path}: {key} is not a list of flat floating-point tensors: not a ZeRO-{stage} optim_states file")
    return groups


def _realize(specs: OrderedDict, module: Any, source: _Source, plan: Any) -> tuple[OrderedDict, dict, dict]:
    """The state dict in the model's key order (``module``'s; zero_to_fp32.py puts buffers first):
    meta tensors with a byte range or a GatherRef each, or the tensors themselves on the plan's devices."""
    import torch

    refs: dict[int, Any] = {}
    tags: dict[int, str] = {}
    restore = None if plan.is_meta else plan.torch_map_location(tags)
    built: dict[str, Any] = {}
    for key, spec in specs.items():
        if isinstance(spec, str):
            continue
        tag = source.tag(spec.pieces[0][0]) if spec.pieces else "cpu"
        if plan.is_meta:
            t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            tags[storage_id(t)] = tag
            if not source.trust:
                refs[storage_id(t)] = _ref(spec, source, key, t)
        else:
            t = _place(build(spec, source), tag, restore)
        built[key] = t
    order = [k for k in module if k in specs] + [k for k in specs if k not in module]
    sd = OrderedDict((k, built[specs[k] if isinstance(specs[k], str) else k]) for k in order)
    if getattr(module, "_metadata", None) is not None:
        sd._metadata = module._metadata  # type: ignore[attr-defined]
    return sd, refs, tags


def _ref(spec: Any, source: _Source, key: str, out: Any) -> Any:
    """The byte range of a weight that lies in one file as it is, else a GatherRef."""
    if len(spec.pieces) == 1:
        t, start, n = spec.pieces[0]
        ref = source.refs.get(storage_id(t))
        if ref is not None and t.dtype == spec.dtype and t.is_contiguous():
            size = t.element_size()
            return StorageRef(ref.path, ref.offset + (t.storage_offset() + start) * size, n * size, ref.location)
    return GatherRef(spec, source, key, out)


def _place(t: Any, tag: str, restore: Any) -> Any:
    """``t`` (on the CPU) where the plan puts a storage saved on ``tag``."""
    import torch

    storage = restore(t.untyped_storage(), tag)
    if storage is t.untyped_storage():
        return t
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def _notes(path: str, layout: Layout, info: Any, stage: int, world: int, specs: OrderedDict, first: Any) -> list[str]:
    version = f"deepspeed {info.version}" if info.version else "deepspeed"
    where = f", from the directory of {os.path.basename(path)}" if os.path.isfile(path) else ""
    notes = [f"DeepSpeed ZeRO-{stage} checkpoint ({version}, {info.precision}, world size {world}, tag {layout.tag}): "
             f"the fp32 master weights, consolidated from {len(layout.optim_files)} *_optim_states.pt files as "
             f"zero_to_fp32.py does{where}"
             + (f"; --select module takes the {info.precision} training copy instead"
                if stage < 3 and info.precision != "fp32" else "")]
    upcast = [k for k, spec in specs.items() if isinstance(spec, Spec) and spec.pieces and spec.pieces[0][0].dtype != spec.dtype]
    if upcast:
        saved = sorted({dtype_name(specs[k].pieces[0][0].dtype) for k in upcast})
        notes.append(f"{len(upcast)} tensor(s) saved in {'/'.join(saved)} (buffers, frozen parameters) written as float32, "
                     f"as zero_to_fp32.py writes them: {', '.join(upcast[:5])}")
    missing = [k for k in first["module"] if k not in specs]
    if missing:
        notes.append(f"{len(missing)} key(s) of 'module' have no saved master weights (ZeRO-1 saves no frozen parameters; "
                     f"zero_to_fp32.py leaves them out too): {', '.join(missing[:5])}; --select module has their values")
    return notes

