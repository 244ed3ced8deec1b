"""Result objects: what was read (Checkpoint), converted (ConvertReport) and loaded (LoadReport).

Each has ``to_dict()`` giving the JSON the CLI prints with ``--json`` (fields listed in docs/json.md).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .core.devices import storage_id
from .errors import SelectError
from .statedict.locate import common_prefix, detect_framework
from .statedict.quant_groups import QuantLayout, find_groups, infos_of
from .statedict.quant_schemes import quant_config
from .core.units import shown
from .core.tensorinfo import TensorInfo, is_tensor, layout_name, shape_and_dtype, shape_of, sparse_parts
from .parse.inert import InertGlobal, InertObject
from .statedict.wrappers import strip_wrappers


@dataclass
class TensorStats:
    """Counts over a state dict's tensors; shared views are counted once."""

    num_tensors: int = 0
    num_params: int = 0
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    devices: dict[str, int] = field(default_factory=dict)
    non_tensors: list[str] = field(default_factory=list)


def tensor_stats(state_dict: Mapping[str, Any], tags: Mapping[int, str], default_tag: str | None = None) -> TensorStats:
    """Count tensors, elements, bytes, dtypes and saved devices (from ``tags``: storage id → tag).

    Tensors or :class:`~ckptfix.core.tensorinfo.TensorInfo` (whose storage id is ``id(info.storage)``)."""
    stats = TensorStats()
    dtypes: Counter = Counter()
    devices: Counter = Counter()
    seen: set[tuple] = set()
    for key, t in state_dict.items():
        if not is_tensor(t):
            stats.non_tensors.append(key)
            continue
        stats.num_tensors += 1
        nbytes = None
        if isinstance(t, TensorInfo):
            sid, dtype, device = id(t.storage), t.dtype, t.device
            view: tuple = (sid, t.storage_offset, t.shape, t.stride, dtype)
        elif layout_name(t) is not None:  # sparse: the bytes of its indices and values, saved where its values are
            parts = sparse_parts(t)
            sid, dtype, device = storage_id(parts[-1]), str(t.dtype).replace("torch.", ""), str(t.device)
            view, nbytes = (id(t),), sum(p.numel() * p.element_size() for p in parts)
        else:
            sid, dtype, device = storage_id(t), str(t.dtype).replace("torch.", ""), str(t.device)
            view = (sid, t.storage_offset(), tuple(shape_of(t)), None if t.is_nested else tuple(t.stride()), dtype)
        dtypes[dtype] += 1
        devices[tags.get(sid, default_tag or device)] += 1
        if view not in seen:
            seen.add(view)
            stats.num_params += t.numel()
            stats.nbytes += t.numel() * t.element_size() if nbytes is None else nbytes
    stats.dtypes = dict(dtypes)
    stats.devices = dict(devices)
    return stats


def describe_value(v: Any) -> str:
    """A short description of a non-state-dict entry: ``dict (2 entries)``, ``int 3``."""
    if is_tensor(v):
        shape, dtype = shape_and_dtype(v)
        layout = layout_name(v)
        return f"tensor {shape} {dtype}" + (f" {layout}" if layout is not None else "")
    if isinstance(v, Mapping):
        return f"{type(v).__name__} ({len(v)} entries)"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} ({len(v)} items)"
    if isinstance(v, (int, float, bool)) or v is None:
        return f"{type(v).__name__} {v!r}"
    if isinstance(v, str):
        return f"str {v[:40]!r}"
    if isinstance(v, (InertObject, InertGlobal)):
        return f"inert {shown(v.name)} (not imported)"
    return type(v).__name__


def _shape_row(key: str, t: Any) -> dict[str, Any]:
    if is_tensor(t):
        shape, dtype = shape_and_dtype(t)
        layout = layout_name(t)  # (only a sparse tensor's row has one: a strided tensor's row is as it was)
        return {"key": key, "shape": shape, "dtype": dtype, **({"layout": layout} if layout is not None else {})}
    return {"key": key, "shape": None, "dtype": describe_value(t) if isinstance(t, InertObject) else type(t).__name__}


