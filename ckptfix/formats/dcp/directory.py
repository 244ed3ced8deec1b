"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``__R_S.distcp`` files.

Reading consolidates every sharded tensor into one whole tensor (``.metadata`` is unpickled under
an allow-list: see :mod:`ckptfix.safety.dcp_policy`). A tensor stored as one chunk is mapped from its ``.distcp``
file (no copy); a sharded one (FSDP2, …) is assembled chunk by chunk into a file-backed scratch
mapping under TMPDIR, so anonymous memory stays bounded by one chunk however large the
checkpoint. A structure read (on meta) gives each tensor a :class:`.chunks.TensorRef`, so a
conversion copies FSDP2's dim-0 chunks straight into place in its output, without the scratch
file (``chunks``). Keys DCP flattened from nested dicts (``model.0.weight`` from
``{"model": {"0.weight": …}}``) are nested again from its planner data. A Lightning ``meta.pt``
beside the DCP files joins them into one checkpoint (``lightning``). Writing is torch's own
``torch.distributed.checkpoint.save`` in one process.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ...core import interrupts
from ...core.atomic import DirOutput, atomic_dir
from ...core.devices import storage_id
from ...errors import CkptfixError, ConversionError, FormatError
from ...parse.format_registry import DCP
from ...safety import digests
from ...safety.dcp_policy import METADATA, load_metadata
from ..base import PiecedRef, RawRead, Reader
from .chunks import Chunks, Scratch, TensorRef, aligned, tensor_nbytes, whole
from . import sidecar
from .lightning import with_meta
# what a DCP output consists of (FileSystemWriter, single_file_per_rank): all that --force replaces
DIR_OUTPUT = DirOutput("DCP", re.compile(r"\.metadata|__\d+_\d+\.distcp|" + re.escape(digests.SIDECAR)), METADATA)


def read(path: str, plan: Any, trust: bool, read_meta: Reader) -> RawRead:
    """Consolidate the DCP checkpoint in directory ``path``: one whole tensor per entry, nested again;
    a Lightning ``meta.pt`` beside it read by ``read_meta(meta_path, fmt)``.

    With ``plan.is_meta`` tensors come back on meta and no tensor record is read (plain values,
    such as an optimizer's hyper-parameters, still are).
    """
    meta = load_metadata(path, trust)
    source = Chunks(path, meta)
    refs: dict[int, PiecedRef] = {}
    try:
        flat, tags, sharded = _consolidate(meta, source, plan, trust, refs)
    except CkptfixError:
        raise
    except (AttributeError, TypeError, ValueError, IndexError, KeyError, RuntimeError) as e:
        raise FormatError(f"{source.meta_path}: malformed DCP metadata ({type(e).__name__}: {e})") from None
    finally:
        source.close()
    files = {info.relative_path for info in meta.storage_data.values()}
    notes = [f"consolidated {len(flat)} DCP entries ({sharded} tensors sharded in chunks) from {len(files)} file(s)"]
    if set(tags) - set(refs):
        refs = {}  # tensors inside plain values have no byte ranges: a conversion loads them all instead
    raw = RawRead(obj=unflatten(flat, meta.planner_data, source.meta_path), format=DCP, tags=tags, notes=notes,
                  refs=refs)

    return with_meta(raw, path, read_meta)  # Lightning's meta.pt beside the DCP files, if there is one


