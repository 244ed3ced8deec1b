"""Model specs → ``nn.Module``: ``torchvision:NAME``, ``pkg.mod:callable``, ``path/to/file.py:callable``.

``--arg NAME=VALUE`` values are Python literals where they parse (``num_classes=10``,
``dims=[64,128]``), else strings (``model_name=resnet18``). Every failure is a ModelSpecError
that says which part of the spec is wrong and why.

>>> build_model("torchvision:resnet18", {"num_classes": 10})   # doctest: +SKIP
"""

from __future__ import annotations

import ast
import copy
import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import CkptfixError, InputError, ModelSpecError
from ..core.units import dtype_name
from ..statedict.transforms import parse_dtype

#: torchvision.models subpackages whose models are not 3×224×224 image classifiers.
_NOT_CLASSIFIERS = ("detection", "segmentation", "video", "optical_flow")


def parse_model_args(pairs: Iterable[str]) -> dict[str, Any]:
    """``['num_classes=10', 'model_name=resnet18']`` → ``{'num_classes': 10, 'model_name': 'resnet18'}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ModelSpecError(f"--arg {pair!r}: expected NAME=VALUE, e.g. num_classes=10")
        try:
            out[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            out[name] = text
    return out


def split_spec(spec: str) -> tuple[str, str]:
    """``'a/b.py:build'`` → ``('a/b.py', 'build')``; the last ``:`` splits (so ``C:\\x.py:f`` works)."""
    where, sep, attr = str(spec).rpartition(":")
    if not sep or not where or not attr:
        raise ModelSpecError(
            f"model spec {spec!r}: expected torchvision:NAME, package.module:callable or path/to/file.py:callable"
        )
    return where, attr


def build_model(spec: str, args: Mapping[str, Any] | None = None) -> Any:
    """Build the model a spec names, with keyword ``args``; a ModelSpecError says why it can't."""
    return find_builder(spec)(args)


def find_builder(spec: str) -> Callable[[Mapping[str, Any] | None], Any]:
    """The builder a spec names, found (its file run, its module imported, a torchvision name checked) but not
    called: a spec that names nothing is a ModelSpecError before any checkpoint is read."""
    where, attr = split_spec(spec)
    if where == "torchvision":
        return _torchvision(attr, spec)
    if where.endswith(".py") or os.sep in where or "/" in where:
        factory = _attribute(_module_from_file(where, spec), attr, spec)
    else:
        factory = _attribute(_import(where, spec), attr, spec)
    return lambda args: call_factory(factory, dict(args or {}), spec)