@dataclass
class Checkpoint:
    """A whole checkpoint file: the model's state dict plus everything around it.

    Its tensors are real (``read``), on ``meta`` (``inspect``), or :class:`~ckptfix.core.tensorinfo.TensorInfo`
    (``describe``, read without torch); ``to_dict()`` renders all three alike."""

    path: str
    format: str
    state_dict: Any
    state_dict_key: str | None
    extra: dict[str, Any]
    wrappers: list[str]
    inner_wrappers: list[str]
    ema_keys: list[str]
    stats_of: Callable[[], TensorStats] | None = field(default=None, repr=False, compare=False)  # see stats
    notes: list[str] = field(default_factory=list)
    raw: Any = field(default=None, repr=False)  # the whole unpickled object, for keep_extra
    refs: dict = field(default_factory=dict, repr=False)  # storage id -> StorageRef (structure reads)
    bytes_fetched: int | None = None  # a remote checkpoint: the bytes describing it fetched (None: a local one)
    #: what the ``_metadata`` rule dropped (:mod:`ckptfix.statedict.metadata`), a line each, also in ``notes``;
    #: ``verify``'s findings
    metadata_dropped: list[str] = field(default_factory=list)
    #: a file holding no state dict (a bare tensor, a list, a dict of plain values; ``raw`` holds it, ``state_dict``
    #: is empty): the line ``load``, ``convert``, ``verify`` and ``diff`` refuse it with (:meth:`require_state_dict`)
    no_state_dict: str | None = None
    #: the config beside the file that holds its quantization (config.json / hf_quant_config.json), or None
    quant_config: dict[str, Any] | None = field(default=None, repr=False)
    #: ``inspect``/``describe``: the per-tensor digests (algorithm, count) and lineage a ckptfix output records
    provenance: dict[str, Any] = field(default_factory=dict)

    def require_state_dict(self) -> None:
        """Raise SelectError where the file holds no state dict (what ``read`` and ``inspect`` show whole)."""
        if self.no_state_dict is not None:
            raise SelectError(self.no_state_dict)

    @functools.cached_property
    def stats(self) -> TensorStats:
        """Counts over the state dict's tensors, computed when first read (``load_into`` never reads them)."""
        return self.stats_of() if self.stats_of is not None else tensor_stats(self.state_dict, {})

    @functools.cached_property
    def quantization(self) -> QuantLayout | None:
        """The state dict's quantized groups by the schemes table, their problems; None where nothing is quantized."""
        layout = find_groups(infos_of(self.state_dict), self.quant_config)
        return layout if layout.groups or layout.problems or layout.unknown else None

    @property
    def framework(self) -> str | None:
        """The training framework whose layout the file has (lightning, timm, mmengine, …)."""
        return detect_framework(self.raw)

    @property
    def common_prefix(self) -> str | None:
        """The leading segment all keys share after wrappers (e.g. Lightning's ``model.``)."""
        return common_prefix([strip_wrappers(k) for k in self.state_dict])

    @property
    def devices(self) -> dict[str, int]:
        return self.stats.devices

    @property
    def dtypes(self) -> dict[str, int]:
        return self.stats.dtypes

    @property
    def num_params(self) -> int:
        return self.stats.num_params

    @property
    def num_tensors(self) -> int:
        return self.stats.num_tensors

    @property
    def nbytes(self) -> int:
        return self.stats.nbytes

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object; ``keys`` lists every key (the text shows the first and last five)."""
        keys = list(self.state_dict.keys())
        return {
            "path": self.path,
            "format": self.format,
            "state_dict_key": self.state_dict_key,
            "ema_keys": self.ema_keys,
            "framework": self.framework,
            "common_prefix": self.common_prefix,
            "wrappers": self.wrappers,
            "inner_wrappers": self.inner_wrappers,
            "num_tensors": self.stats.num_tensors,
            "num_params": self.stats.num_params,
            "nbytes": self.stats.nbytes,
            "dtypes": self.stats.dtypes,
            "devices": self.stats.devices,
            "non_tensor_keys": self.stats.non_tensors,
            "extra": {k: describe_value(v) for k, v in self.extra.items()},
            "has_metadata": getattr(self.state_dict, "_metadata", None) is not None,
            "keys": [_shape_row(k, self.state_dict[k]) for k in keys],
            "num_keys": len(keys),
            "notes": self.notes,
            **({"bytes_fetched": self.bytes_fetched} if self.bytes_fetched is not None else {}),
            **({"no_state_dict": self.no_state_dict} if self.no_state_dict is not None else {}),
            **({"quantization": quantization_dict(self.quantization, self.quant_config)}
               if self.quantization is not None else {}),
            **self.provenance,
        }


def quantization_dict(layout: QuantLayout, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``inspect --json``'s ``quantization``: groups per scheme, each group, each problem, what looks quantized
    but matches no scheme, and the config's ``quant_method``."""
    return {
        "quant_method": quant_config(config).get("quant_method"),
        "schemes": layout.counts(),
        "groups": [{"module": g.module, "scheme": g.scheme, "weight": g.weight, "companions": g.companions,
                    **({"also": list(g.also)} if g.also else {})} for g in layout.groups],
        "problems": [{"module": p.module, "key": p.key, "kind": p.kind, "message": p.message} for p in layout.problems],
        "unknown": layout.unknown,
    }


