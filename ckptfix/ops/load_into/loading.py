"""``load_into``: a checkpoint into a model built on a device, on ``meta``, or sharded as DTensors — all or nothing.

1. **Plan, reading no tensor bytes.** The checkpoint's structure is read on ``meta`` (each storage's byte
   range known), the keys are repaired against the model (:mod:`ckptfix.statedict.repair`), and everything
   that can fail is checked: keys, shapes, a file too short for its tensors, devices, meta tensors nothing
   fills. With ``strict_values`` the values are checked too, on the mapped file. A failure raises LoadError
   and the model is as it was.
2. **Commit.** Each model tensor is filled once from the file: read or copied in place (built tensors, the
   NaN/Inf check fused into the copy: :mod:`ckptfix.core.tensorcopy`), assigned (meta tensors: a zero-copy
   view of the file where the target is the CPU and the dtype as stored, else materialised on the target
   device; tied parameters stay one tensor), or — for a DTensor — its local shard read from exactly its
   byte ranges (:mod:`ckptfix.ops.load_into.shards`). Modules whose ``_load_from_state_dict`` or load hooks are their
   own (BatchNorm's version handling, user hooks) are loaded through torch's ``load_state_dict``. The files read are
   leased for the commit (:mod:`ckptfix.core.rollback`: no other process can shrink them meanwhile); where a lease
   can't be had, what the fills replace is saved just before and put back if anything fails: a file truncated by
   another process while it is read leaves the model as it was either way, and so does a signal
   (:mod:`ckptfix.ops.load_into.commit`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Any

from ...core import locations, tensorcopy
from ...core.devices import DevicePlan, storage_id
from ...core.positional import PositionalReader
from ...core.units import few
from ...errors import CkptfixError, LoadError
from ...formats import safetensors as _safetensors  # noqa: F401  (the families most loads read: imported with
from ...formats.base import source_record
from ...formats import torchsave as _torchsave  # noqa: F401  load_into, not in its first call)
from ...reports import LoadReport
from ...safety import digests
from ...statedict import metadata, repair, ties, weights_only
from . import commit, dequant, modelwalk, shards
from .commit import Plan, Slot
from ..reading import read_checkpoint, structure_first
from ..sources import Sources, byte_view, damaged


@dataclass(frozen=True)
class LoadOptions:
    """Everything :func:`ckptfix.load_into` takes after ``model`` and ``path``, declared once: its signature is this
    (``ckptfix.ops.api.load_into`` takes it, as convert takes ``ConvertOptions``)."""

    map_location: Any = "auto"
    strict: bool = True
    select: str = "auto"
    trust: bool = False
    strict_values: bool = False
    check_values: bool = True
    assign: bool | None = None
    dequantize: bool = False
    #: the per-tensor digests a ckptfix output records, checked before the model is touched (``load`` takes it too).
    #: None (the default): where the check rides on a pass the load makes anyway — a meta-built model's NaN/Inf
    #: check over the mapped file (not with ``check_values=False``), a URL's fetch —; True: everywhere, a built
    #: model's in a pass of its own before the fill (and ``load``'s); False: nowhere (docs/digests.md)
    check_digests: bool | None = None


def load_into(model: Any, path: Any, o: LoadOptions) -> LoadReport:
    """See :func:`ckptfix.load_into`."""
    path = os.fspath(path)
    distributed = shards.Agreement(model)
    local_bad: list[str] = []
    # a URL: its sources live in the verb's session (opened once, fetches checked and counted), read by position
    with locations.session() as session, session.reporting(), PositionalReader(locations.open_source) as reader:
        # everything that can fail, before anything is written; no collectives inside: a rank that raises
        # here (a file missing on its node) makes every rank raise, so none waits forever
        with distributed.step():
            plan_devices = DevicePlan(o.map_location, source=path)
            model_walk = modelwalk.walk(model)
            target = repair.describe_target(model, state_dict=model_walk.state_dict,
                                            module_names=model_walk.module_names)
            ckpt, chosen, fit, sources = _read_fitted(path, o, target, reader, model_walk.state_dict)
            plan = _plan(ckpt, model_walk, fit.state_dict, sources, plan_devices, o.assign)
            recorded = (_digests(ckpt, plan, o.check_digests, o.check_values, distributed)
                        if o.check_digests is not False else None)
            if o.strict_values:
                _check_records(plan, sources, distributed)
                local_bad = _precheck(plan, sources)
        bad = distributed.gather_keys(local_bad)
        if bad:
            raise LoadError(f"{ckpt.path}: {_values(bad)}; nothing was loaded (a diverged run, or a damaged "
                            "file?); pass strict_values=False to load it anyway")
        nonfinite = commit.commit(model, plan, fit.state_dict, sources, o.check_values and not o.strict_values,
                                  recorded, distributed)  # (every rank's NaN/Inf keys; any rank's failure undone on all)
        _check_done(model_walk, path)  # the postcondition (after the last collective): no tensor left on meta
        bytes_read = reader.bytes_read + sum(_nbytes(src) for _s, src, _p in plan.copy) + sum(
            _nbytes(src) for _s, src, _d in plan.assign)
        fetched = session.bytes_fetched if session.remote else None
    notes = list(ckpt.notes)
    beside = weights_only.refused(ckpt.extra)
    held = ([f"beside the state dict it holds {weights_only.described(beside)}"] if beside else []) + [
        f"in {line}" for line in metadata.objects(ckpt.metadata_dropped)]
    if held:  # the weights are safe to take; the file as a whole is not what a plain load takes
        warnings.warn(f"{ckpt.path}: the weights were loaded, but torch.load(PATH, weights_only=True) refuses this "
                      f"file: {'; '.join(held)}", UserWarning, stacklevel=3)
    if nonfinite:
        warnings.warn(f"{ckpt.path}: {_values(nonfinite)} (loaded; strict_values=True refuses them)", UserWarning,
                      stacklevel=3)
        notes.append(f"{_values(nonfinite)} (a diverged run, or a damaged file?)")
    if fit.dtype_mismatch:
        kinds = sorted({f"{r['checkpoint']} -> {r['model']}" for r in fit.dtype_mismatch})
        notes.append(f"{len(fit.dtype_mismatch)} tensors cast to the model's dtype ({', '.join(kinds)})")
    return LoadReport(
        path=ckpt.path, state_dict_key=ckpt.state_dict_key, checkpoint_wrappers=ckpt.wrappers,
        model_wrappers=target.wrappers, fix=chosen.description, matched=chosen.matched, missing=fit.missing,
        unexpected=fit.unexpected, notes=notes, tolerated=[t["key"] for t in fit.tolerated], nonfinite=nonfinite,
        copied=sum(len(s.keys) for s, *_ in plan.copy) + (0 if plan.torch_assigns else len(plan.by_torch)),
        assigned=sum(len(s.keys) for s, _, _ in plan.assign) + (len(plan.by_torch) if plan.torch_assigns else 0),
        sharded=sum(len(s.keys) for s, _ in plan.sharded),
        bytes_read=bytes_read, bytes_fetched=fetched,
    )


def _read_fitted(path: str, o: LoadOptions, target: repair.Target, reader: PositionalReader,
                 model_state: Any) -> tuple[Any, repair.Repair, repair.Fit, Sources]:
    """The checkpoint, its keys fitted to the model, and its tensors' bytes: the structure, where its refs place every
    tensor the model takes (each read by position), else what torch.load reads on the CPU (legacy files, DeepSpeed,
    DCP values, quantized groups the model takes dequantized)."""
    plain: dict[str, Any] = {}  # quantized groups the model takes as plain weights: dequantized from the values

    def placed(ckpt: Any) -> tuple[repair.Repair, repair.Fit] | None:
        plain.update(dequant.plain_groups(ckpt, target, model_state, o.dequantize))
        if plain:
            return None
        chosen, fit = _fit(ckpt, target, o.strict)
        sources = Sources(ckpt.refs, reader)
        return (chosen, fit) if all(sources.has_bytes(t) for t in _tensors(fit.state_dict)) else None

    try:
        ckpt, found = structure_first(path, o.select, placed,
                                      lambda: read_checkpoint(path, "cpu", o.trust, o.select, refuse=True), trust=o.trust)
    except CkptfixError as e:
        if o.select not in ("auto", None) or len(e.candidates) < 2:
            raise
        key = _the_one_that_fits(path, o, target, e)
        ckpt, chosen, fit, sources = _read_fitted(path, replace(o, select=key), target, reader, model_state)
        ckpt.notes.append(f"{ckpt.path} holds several state dicts ({', '.join(e.candidates)}): loaded {key!r}, the one "
                          f"whose keys fit the model (select={key!r} says so)")
        return ckpt, chosen, fit, sources
    if plain:
        ckpt = dequant.dequantized(ckpt, plain)
    chosen, fit = found or _fit(ckpt, target, o.strict)
    sources = Sources(ckpt.refs if found else {}, reader)
    sources.check_bounds()
    return ckpt, chosen, fit, sources


def _the_one_that_fits(path: str, o: LoadOptions, target: repair.Target, ambiguous: CkptfixError) -> str:
    """The one of the state dicts ``ambiguous`` names whose keys fit the model (read on meta, repaired as a load
    repairs them: nothing missing, unexpected or mis-shaped); else ``ambiguous`` again, saying which fit."""
    fits = []
    for key in ambiguous.candidates:
        try:
            ckpt = read_checkpoint(path, "meta", o.trust, key, refuse=True)
            _chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=ckpt.path)
        except CkptfixError:
            continue
        if not (fit.shape_mismatch or fit.non_tensor or fit.missing or fit.unexpected):
            fits.append(key)
    if len(fits) == 1:
        return fits[0]
    said = f"the model's keys fit {' and '.join(map(repr, fits))}" if fits else "the model's keys fit none of them"
    ambiguous.args = (f"{ambiguous} ({said})", *ambiguous.args[1:])  # (the same error, its type and fields kept)
    raise ambiguous


def _fit(ckpt: Any, target: repair.Target, strict: bool) -> tuple[repair.Repair, repair.Fit]:
    """The checkpoint's keys repaired against the model; a LoadError (the short report) where they don't fit."""
    chosen, fit = repair.fit_to_model(ckpt.state_dict, target, source=ckpt.path)
    if fit.shape_mismatch or fit.non_tensor or (strict and (fit.missing or fit.unexpected)):
        raise LoadError(repair.fit_report(ckpt.path, fit, chosen))
    _zero_filled(fit)
    return chosen, fit


def _tensors(state_dict: Any) -> list[Any]:
    import torch

    return [v for v in state_dict.values() if isinstance(v, torch.Tensor)]


def _zero_filled(fit: repair.Fit) -> None:
    """A tolerated missing ``num_batches_tracked`` is 0, as BatchNorm sets it (not a tensor of the file)."""
    import torch

    for t in fit.tolerated:
        if t["kind"] == "num_batches_tracked":
            fit.state_dict[t["key"]] = torch.zeros((), dtype=torch.long)


def _plan(ckpt: Any, walk: modelwalk.ModelWalk, state_dict: Any, sources: Sources, devices: DevicePlan,
          assign: bool | None) -> Plan:
    """Sort every key into copy / assign / sharded / by-torch; refuse (naming ``ckpt``'s path) what can't load: ties the file
    holds apart with different values, copies between sparse and dense, meta tensors nothing would fill."""
    plan = Plan()
    targets: dict[str, str] = {}  # saved device -> where it goes (asked once per device)

    def target(src: Any) -> str:
        tag = _tag(src, sources)
        if tag not in targets:
            targets[tag] = devices.target(tag)
        return targets[tag]

    slots = _slots(walk, state_dict)
    path = ckpt.path
    _refuse_untied(ckpt, slots, state_dict, sources)
    sources.fetch_ahead(state_dict[key] for key, slot in slots.items()  # a URL's storages, at once (not a shard's)
                        if key == slot.keys[0] and not shards.is_dtensor(slot.tensor))
    roots: dict[str, str] = {}  # modules whose to_empty materialises the DTensors whose shards are on meta
    sparse: list[str] = []  # built tensors a sparse tensor would be copied into (or out of)
    for key, slot in slots.items():
        if key != slot.keys[0]:
            continue  # a tied name: filled with its group's first
        src = state_dict[key]
        module = slot.places[0][0]
        plan.sources.append(src)
        if shards.is_dtensor(slot.tensor):
            shards.check_placements(key, slot.tensor, src)
            shards.source_pieces(src, sources)  # DCP chunk records read and checked here, not in the commit
            if slot.tensor.to_local().is_meta:
                device = shards.local_device(key, slot.tensor, devices, _tag(src, sources))
                roots.setdefault(shards.empty_root(key, walk.by_name), device)
            plan.sharded.append((slot, src))
        elif module in walk.own or (_quantized(src, slot.tensor) and not (slot.tensor.is_meta or assign)):
            # torch's load_state_dict assigns as given (the model's dtype and device first); a quantized tensor's
            # copy_ takes the source's scale and zero point, which a copy into a detached alias would drop
            view = sources.view(src)
            if slot.tensor.is_meta or assign:
                view = view.to(dtype=slot.tensor.dtype, device=target(src))
                plan.torch_assigns = True
            plan.by_torch.update((k, view) for k in slot.keys)
            plan.by_torch_places += slot.places
        elif slot.tensor.is_meta or assign:
            plan.assign.append((slot, sources.view(src), target(src)))
            plan.assign_places.append(sources.place(src))
        elif tensorcopy.is_sparse(src) or tensorcopy.is_sparse(slot.tensor):
            sparse.append(key)
        else:
            place = sources.place(src)
            plan.copy.append((slot, src if commit.reads(slot.tensor, src, place) else sources.view(src), place))
    _refuse_sparse_copies(path, sparse, state_dict, slots)
    plan.materialise = [(walk.by_name[path], device) for path, device in shards.outermost(roots).items()]
    _refuse_meta_left(path, walk, slots, plan)
    return plan


def _refuse_untied(ckpt: Any, slots: dict[str, Slot], state_dict: Any, sources: Sources) -> None:
    """The model ties names (one tensor) that the checkpoint holds apart with different values: loading would keep
    one and drop the other (torch's ``load_state_dict`` keeps the last silently; safetensors' ``load_model`` refuses):
    refused before anything is loaded (:func:`_same_twins` compares them)."""
    differ: list[str] = []
    crcs: dict[tuple[str, int, int], int] | None = None
    for key, slot in slots.items():
        if key != slot.keys[0] or len(slot.keys) < 2:
            continue
        first = state_dict[key]
        for other in slot.keys[1:]:
            src = state_dict[other]
            if ties.one_tensor(first, src) or any(tensorcopy.is_sparse(t) or _quantized(t, t) for t in (first, src)):
                continue  # (a sparse or quantized pair: loaded as torch loads it, the first name's)
            if crcs is None:
                crcs = _recorded_crcs(ckpt)
            if not _same_twins(first, src, slot.tensor.dtype, sources, crcs):
                differ.append(f"{key} and {other}")
    if differ:
        raise LoadError(f"{ckpt.path}: the model ties {few(differ)} (one tensor each), but the checkpoint holds different "
                        "values for them: loading would keep one and drop the other; nothing was loaded (safetensors' "
                        "load_model refuses this too). Build the model with them untied (e.g. tie_word_embeddings="
                        "False) to load both, or load a checkpoint saved from a model that ties them")


def _recorded_crcs(ckpt: Any) -> dict[tuple[str, int, int], int]:
    """The CRC-32 each stored tensor's bytes ``(path, offset, size)`` have, as the file's digests record them (a file
    ckptfix wrote: its safetensors output stores every tied name); none where it records none."""
    try:
        found = digests.read(ckpt.path, ckpt.format).digests or []
    except CkptfixError:  # (malformed digests: the load's own check says so, where it checks them)
        return {}
    return {(d.path, d.offset, d.size): d.crc for d in found}


def _same_twins(a: Any, b: Any, dtype: Any, sources: Sources, crcs: dict[tuple[str, int, int], int]) -> bool:
    """Two names the file stores apart hold the same values: the same bytes, each its whole storage — by the digests
    the file records for both (a file ckptfix wrote: no read), else compared in the file's mapping where it is leased,
    else 16 MiB at a time from the file —, or otherwise (a view, another dtype, a URL's) bit for bit once read and
    cast to the model's ``dtype``."""
    runs = [sources.segments(t) for t in (a, b)]
    whole = [r is not None and len(r) == 1 and t.is_contiguous() and t.storage_offset() == 0
             and r[0][2] == t.numel() * t.element_size() for r, t in zip(runs, (a, b))]
    if all(whole) and a.dtype == b.dtype and a.shape == b.shape and runs[0] is not None and runs[1] is not None:
        ra, rb = runs[0][0], runs[1][0]
        if ra in crcs and rb in crcs:
            return crcs[ra] == crcs[rb]
        if locations.hold(ra[0]) and locations.hold(rb[0]):  # (leased: its mapping can't meet a truncation)
            return ties.same_values(*(sources.view(t) for t in (a, b)))
        if not sources.reader.is_remote(ra[0]) and not sources.reader.is_remote(rb[0]):
            return _equal_runs(sources, ra, rb)
    return ties.same_values(*(sources.private(sources.view(t)).to(dtype) for t in (a, b)))  # (read, not mapped)


def _equal_runs(sources: Sources, a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    """Two equal-sized byte runs of local files hold the same bytes (read 16 MiB at a time: bounded memory)."""
    import torch

    step = 16 << 20
    bufs = [torch.empty(min(step, a[2]), dtype=torch.uint8) for _ in range(2)]
    for pos in range(0, a[2], step):
        n = min(step, a[2] - pos)
        for buf, (path, offset, _size) in zip(bufs, (a, b)):
            sources.reader.read_into(path, offset + pos, byte_view(buf[:n]), count=False)
        if not ties.equal_bytes(bufs[0][:n], bufs[1][:n]):
            return False
    return True


def _quantized(src: Any, dst: Any) -> bool:
    """Either is a quantized tensor (qint8, quint8 …: its values need its scale and zero point)."""
    return bool(getattr(src, "is_quantized", False) or getattr(dst, "is_quantized", False))


def _refuse_sparse_copies(path: str, keys: list[str], state_dict: Any, slots: dict[str, Slot]) -> None:
    """A sparse tensor (COO, CSR …) can't be copied into a built dense one, nor a dense one into a sparse one: torch's
    ``load_state_dict`` refuses it too (``copy_`` between dense and sparse tensors). Refused before anything is
    loaded; a meta-built model (or ``assign=True``) takes the sparse tensor itself, as torch's ``assign=True`` does."""
    if not keys:
        return
    shown_ = [f"{k} ({state_dict[k].layout} in the file, {slots[k].tensor.layout} in the model)" for k in keys]
    raise LoadError(f"{path}: {len(keys)} tensor(s) can't be copied between a sparse and a dense layout: {few(shown_)}; nothing "
                    "was loaded (torch's load_state_dict refuses this too). Densify them in the checkpoint "
                    "(tensor.to_dense()), or build the model on meta (or pass assign=True) to take the sparse tensors "
                    "as they are stored")


def _tag(src: Any, sources: Sources) -> str:
    """The device a source tensor was saved on."""
    return str(sources.refs[storage_id(src)].location if src.is_meta else src.device)


def _slots(walk: modelwalk.ModelWalk, state_dict: Any) -> dict[str, Slot]:
    """Model key → its Slot, for the keys the (repaired) state dict fills; tied keys share one Slot."""
    by_id: dict[int, Slot] = {}
    out: dict[str, Slot] = {}
    for key, value in walk.state_dict.items():
        if key not in state_dict or not hasattr(value, "shape"):
            continue
        module, name, is_param = walk.place(key)
        slot = by_id.get(id(value))
        if slot is None:
            slot = by_id[id(value)] = Slot([], [], value, is_param)
        slot.keys.append(key)
        slot.places.append((module, name))
        out[key] = slot
    return out


def _refuse_meta_left(path: str, walk: modelwalk.ModelWalk, slots: dict[str, Slot], plan: Plan) -> None:
    """Every model tensor on meta has something filling it: the state dict's and the non-persistent
    buffers, which no checkpoint holds."""
    filled = {id(s.tensor) for s, *_ in plan.assign} | {id(s.tensor) for s, _ in plan.sharded}
    filled |= {id(slots[k].tensor) for k in plan.by_torch if k in slots}
    left = [name for name, t in walk.tensors() if shards.on_meta(t) and id(t) not in filled]
    if left:
        raise LoadError(f"{path}: {len(left)} tensor(s) of the model are on the meta device and the checkpoint doesn't "
                        "fill them: "
                        f"{few(left)}; nothing was loaded. Give them values first (model.to_empty(device=...) and their "
                        "initialisation, e.g. non-persistent buffers), or load a checkpoint that holds them")


def _digests(ckpt: Any, plan: Plan, asked: bool | None, values: bool,
             distributed: shards.Agreement) -> list[digests.Digest] | None:
    """The digests a local file records, to check in the commit's pass over the mapped file (every tensor assigned:
    the value check's pass, or with ``asked`` (True) one for the CRC-32s alone where ``values`` are not checked);
    None where there are none, or after a pass of their own here — only when ``asked``: a fill writes into the
    model's tensors, and with its files leased nothing keeps what it replaces (docs/digests.md). With DTensors each
    rank reads only its share of the file, and a tensor's digest covers all of it: only when ``asked``, each rank
    checks its share of the digests (:func:`_share`) in a pass of its own, every rank told of any mismatch by the
    plan's agreement (a URL's: not checked)."""
    if plan.sharded:
        if asked and not locations.is_remote(ckpt.path):
            recorded = digests.read(ckpt.path, ckpt.format).digests
            digests.refuse(digests.mismatched(_share(recorded or [], lambda d: d.size, *distributed.rank_and_world())))
        return None
    if locations.is_remote(ckpt.path):  # the storages the plan fetched, each CRC-32 taken as it arrived
        digests.check(ckpt.path, ckpt.format)
        return None
    recorded = digests.read(ckpt.path, ckpt.format).digests
    if recorded is not None and (plan.copy or plan.by_torch or plan.sharded):
        if asked:
            digests.refuse(digests.mismatched(recorded))
        return None
    return recorded if asked or values else None


def _share(items: list[Any], size: Any, rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s share of ``items`` to check: the largest first (``size(item)`` bytes), each to the rank with the
    fewest bytes so far (every rank computes the same split), so each reads about 1/world of them."""
    loads, mine = [0] * world, []
    for n in sorted(range(len(items)), key=lambda n: (-size(items[n]), n)):
        least = loads.index(min(loads))
        loads[least] += size(items[n])
        if least == rank:
            mine.append(items[n])
    return mine


def _check_done(walk: modelwalk.ModelWalk, path: str) -> None:
    """After the commit, every parameter and buffer has real storage (the plan promised it; this proves it)."""
    left = modelwalk.left_on_meta(walk)
    if left:
        raise LoadError(f"{path}: after loading, {len(left)} tensor(s) of the model are still on the meta device: "
                        f"{few(left)} (a bug in ckptfix: please report it with CKPTFIX_DEBUG=1)")


def _precheck(plan: Plan, sources: Sources) -> list[str]:
    """strict_values: the keys whose values in the file are NaN/Inf, found before anything is loaded."""
    bad = []
    for slot, src, _place in plan.copy:
        bad += [] if tensorcopy.all_finite(sources.view(src)) else slot.keys
    for slot, src, _dev in plan.assign:
        bad += [] if tensorcopy.all_finite(src) else slot.keys
    for key, src in plan.by_torch.items():
        bad += [] if tensorcopy.all_finite(src) else [key]
    for slot, src in plan.sharded:
        bad += [] if shards.local_source_finite(slot.tensor, src, sources) else slot.keys
    return bad


def _check_records(plan: Plan, sources: Sources, distributed: shards.Agreement) -> None:
    """strict_values: each zip record the load reads matches the CRC-32 its zip records (each rank checks
    its share of the records); a mismatch raises FormatError naming the record, before anything is loaded."""
    records = list(dict.fromkeys(r for t in plan.sources if t.is_meta  # (a record with no CRC-32: nothing to check)
                                 and (r := source_record(sources.refs.get(storage_id(t)))) is not None and r.recorded))
    for record in _share(records, lambda r: r.size, *distributed.rank_and_world()):
        crc = sources.crc32(record.path, record.offset, record.size)
        if record.mismatch(crc):
            raise damaged(record, crc)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _values(keys: list[str]) -> str:
    return f"{len(keys)} tensor(s) hold NaN/Inf values: {few(keys)}"
