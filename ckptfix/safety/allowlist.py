"""The allow-list: every global an untrusted pickle may name, each once, with what may be done with it.

torch's ``weights_only`` defaults name tensors, storages, dtypes, ``OrderedDict``, ``Counter``,
``set``, ``complex`` and friends (:mod:`ckptfix.core.torch_tables` keeps torch's own list); training
checkpoints also hold hyper-parameters (``argparse.Namespace``), numpy scalars and arrays, paths,
timestamps and torch's version string. :data:`RULES` holds a :class:`Rule` for each of ckptfix's
additions and for each of torch's defaults that ckptfix treats specially. Everything else reads it:
the unpickler's policy and its guards (:mod:`ckptfix.safety.guards`), the static scanner
(:mod:`ckptfix.safety.static_checks`), the DCP metadata reader. :func:`classify` names a global
``safe`` (torch's own), ``allowed`` (ckptfix's additions) or ``unsafe`` (anything else).

Being named is not enough to be called: a rule's ``call`` names the guard that checks a call's
arguments (``torch.ByteTensor(n)`` has none: uninitialised memory), and BUILD reaches only what a
rule's ``build`` allows. Nothing here imports torch or numpy at import time.

Names other modules must refer to are constants below, so each name is spelled once in the package
(``tests/safety/test_safety.py`` checks that no other module spells one).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from ..core.torch_tables import torch_safe_names

SAFE, ALLOWED, UNSAFE = "safe", "allowed", "unsafe"
INERT = "inert"  # a class read as inert data (its keys and values), never imported: OmegaConf's configs
TORCH, CKPTFIX = "torch", "ckptfix"  # a rule's origin: torch's weights_only defaults, or ckptfix's additions
NEW, GUARD = "new", "guard"  # how NEWOBJ may create a global (see Rule.new)


@dataclass(frozen=True)
class Rule:
    """What may be done with one allowed global.

    ``origin``: :data:`TORCH` (the object is torch's, from its weights_only table) or :data:`CKPTFIX`.
    ``call``: the guard a call (REDUCE, OBJ, INST) goes through, by name: the loader's in
    :mod:`ckptfix.safety.guards`, the scanner's static check of the same name in
    :mod:`ckptfix.safety.static_checks`; None: never called.
    ``stand_in``: what the unpickler gives instead of the real object (a stand-in or an inert token,
    made by :mod:`ckptfix.safety.guards`); None: the real object.
    ``new``: NEWOBJ may create it: :data:`NEW` with ``cls.__new__`` (then BUILD gives it state),
    :data:`GUARD` through its call guard; None: the scanner refuses NEWOBJ (the loader still sends a
    NEWOBJ of a guarded callable through its guard).
    ``build``: BUILD may give state to what it makes, and how: ``attributes`` (pickle's default, a dict
    of attributes), ``setstate`` (the stand-in's own checking ``__setstate__``), ``tensor`` (legacy
    ``set_`` inside the storage), ``numpy dtype``/``numpy array`` (numpy's stand-ins).
    ``refused``: one of torch's defaults that ckptfix never calls (no bounds checks, or not plain data).
    A rule whose ``stand_in`` is :data:`INERT_DATA` names a class read as data: the unpickler gives an
    inert placeholder for it (:mod:`ckptfix.parse.inert`), created only by NEWOBJ with no arguments
    and given its state by BUILD, never imported; :func:`classify` calls it :data:`INERT`.
    """

    origin: str = CKPTFIX
    call: str | None = None
    stand_in: str | None = None
    new: str | None = None
    build: str | None = None
    refused: bool = False


# Names other modules refer to (each spelled once, here).
ORDERED_DICT = "collections.OrderedDict"
#: the global a ``getattr(cls, name)`` reduce names (mmengine's HistoryBuffer statistics methods)
GETATTR = "builtins.getattr"
BUILTIN_SET = "builtins.set"
BUILTIN_COMPLEX = "builtins.complex"
CODECS_ENCODE = "_codecs.encode"
TORCH_SIZE = "torch.Size"
GET_LAYOUT = "torch.serialization._get_layout"
REBUILD_TENSOR = "torch._utils._rebuild_tensor"
REBUILD_TENSOR_V2 = "torch._utils._rebuild_tensor_v2"
REBUILD_TENSOR_V3 = "torch._utils._rebuild_tensor_v3"
REBUILD_PARAMETER = "torch._utils._rebuild_parameter"
REBUILD_PARAMETER_WITH_STATE = "torch._utils._rebuild_parameter_with_state"
REBUILD_NESTED_TENSOR = "torch._utils._rebuild_nested_tensor"
HISTORY_BUFFER = "mmengine.logging.history_buffer.HistoryBuffer"
NDARRAY = "numpy.ndarray"
NUMPY_DTYPE = "numpy.dtype"
#: numpy's DType classes (numpy >= 1.25): a family, not listed: the plain numeric/bool ones are allowed
NUMPY_DTYPE_CLASSES = "numpy.dtypes."
_NUMPY = "numpy."

INERT_DATA = "inert data"
#: the stand-in of a torchao tensor class: a name, only the class argument of torch's wrapper-subclass rebuild
SUBCLASS = "tensor subclass"
#: torch's dense CPU tensor classes, which a legacy pickle calls empty and gives a view by BUILD
_LEGACY_TENSOR = Rule(TORCH, call="empty tensor", build="tensor")
_VIEW = Rule(TORCH, call="view", build="tensor")
_PLAIN = Rule(call="plain")
_FACTORY = Rule(stand_in="factory token")  # a defaultdict's default_factory: a token, never called
_PATH = Rule(call="plain", stand_in="path")  # the other OS's concrete class loads as its pure counterpart
_CONFIG = Rule(stand_in=INERT_DATA, new=NEW, build=INERT_DATA)  # NEWOBJ cls (), BUILD state: recorded only
_TYPE_VALUE = Rule(stand_in=INERT_DATA)  # a type annotation in OmegaConf's metadata: a name, never called

#: OmegaConf's containers and nodes (Hydra's configs, Lightning's hyper-parameters of a Hydra project), read as
#: plain data by :mod:`ckptfix.safety.configs`: a container's ``_content``, a node's ``_val``
OMEGACONF_CONTAINERS = ("omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig")
OMEGACONF_BOXES = ("omegaconf.base.UnionNode",)  # holds one node in ``_content``
OMEGACONF_NODES = ("omegaconf.nodes.AnyNode", "omegaconf.nodes.StringNode", "omegaconf.nodes.PathNode",
                   "omegaconf.nodes.IntegerNode", "omegaconf.nodes.BytesNode", "omegaconf.nodes.FloatNode",
                   "omegaconf.nodes.BooleanNode", "omegaconf.nodes.EnumNode", "omegaconf.nodes.LiteralNode",
                   "omegaconf.nodes.NoneNode", "omegaconf.nodes.InterpolationResultNode", "omegaconf.nodes.ValueNode")
_OMEGACONF_METADATA = ("omegaconf.base.Metadata", "omegaconf.base.ContainerMetadata")
_TYPING = ("typing.Any", "typing.Dict", "typing.List", "typing.Tuple")  # ref_type/key_type/element_type values

#: torchao 0.18's quantized tensor classes (those its own safetensors support allows), read as their inner
#: tensors by :mod:`ckptfix.safety.subclasses`, never imported; and what their state holds: enums (REDUCE of
#: one value: an inert member) and dataclasses (NEWOBJ, BUILD: inert data)
TORCHAO_SUBCLASSES = ("torchao.quantization.Int8Tensor", "torchao.quantization.Float8Tensor",
                      "torchao.quantization.Int4Tensor", "torchao.quantization.Int4PlainInt32Tensor",
                      "torchao.quantization.Int4TilePackedTo4dTensor", "torchao.quantization.IntxUnpackedToInt8Tensor")
_TORCHAO_ENUMS = ("torchao.quantization.quantize_.common.kernel_preference.KernelPreference",
                  "torchao.quantization.quant_primitives.MappingType")
_TORCHAO_DATA = ("torchao.quantization.granularity.PerRow", "torchao.quantization.granularity.PerTensor",
                 "torchao.quantization.quantize_.workflows.int8.int8_tensor.QuantizeTensorToInt8Kwargs",
                 "torchao.quantization.quantize_.workflows.float8.float8_tensor.QuantizeTensorToFloat8Kwargs")

#: every global a pickle may name beyond torch's plain defaults (name as pickled: ``module.qualname``)
RULES: dict[str, Rule] = {
    # torch's defaults, called through guards (the rest of torch's list are values: classes, dtypes)
    ORDERED_DICT: Rule(TORCH, call="plain", build="attributes"),
    "collections.Counter": Rule(TORCH, call="plain", build="attributes"),
    BUILTIN_SET: Rule(TORCH, call="plain"),
    BUILTIN_COMPLEX: Rule(TORCH, call="plain"),
    "builtins.bytearray": Rule(TORCH, call="bytearray"),  # within max_alloc_bytes
    CODECS_ENCODE: Rule(TORCH, call="codecs encode"),  # only the encodings pickle writes bytes with
    TORCH_SIZE: Rule(TORCH, call="plain"),
    "torch.device": Rule(TORCH, call="plain"),
    GET_LAYOUT: Rule(TORCH, call="plain"),
    "torch.nn.parameter.Parameter": Rule(TORCH, call="parameter", new=GUARD, build="tensor"),
    REBUILD_TENSOR: Rule(TORCH, call="view v1", build="tensor"),  # views inside their storage
    REBUILD_TENSOR_V2: _VIEW,
    REBUILD_TENSOR_V3: Rule(TORCH, call="view v3", build="tensor"),
    "torch._utils._rebuild_qtensor": Rule(TORCH, call="qtensor"),  # inside its storage, per-channel params fit
    REBUILD_NESTED_TENSOR: Rule(TORCH, call="nested tensor"),  # each component inside the buffer
    REBUILD_PARAMETER: Rule(TORCH, call="rebuild parameter"),  # no hooks, plain state
    REBUILD_PARAMETER_WITH_STATE: Rule(TORCH, call="rebuild parameter"),
    "torch._utils._rebuild_sparse_tensor": Rule(TORCH, call="sparse tensor"),  # indices inside its size
    "torch._utils._rebuild_meta_tensor_no_storage": Rule(TORCH, call="plain"),  # no memory: meta
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": Rule(TORCH, call="device tensor"),
    "torch._tensor._rebuild_from_type_v2": Rule(TORCH, call="from type"),  # plain tensors only
    # legacy pickles: torch.FloatTensor() (REDUCE, no arguments: an empty tensor), then BUILD's set_ inside the storage
    "torch.Tensor": _LEGACY_TENSOR, "torch.DoubleTensor": _LEGACY_TENSOR, "torch.FloatTensor": _LEGACY_TENSOR,
    "torch.HalfTensor": _LEGACY_TENSOR, "torch.BFloat16Tensor": _LEGACY_TENSOR, "torch.LongTensor": _LEGACY_TENSOR,
    "torch.IntTensor": _LEGACY_TENSOR, "torch.ShortTensor": _LEGACY_TENSOR, "torch.CharTensor": _LEGACY_TENSOR,
    "torch.ByteTensor": _LEGACY_TENSOR, "torch.BoolTensor": _LEGACY_TENSOR,
    # a storage-less wrapper subclass: only torchao's tensor classes, kept as a record (ckptfix.safety.subclasses)
    "torch._utils._rebuild_wrapper_subclass": Rule(TORCH, call="wrapper subclass"),
    # torch's defaults ckptfix refuses: tensors from numpy arrays
    "torch._utils._rebuild_device_tensor_from_numpy": Rule(TORCH, refused=True),
    # ckptfix's additions
    "argparse.Namespace": Rule(call="empty", new=NEW, build="attributes"),  # hyper-parameters
    "collections.defaultdict": Rule(call="defaultdict", stand_in="defaultdict"),  # a real one once loaded
    "collections.deque": Rule(call="plain", stand_in="deque"),
    "datetime.datetime": _PLAIN,  # timestamps: built from bytes, numbers, fixed offsets
    "datetime.date": _PLAIN,
    "datetime.time": _PLAIN,
    "datetime.timedelta": _PLAIN,
    "datetime.timezone": _PLAIN,
    "torch.torch_version.TorchVersion": Rule(call="plain", new=NEW, build="attributes"),  # a str subclass
    "builtins.list": _FACTORY,
    "builtins.dict": _FACTORY,
    "builtins.int": _FACTORY,
    "builtins.float": _FACTORY,
    "builtins.str": _FACTORY,
    "builtins.tuple": _FACTORY,
    "builtins.bool": _FACTORY,
    "builtins.bytes": Rule(call="empty bytes", stand_in="empty bytes"),  # protocol 2 pickles b"" as bytes()
    "pathlib.PosixPath": _PATH,
    "pathlib.WindowsPath": _PATH,
    "pathlib.PurePosixPath": _PATH,
    "pathlib.PureWindowsPath": _PATH,
    "pathlib._local.PosixPath": _PATH,  # Python 3.13
    "pathlib._local.WindowsPath": _PATH,
    "pathlib._local.PurePosixPath": _PATH,
    "pathlib._local.PureWindowsPath": _PATH,
    # numpy: plain numeric/bool dtypes, arrays and scalars only (ckptfix.safety.numpy_policy)
    NUMPY_DTYPE: Rule(call="numpy dtype", stand_in="numpy dtype", build="numpy dtype"),
    NDARRAY: Rule(stand_in="ndarray token"),  # only as the subtype _reconstruct is given
    "numpy.core.multiarray._reconstruct": Rule(call="numpy reconstruct", stand_in="numpy reconstruct",
                                               build="numpy array"),
    "numpy._core.multiarray._reconstruct": Rule(call="numpy reconstruct", stand_in="numpy reconstruct",
                                                build="numpy array"),
    "numpy.core.multiarray.scalar": Rule(call="numpy scalar", stand_in="numpy scalar"),
    "numpy._core.multiarray.scalar": Rule(call="numpy scalar", stand_in="numpy scalar"),
    # mmengine's message_hub: HistoryBuffer as an inert stand-in, getattr only as getattr(HistoryBuffer,
    # 'min'|'max'|'current'|'mean') (a protocol-2 pickle of its statistics_methods): an inert token
    HISTORY_BUFFER: Rule(stand_in="history buffer", new=NEW, build="setstate"),
    GETATTR: Rule(call="getattr", stand_in="getattr"),
    # OmegaConf's DictConfig/ListConfig and their nodes and metadata: inert data, omegaconf never imported
    **{name: _CONFIG for name in (*OMEGACONF_CONTAINERS, *OMEGACONF_BOXES, *OMEGACONF_NODES, *_OMEGACONF_METADATA)},
    **{name: _TYPE_VALUE for name in _TYPING},
    # torchao: its tensor classes as names, the enums and dataclasses of their state as inert data
    **{name: Rule(stand_in=SUBCLASS) for name in TORCHAO_SUBCLASSES},
    **{name: Rule(call="enum value", stand_in="enum") for name in _TORCHAO_ENUMS},
    **{name: _CONFIG for name in _TORCHAO_DATA},
}

#: the rule of every allowed numpy DType class (:data:`NUMPY_DTYPE_CLASSES`): values, or called empty
NUMPY_DTYPE_CLASS = Rule(call="numpy dtype class")

#: torch's tensor and storage classes: values only (calling one hands out uninitialised memory), but for
#: a legacy tensor class called empty (their rule in :data:`RULES`)
VALUE_ONLY = re.compile(r"^torch\.(cuda\.)?(sparse\.)?\w*Tensor$|^torch\.(cuda\.)?\w*Storage$|"
                        r"^torch\.storage\.(Typed|Untyped)Storage$")

#: the encodings pickle writes bytes with (protocol < 3: ``_codecs.encode(str, 'latin1')``)
PICKLE_CODECS = frozenset({"latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"})


def rule(name: str) -> Rule | None:
    """The rule that governs the global ``name`` (``module.qualname``) where it is allowed (whether it
    is: :func:`classify`); None for torch's plain values and any other name."""
    found = RULES.get(name)
    if found is None and name.startswith(NUMPY_DTYPE_CLASSES):
        return NUMPY_DTYPE_CLASS
    return found


def refused_names() -> frozenset[str]:
    """torch's defaults that ckptfix refuses."""
    return frozenset(name for name, r in RULES.items() if r.refused)


@functools.lru_cache(maxsize=1)
def ckptfix_names() -> frozenset[str]:
    """ckptfix's additions to torch's defaults, less numpy's (see :func:`numpy_names`)."""
    return frozenset(name for name, r in RULES.items() if r.origin == CKPTFIX and not name.startswith(_NUMPY))


@functools.lru_cache(maxsize=1)
def numpy_names() -> frozenset[str]:
    """The numpy names allowed when numpy is installed (none without it), DType classes included."""
    if not _has_numpy():
        return frozenset()
    return frozenset(name for name in RULES if name.startswith(_NUMPY)) | frozenset(numpy_dtype_classes())


def _has_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:  # pragma: no cover - numpy is optional
        return False
    return True


@functools.lru_cache(maxsize=1)
def numpy_dtype_classes() -> dict[str, type]:
    """numpy's DType classes (numpy >= 1.25) of plain numeric/bool kinds: name → class."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return {}
    out = {}
    for name in dir(getattr(np, "dtypes", None) or ()):
        cls = getattr(np.dtypes, name)
        if name.endswith("DType") and isinstance(cls, type):
            try:
                plain = is_plain_dtype(cls())
            except TypeError:  # parametric (strings, datetimes): never plain
                plain = False
            if plain:
                out[f"{NUMPY_DTYPE_CLASSES}{name}"] = cls
    return out


def is_plain_dtype(dtype: Any) -> bool:
    """A numpy dtype of a plain numeric/bool kind: no fields, no objects, no sub-arrays."""
    return bool(type(dtype).__module__.startswith("numpy") and getattr(dtype, "fields", 1) is None
                and not dtype.hasobject and dtype.subdtype is None and dtype.kind in "biufc")


@functools.lru_cache(maxsize=1)
def torch_names() -> frozenset[str]:
    """torch's weights_only defaults (less the ones ckptfix refuses): the frozen table for the
    installed torch series (no torch import), else torch's own list."""
    names = torch_safe_names()
    if names is None:
        from torch._weights_only_unpickler import _get_allowed_globals

        names = frozenset(_get_allowed_globals())
    return names - refused_names()


def classify(module: str, name: str) -> str:
    """``safe`` (torch's weights_only defaults), ``allowed`` (ckptfix's additions), ``inert`` (read as
    data, never imported: :data:`INERT_DATA`) or ``unsafe``.

    Only exact names count, and a dotted attribute path never does: ``pathlib PosixPath.touch``
    reaches a method through an allowed class, and ``torch _utils.x`` is not how torch pickles.
    """
    full = f"{module}.{name}"
    if "." in name or not module:
        return UNSAFE
    if full in torch_names():
        return SAFE
    if full in ckptfix_names() or full.startswith(_NUMPY) and full in numpy_names():
        found = rule(full)
        return INERT if found is not None and found.stand_in == INERT_DATA else ALLOWED
    return UNSAFE