@dataclass
class ConvertReport:
    """What ``convert`` did."""

    src: str
    dst: str
    format_in: str
    format_out: str
    to: str
    state_dict_key: str | None
    ema_keys: list[str]
    wrappers_before: list[str]
    wrappers_after: list[str]
    renamed: int
    num_tensors: int
    nbytes: int  # tensor bytes written (after a dtype cast)
    kept_extra: list[str]
    streamed: bool = False
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_rss: int = 0
    sha256_in: str | None = None
    sha256_out: str | None = None
    dtype_cast: dict[str, int] | None = None
    notes: list[str] = field(default_factory=list)
    nbytes_in: int = 0  # tensor bytes in the source (differs from nbytes after a dtype cast)
    bytes_fetched: int | None = None  # a remote source: the bytes fetched over the network (None: a local one)
    signature: str | None = None  # --sign: where the output's signature was written
    #: what a ``--dtype`` or ``--dequantize`` did to quantized groups (:func:`ckptfix.ops.quantized.summary`): ``kept``
    #: and ``dequantized`` (scheme → groups), ``dtype``, ``dropped``, ``unknown``; None where it met none
    quantized: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for optional in ("bytes_fetched", "signature", "quantized"):  # present only where they apply
            if d[optional] is None:
                del d[optional]
        return d


@dataclass
class LoadReport:
    """What ``load_into`` did: the key adaptation applied and what did not match."""

    path: str
    state_dict_key: str | None
    checkpoint_wrappers: list[str]
    model_wrappers: list[str]
    fix: str | None
    matched: int
    missing: list[str]
    unexpected: list[str]
    notes: list[str] = field(default_factory=list)
    tolerated: list[str] = field(default_factory=list)  # missing keys filled in: num_batches_tracked, tied twins
    nonfinite: list[str] = field(default_factory=list)  # keys loaded holding NaN/Inf (refused with strict_values)
    copied: int = 0  # model keys filled in place (a built model's tensors)
    assigned: int = 0  # model keys given new tensors (meta-built, or assign=True): views of the file or materialised
    sharded: int = 0  # model keys that are DTensors: this rank's shards filled
    bytes_read: int = 0  # tensor bytes this process read from the checkpoint
    bytes_fetched: int | None = None  # a remote checkpoint: the bytes this process fetched (headers too; None: local)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