def _torchvision(name: str, spec: str) -> Callable[[Mapping[str, Any] | None], Any]:
    from torchvision import models

    available = models.list_models()
    if name.lower() not in available:
        close = difflib.get_close_matches(name.lower(), available, n=5, cutoff=0.6)
        hint = f"; similar: {', '.join(close)}" if close else "; `torchvision.models.list_models()` lists them"
        raise ModelSpecError(f"model spec {spec!r}: torchvision has no model {name!r}{hint}")
    builder = models.get_model_builder(name.lower())

    def build(given: Mapping[str, Any] | None) -> Any:
        args = dict(given or {})
        if args.pop("pretrained", False) or args.get("weights") is not None:
            raise ModelSpecError(f"model spec {spec!r}: torchvision models are built without pretrained weights here")
        args["weights"] = None
        if "weights_backbone" in inspect.signature(builder).parameters:
            args.setdefault("weights_backbone", None)  # a detector's default backbone would be downloaded
        return call_factory(builder, args, spec)

    return build


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"model spec {spec!r}: can't import {module_name!r} ({e}); is it installed?") from None
    except Exception as e:  # any error raised by the user's module while importing
        raise ModelSpecError(f"model spec {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None


def _module_from_file(path: str, spec: str) -> Any:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ModelSpecError(f"model spec {spec!r}: no such file {path!r}")
    name = "ckptfix_user_model_" + str(abs(hash(full)))
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, full)
    if loader_spec is None or loader_spec.loader is None:
        raise ModelSpecError(f"model spec {spec!r}: {path!r} can't be loaded as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # any error raised by the user's file while running
        del sys.modules[name]
        raise ModelSpecError(f"model spec {spec!r}: running {path!r} failed: {type(e).__name__}: {e}") from None
    return module


def _attribute(module: Any, attr: str, spec: str) -> Any:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(f"model spec {spec!r}: {getattr(module, '__name__', module)!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelSpecError(f"model spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def call_factory(factory: Any, args: dict[str, Any], spec: str) -> Any:
    """``factory(**args)``, which must return an nn.Module; any failure is a ModelSpecError naming ``spec``."""
    import torch

    try:
        model = factory(**args)
    except Exception as e:  # the user's builder can raise anything
        raise ModelSpecError(f"model spec {spec!r}: building it with {args or 'no arguments'} failed: "
                             f"{type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"model spec {spec!r}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def unwrap_model(model: Any) -> Any:
    """The innermost module under DataParallel / DDP / torch.compile wrappers."""
    inner = model
    while True:
        if isinstance(getattr(inner, "_orig_mod", None), _module_type()):
            inner = inner._orig_mod
        elif type(inner).__name__ in ("DataParallel", "DistributedDataParallel"):
            inner = inner.module
        else:
            return inner


def _module_type() -> type:
    import torch

    return torch.nn.Module


def first_layer(model: Any) -> Any:
    """The first module (in registration order) that holds parameters of its own, or None."""
    for sub in unwrap_model(model).modules():
        if any(True for _ in sub.parameters(recurse=False)):
            return sub
    return None


def infer_input_shape(model: Any) -> tuple[int, ...] | None:
    """1×3×224×224 for torchvision image classifiers; 1×N when the first layer is Linear(N); else None."""
    import torch

    inner = unwrap_model(model)
    mod = type(inner).__module__.split(".")
    if mod[:2] == ["torchvision", "models"] and not (len(mod) > 2 and mod[2] in _NOT_CLASSIFIERS):
        return (1, 3, 224, 224)
    first = first_layer(inner)
    return (1, first.in_features) if isinstance(first, torch.nn.Linear) else None


def embedding_size(model: Any) -> int | None:
    """``num_embeddings`` when the model's first layer is an Embedding (it takes token IDs), else None."""
    import torch

    first = first_layer(model)
    return first.num_embeddings if isinstance(first, (torch.nn.Embedding, torch.nn.EmbeddingBag)) else None


def forward_arguments(model: Any) -> list[str]:
    """Names of the arguments ``forward`` requires (``['input_ids', 'attention_mask']``); [] if unknown."""
    try:
        params = inspect.signature(unwrap_model(model).forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def parse_shape(text: str) -> tuple[int, ...]:
    """``'1,3,224,224'`` or ``'1x3x224x224'`` → ``(1, 3, 224, 224)``."""
    parts = str(text).replace("x", ",").replace("×", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts if p.strip())
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InputError(f"input shape {text!r}: expected positive sizes like 1,3,224,224")
    return shape


class ModelSource:
    """Where model instances come from: a spec (built), a factory (called) or a module (copied);
    each instance in the serving ``dtype`` when one is given (``.to(dtype)`` after building)."""

    def __init__(self, model: Any, args: dict[str, Any] | None, dtype: Any = None):
        import torch

        self.model, self.args = model, args or {}
        self._builder = find_builder(model) if isinstance(model, str) else None  # (a spec naming nothing fails now)
        self.dtype = dtype if dtype is None or isinstance(dtype, torch.dtype) else parse_dtype(str(dtype))
        self.dtype_name = None if self.dtype is None else dtype_name(self.dtype)
        if isinstance(model, str):
            self.label = model + "".join(f" {k}={v!r}" for k, v in self.args.items())
        elif isinstance(model, torch.nn.Module):
            self.label = type(unwrap_model(model)).__name__
        elif callable(model):
            self.label = getattr(model, "__qualname__", repr(model))
        else:
            raise ModelSpecError(f"model: expected an nn.Module, a model spec string or a factory, got {type(model).__name__}")

    def structure(self, meta: bool) -> tuple[Any, bool]:
        """``(model, is_fresh)`` to read keys from: the given module itself, or a new build."""
        import torch

        if isinstance(self.model, torch.nn.Module):
            return self.model, False
        return self.fresh(meta), not meta

    def fresh(self, meta: bool = False) -> Any:
        """A new instance (in the serving dtype); on ``meta`` (no memory) where the builder allows it."""
        import torch

        if isinstance(self.model, torch.nn.Module):
            return self._in_dtype(deepcopy_model(self.model))
        if meta:
            try:
                with torch.device("meta"):
                    return self._in_dtype(self._build())
            except CkptfixError:
                pass  # some builders need real tensors; build normally
        return self._in_dtype(self._build())

    def _in_dtype(self, net: Any) -> Any:
        return net if self.dtype is None else net.to(self.dtype)

    def _build(self) -> Any:
        if self._builder is not None:
            return self._builder(self.args)
        return call_factory(self.model, self.args, self.label)


def deepcopy_model(model: Any) -> Any:
    """A fresh copy of a user's module for the forward check; a ModelSpecError says why one can't be made."""
    try:
        return copy.deepcopy(model)
    except Exception as e:  # whatever the module holds that can't be copied
        raise ModelSpecError(f"model: can't make a fresh copy for the forward check ({type(e).__name__}: {e}); "
                             "pass a model spec or a factory instead of an instance") from None


def float_dtype(net: Any) -> str:
    """The dtype a model computes in: its first floating parameter's (float32 when it has none)."""
    param = next((p for p in net.parameters() if p.is_floating_point()), None)
    return "float32" if param is None else dtype_name(param.dtype)
