"""``load_into``'s commit: the planned fills done, all or nothing — whatever fails and whatever signal comes.

The files read are leased first (:class:`~ckptfix.core.rollback.Leases`: another process's write waits until the
commit ends). Where a lease can't be had, what the fills replace is saved first (:class:`~ckptfix.core.rollback.Undo`)
and put back if anything fails. SIGINT, SIGTERM and SIGHUP (where their handlers are Python's defaults, in the main
thread: :mod:`ckptfix.core.interrupts`) raise :class:`~ckptfix.errors.Interrupted` before the model is touched;
during the fills with an undo log, after it is put back ("nothing was loaded"); during a leased fill, which nothing
could undo, and while the assigned tensors are set, a SIGINT waits until the model is loaded ("the model holds the
checkpoint's values"): a KeyboardInterrupt caught in a notebook never leaves a half-loaded model behind. SIGTERM or
SIGHUP (the process is being ended), or a second SIGINT, stop a leased fill at once instead, saying the model is
partly loaded.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...core import checksums, filefill, interrupts, rollback, tensorcopy
from ...errors import FormatError, Interrupted, LoadError
from ...safety import digests
from . import shards

if TYPE_CHECKING:
    from ..sources import Sources


@dataclass
class Slot:
    """Where one model tensor lives: ``module.<name>``, a parameter or a buffer; tied keys share a Slot."""

    keys: list[str]
    places: list[tuple[Any, str]]  # (module, attribute name), one per tied name
    tensor: Any
    is_param: bool


@dataclass
class Plan:
    """What the commit step does, decided before anything is touched."""

    #: (slot, source, (path, offset) or None): the source a view of the mapped file, or — where the tensor is read
    #: straight from the file (:func:`reads`) — the meta tensor itself (no view made that nothing would use)
    copy: list[tuple[Slot, Any, Any]] = field(default_factory=list)
    assign: list[tuple[Slot, Any, str]] = field(default_factory=list)  # (slot, source view, target device)
    assign_places: list[tuple[str, int] | None] = field(default_factory=list)  # each assigned view's (path, offset)
    sharded: list[tuple[Slot, Any]] = field(default_factory=list)  # (slot, source on meta)
    by_torch: OrderedDict[str, Any] = field(default_factory=OrderedDict)  # key -> source view
    by_torch_places: list[tuple[Any, str]] = field(default_factory=list)  # (module, attribute) torch's load fills
    materialise: list[tuple[Any, str]] = field(default_factory=list)  # (module, device): to_empty before the fill
    torch_assigns: bool = False  # the by-torch keys are assigned (their module is on meta, or assign=True)
    sources: list[Any] = field(default_factory=list)  # every source tensor (on meta: its ref says where its bytes are)


#: what an interrupt says of the model
NOTHING_LOADED = "nothing was loaded"
LOADED_FIRST = "the load was under way and finished first: the model holds the checkpoint's values"
PARTLY_LOADED = "the load had failed: the model is partly loaded (the error above)"
CUT_SHORT = "the leased load, which nothing could undo, was stopped part way: the model is partly loaded"


def commit(model: Any, plan: Plan, state_dict: Any, sources: Sources, check: bool,
           recorded: list[digests.Digest] | None, ranks: shards.Agreement) -> list[str]:
    """Fill the model; the keys whose values are NaN/Inf (checked as they are copied, when ``check``; every rank's).
    The ``recorded`` digests (an assigning load's) are checked on the CRC-32s the value check takes, before any is
    set. Beside other ``ranks`` every rank keeps its undo log (if any) until all have filled — one collective, which
    each reaches whatever it raised — and puts it back if any failed: nothing is loaded on any rank where every rank
    kept one; a leased rank keeps none (a log is a second copy of what it reads), and the error says which ranks'
    fills stand."""
    with interrupts.signals_as_interrupts(), interrupts.held(outcome=LOADED_FIRST, failed=NOTHING_LOADED) as said:
        leases = rollback.Leases(local_files(plan, sources))  # (whole: a signal waits, then comes in _undone)
        undo: rollback.Undo | None = None
        to_meta: Callable[[], None] = _nothing
        bad: list[str] = []
        new: list[tuple[Slot, Any]] = []
        error: BaseException | None = None
        try:
            try:
                with _undone():
                    bad, new = _assigned(plan, sources, check, recorded, leases)  # (failing: the model as it was)
                undo = None if leases.held else rollback.Undo()
                said.failed = NOTHING_LOADED if undo else PARTLY_LOADED
                to_meta = shards.materialise(plan.materialise)  # DTensors' shards on meta, allocated (or, failing, none)
                said.cut = None if undo else CUT_SHORT  # (leased: SIGTERM, SIGHUP or a second SIGINT stop the fill)
                bad += _fill(model, plan, state_dict, sources, check, undo, leases)
                said.cut = None
            except BaseException as e:  # (its fills already put back, where logged)
                if undo is not None:
                    to_meta()  # (what was on meta, back on it)
                if not ranks.active:
                    raise
                error = e
            failed, loaded, bad = ranks.settle(error, bad, undone=undo is not None)
            if error is not None:
                if loaded and failed is not None and not isinstance(error, KeyboardInterrupt):  # (as every rank says)
                    raise LoadError(shards.failed_on(failed[0], failed[1], loaded)) from error
                raise error
            if failed is not None:  # another rank's: this one's fill put back, where it keeps a log
                if undo is not None:
                    undo.restore()
                    to_meta()
                raise LoadError(shards.failed_on(failed[0], failed[1], loaded))
            _set(new)
        finally:
            if undo is not None:
                undo.close()
            leases.release()
    return bad


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _undone() -> Iterator[None]:
    """A signal inside is raised at once (inside ``held()`` too), saying nothing was loaded: what was done is undone."""
    try:
        with interrupts.interruptible():
            yield
    except Interrupted as e:
        raise Interrupted(e.signum, outcome=NOTHING_LOADED) from None


def _assigned(plan: Plan, sources: Sources, check: bool, recorded: list[digests.Digest] | None,
              leases: rollback.Leases) -> tuple[list[str], list[Any]]:
    """The values the assigned slots take, built before anything is set; the keys whose values are NaN/Inf. A value
    in another dtype or on a GPU is read from the file through staging windows (:func:`filefill.fill_staged`)."""
    import torch

    bad: list[str] = []
    new = []
    tally = checksums.Tally() if recorded is not None else None
    mapped = [n for n, (slot, src, device) in enumerate(plan.assign) if device == "cpu" and src.dtype == slot.tensor.dtype]
    views_finite = iter(tensorcopy.all_finite_many([plan.assign[n][1] for n in mapped], check,  # (chunks at once)
                                                   [plan.assign_places[n] for n in mapped], tally))
    staged, staged_slots = [], []
    for (slot, src, device), place in zip(plan.assign, plan.assign_places):
        want = slot.tensor.dtype
        if device == "cpu" and src.dtype == want:
            value, finite = src, next(views_finite)
        elif tensorcopy.is_sparse(src):  # (assigned as torch assigns it: the layout kept)
            value = src.to(device=device, dtype=want)
            finite = not check or tensorcopy.all_finite(value)
        else:
            value = torch.empty(src.shape, dtype=want, device=device)
            if place is not None and reads(value, src, place):
                staged.append((value, sources.reader.fd(place[0]), place[1], src.dtype, place[0]))
                staged_slots.append(slot)
                finite = True  # (said by the staged fill)
            else:  # (no lease: its bytes read, not copied from the mapping, which a cut file would make SIGBUS)
                finite = tensorcopy.copy_checked(value, src if leases.held else sources.private(src), check)
        bad += [] if finite else slot.keys
        new.append((slot, value))
    for slot, finite in zip(staged_slots, filefill.fill_staged(staged, check, tally=tally, leases=leases)):
        bad += [] if finite else slot.keys
    if recorded is not None and tally is not None:
        digests.refuse(digests.tallied(recorded, tally))
    return bad, new


def _set(new: list[tuple[Slot, Any]]) -> None:
    import torch

    for slot, value in new:
        if slot.is_param:
            value = torch.nn.Parameter(value, requires_grad=slot.tensor.requires_grad)
        for module, name in slot.places:
            setattr(module, name, value)


def _fill(model: Any, plan: Plan, state_dict: Any, sources: Sources, check: bool,
          undo: rollback.Undo | None, leases: rollback.Leases) -> list[str]:
    """Write into the model's own tensors; on any failure, with ``undo``, put back what was replaced (a signal
    interrupts these fills). Without it (leased files) a read fails only if a writer waited out lease-break-time:
    the model is partly loaded."""
    try:
        with _undone() if undo is not None else contextlib.nullcontext():
            bad = _by_torch(model, plan, state_dict, sources, check, undo) if plan.by_torch else []
            shards.reshard(model)
            bad += _copy(plan.copy, sources, check, undo, leases)
            for slot, src in plan.sharded:
                if undo is not None:
                    undo.save_tensor(slot.tensor.to_local())  # (this rank's shard: what it fills)
                bad += [] if shards.fill_local(slot.tensor, src, sources, check) else slot.keys
        return bad
    except BaseException as e:
        if undo is not None:
            undo.restore()
        if type(e) is not FormatError or NOTHING_LOADED in str(e):
            raise
        if undo is None:
            raise FormatError(f"{e}; the model is partly loaded (the load held the file longer than the "
                              f"{rollback.break_time()} s another process's write waits: lease-break-time)") from e
        raise FormatError(f"{e}; {NOTHING_LOADED}") from e


def _copy(copies: list[tuple[Slot, Any, Any]], sources: Sources, check: bool, undo: rollback.Undo | None,
          leases: rollback.Leases) -> list[str]:
    """Fill built tensors, each one's old values saved in ``undo`` first (if any): read straight from the file into each
    CPU tensor whose bytes are as stored (contiguous, the same shape; the dtype as stored, else cast chunk by chunk from
    reads), else copied from the mapped view (strides, a device). The keys whose values are NaN/Inf (``check``)."""
    fills, keys, staged, staged_keys, bad = [], [], [], [], []
    for slot, src, place in copies:
        dst = slot.tensor.detach()
        if not reads(dst, src, place):
            if undo is not None:  # (no lease: its bytes read, not copied from the mapping, which a cut file makes SIGBUS)
                undo.save_tensor(dst)
                src = sources.private(src)
            bad += [] if tensorcopy.copy_checked(dst, src, check) else slot.keys
        elif dst.device.type == "cpu" and dst.dtype == src.dtype:
            fills.append((dst, sources.reader.fd(place[0]), place[1], place[0]))
            keys.append(slot.keys)
        else:
            staged.append((dst, sources.reader.fd(place[0]), place[1], src.dtype, place[0]))
            staged_keys.append(slot.keys)
    finite = filefill.fill_from_file(fills, check, undo, leases=leases)
    finite += filefill.fill_staged(staged, check, undo, leases=leases)
    return bad + [k for ok, names in zip(finite, keys + staged_keys) if not ok for k in names]


def reads(dst: Any, src: Any, place: tuple[str, int] | None) -> bool:
    """The built tensor ``dst`` is read from the file at ``place`` (a contiguous tensor of the source's shape, on the
    CPU or a GPU: straight into its memory where it is on the CPU in the file's dtype, else through staging windows),
    not copied from a view of the mapped file."""
    return (place is not None and dst.device.type in ("cpu", "cuda") and dst.is_contiguous() and dst.shape == src.shape
            and not (src.is_conj() or src.is_neg()))  # (a conjugate or negative view: its values aren't its bytes)


def _by_torch(model: Any, plan: Plan, state_dict: Any, sources: Sources, check: bool,
              undo: rollback.Undo | None) -> list[str]:
    """The modules that load their own way, through torch's ``load_state_dict``, what it replaces saved in
    ``undo`` (if any) first (the tensors it copies into, the attributes it assigns), their sources then read from the
    file, not copied from its mapping (no lease: a cut file is a FormatError, not SIGBUS); the keys whose values are
    NaN/Inf."""
    for module, name in plan.by_torch_places:
        if undo is not None:
            undo.keep(module, name)
            held = getattr(module, name)
            if held is not None and not shards.on_meta(held):
                undo.save_tensor(held)
    sub: Any = OrderedDict((k, v if undo is None else sources.private(v)) for k, v in plan.by_torch.items())
    sub._metadata = getattr(state_dict, "_metadata", None) or {}
    model.load_state_dict(sub, strict=False, assign=plan.torch_assigns)
    model_sd = model.state_dict()
    return [k for k in plan.by_torch if check and not tensorcopy.all_finite(model_sd[k])]


def local_files(plan: Plan, sources: Sources) -> dict[str, int] | None:
    """Every file the commit reads, with the size the plan checked; None when one is remote (nothing to lease)."""
    paths = {seg[0] for t in plan.sources if t.is_meta for seg in sources.segments(t) or []}
    if any(sources.reader.is_remote(p) for p in paths):
        return None
    return {p: sources.reader.size(p) for p in sorted(paths)}