def _consolidate(meta: Any, source: Chunks, plan: Any, trust: bool,
                 refs: dict[int, PiecedRef]) -> tuple[dict[str, Any], dict[int, str], int]:
    """Every entry, nested keys still flat; on meta ``refs`` gets a :class:`TensorRef` per tensor."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    dev = "cpu" if plan.user_fn is not None else plan.target("cpu")
    entries = meta.state_dict_metadata
    tensors = {fqn: md for fqn, md in entries.items() if isinstance(md, TensorStorageMetadata)}
    for fqn, md in tensors.items():
        source.check_geometry(fqn, md)
        if dev != "meta":
            source.check_records(fqn, md)  # before the scratch mapping the metadata sizes
    sharded = [md for md in tensors.values() if not whole(md)]
    scratch = None if dev == "meta" else Scratch(sum(aligned(tensor_nbytes(md)) for md in sharded))
    flat: dict[str, Any] = {}
    tags: dict[int, str] = {}
    for fqn, md in entries.items():
        if fqn in tensors:
            t = source.tensor(fqn, md, scratch)
            if dev not in ("cpu", "meta"):
                t = t.to(dev)
            elif dev == "meta":
                refs[storage_id(t)] = TensorRef(source, fqn, md)
            tags[storage_id(t)] = "cpu"
            flat[fqn] = t
        elif isinstance(md, BytesStorageMetadata):
            flat[fqn] = source.value(fqn, plan, trust, tags)
        else:
            raise FormatError(f"{source.meta_path}: entry {fqn!r} has unknown storage type {type(md).__name__}")
    return flat, tags, len(sharded)


def unflatten(flat: dict[str, Any], planner_data: Any, source: str) -> OrderedDict:
    """Nest DCP's flat keys again with its planner data (fqn → path of dict keys / list indices).

    The planner data also keeps the saved state dict's key order (the metadata lists entries rank by
    rank, so a buffer deduplicated onto rank 1 would come after every parameter).
    """
    root: OrderedDict = OrderedDict()
    paths = planner_data if isinstance(planner_data, dict) else {}
    for fqn in [*(k for k in paths if k in flat), *(k for k in flat if k not in paths)]:
        value = flat[fqn]
        path = paths.get(fqn) or (fqn,)
        if not isinstance(path, (tuple, list)) or not all(isinstance(p, (str, int)) for p in path):
            raise FormatError(f"{source}: the planner data gives {fqn!r} the path {path!r}, not a key path")
        cur: Any = root
        for key, nxt in zip(path[:-1], path[1:]):
            child = _get(cur, key)
            if child is None:
                child = [] if isinstance(nxt, int) else OrderedDict()
                _put(cur, key, child, len(flat), source)
            elif not isinstance(child, (dict, list)):
                raise FormatError(f"{source}: {fqn!r} nests inside {key!r}, which holds a value")
            cur = child
        _put(cur, path[-1], value, len(flat), source)
    return root


def _get(container: Any, key: Any) -> Any:
    if isinstance(container, list):
        return container[key] if isinstance(key, int) and 0 <= key < len(container) else None
    return container.get(key)


def _put(container: Any, key: Any, value: Any, limit: int, source: str) -> None:
    if isinstance(container, list):
        if not isinstance(key, int) or not 0 <= key < limit:
            raise FormatError(f"{source}: list index {key!r} in the planner data is out of range")
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def write(state_dict: Any, dst_dir: str, force: bool = False, key: str | None = None) -> list[str]:
    """Save ``state_dict`` (or ``{key: state_dict}``) as a DCP directory, atomically, with torch's
    own ``torch.distributed.checkpoint.save`` in this process alone.

    Load it the way FSDP2 training resumes: ``sd = get_model_state_dict(model)``;
    ``dcp.load(sd, checkpoint_id=dst_dir)`` (``{key: sd}`` when written under ``key``);
    ``set_model_state_dict(model, sd)``.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in _leaves(state_dict)):
        raise ConversionError("tensors were loaded on 'meta' (no data): load them on cpu to write a DCP checkpoint")
    notes = []
    if getattr(state_dict, "_metadata", None) is not None:
        notes.append("_metadata (module versions) is not kept: DCP has no place for it")
    with atomic_dir(dst_dir, force, DIR_OUTPUT, notes) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
        try:
            dcp.save({key: state_dict} if key else state_dict, storage_writer=writer, no_dist=True)
        except CheckpointException as e:
            raise _unwrap(e) from None
        sidecar.add(tmp)
    notes.append(f"written under {key!r}: load with torch.distributed.checkpoint.load({{{key!r}: sd}}, …)" if key
                 else "written with the state dict's keys at the top level")
    return notes


def _unwrap(e: Any) -> BaseException:
    """What failed inside ``dcp.save``, out of the CheckpointException it wraps every rank's error in.

    DCP catches BaseException, so a Ctrl-C arrives as a CheckpointException (itself a BaseException,
    its message the rank's whole traceback), often with the KeyboardInterrupt only in the context
    of the RuntimeError torch's zip writer raised on its way out ("unexpected pos …"), as is an
    OSError (a full disk). The interrupt comes back as itself, an OSError as itself for the atomic
    writer to report, anything else as a one-line ConversionError.
    """
    failures = [exc for exc, _trace in getattr(e, "failures", {}).values()]
    for exc in failures:
        interrupt = interrupts.cause(exc)
        if interrupt is not None:
            return interrupt
    for exc in failures:  # torch.save's zip writer meets the OSError mid-record and raises its own on the way out
        written = next((e for e in _chain(exc) if isinstance(e, OSError)), None)
        if written is not None:
            return written
    first = failures[0] if failures else e
    text = (str(first).strip().splitlines() or [type(first).__name__])[0 if failures else -1]
    return ConversionError(f"torch.distributed.checkpoint.save failed: {type(first).__name__}: {text}")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _leaves(obj: Any) -> Any:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj
