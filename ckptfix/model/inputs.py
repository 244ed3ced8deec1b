"""Forward-check inputs: a seeded recipe (shape, dtype, value range, seed) or tensors from a file.

What a model takes is inferred where it is unambiguous (an image classifier, a first ``Linear``, a
first ``Embedding``: token IDs); otherwise the error says what to pass for the model at hand.
A recipe is recorded in golden files (:mod:`ckptfix.model.golden`) so a later run makes the same input.

>>> recipe = resolve_input(net, shape=(1, 16), dtype="long", value_range=(0, 30522))   # doctest: +SKIP
>>> args, kwargs = recipe.make()                                                      # model(*args, **kwargs)
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from .. import formats
from . import spec as models
from ..core.devices import DevicePlan
from ..errors import GoldenError, InputError
from ..parse import inert
from ..safety.scanner import ensure_safe
from .forward import seeded_input
from .verify_options import INPUT_SEED
from ..core.units import dtype_name
from ..text import describe_recipe, number

#: ``--input-dtype`` names → torch dtype names; ``float`` is the model's own floating dtype.
INPUT_DTYPES = {"float": None, "long": "int64", "int": "int32"}


@dataclass
class InputRecipe:
    """One forward input: generated (``shape``, ``dtype``, ``range``, ``seed``) or ``tensors`` given
    (a tensor → ``model(x)``; a dict → ``model(**dict)``) with ``source`` naming where they came from."""

    shape: tuple[int, ...] | None = None
    dtype: str = "float"
    range: tuple[float, float] | None = None
    seed: int | None = INPUT_SEED
    tensors: Any = None
    source: str | None = None

    def make(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` for the model; generated inputs are the same for the same recipe, anywhere.

        Floats without a range are ``torch.randn(*shape)`` from a generator seeded with ``seed`` (the
        fixtures' recipe); with a range, uniform in [lo, hi). Integers: ``torch.randint(lo, hi)``.
        """
        import torch

        if self.tensors is not None:
            if isinstance(self.tensors, dict):
                return (), dict(self.tensors)
            return (self.tensors,), {}
        seed, shape = INPUT_SEED if self.seed is None else self.seed, tuple(self.shape or ())
        if self.range is None:  # floats only: resolve_input gives integer inputs a range
            return (seeded_input(shape, seed),), {}
        g = torch.Generator().manual_seed(seed)
        lo, hi = self.range
        if self.dtype == "float":
            return (lo + (hi - lo) * torch.rand(*shape, generator=g),), {}
        return (torch.randint(int(lo), int(hi), shape, generator=g, dtype=getattr(torch, str(INPUT_DTYPES[self.dtype]))),), {}

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON (a verify row's ``input``; a golden file's metadata)."""
        if self.tensors is None:
            return {"shape": list(self.shape or ()), "dtype": self.dtype,
                    "range": list(self.range) if self.range is not None else None, "seed": self.seed}
        named = self.tensors if isinstance(self.tensors, dict) else {"": self.tensors}
        return {"file": self.source, "sha256": digest(self.tensors),
                "tensors": {k: _describe_value(v) for k, v in named.items()}}

    def describe(self) -> str:
        """``input 4x13 float, seed 1234`` / ``input 1x16 long in [0, 30522), seed 1234`` / ``input file x.pt``."""
        return describe_recipe(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputRecipe:
        """The recipe a golden file recorded (generated inputs only; a file's tensors must be given again)."""
        try:
            rng, dtype = d.get("range"), str(d.get("dtype", "float"))
            if dtype not in INPUT_DTYPES or (dtype != "float" and rng is None):
                raise ValueError(f"dtype {dtype!r} with range {rng!r}")
            return cls(shape=tuple(int(n) for n in d["shape"]), dtype=dtype,
                       range=(float(rng[0]), float(rng[1])) if rng is not None else None, seed=int(d["seed"]))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise InputError(f"input recipe {d!r} is malformed ({type(e).__name__}: {e})") from None






def _describe_value(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
    return repr(v)


def digest(tensors: Any) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of the input tensors: the same input, or not."""
    import torch

    h = hashlib.sha256()
    named = tensors if isinstance(tensors, dict) else {"": tensors}
    for name, v in named.items():
        h.update(f"{name}\0{_describe_value(v)}\0".encode())
        if isinstance(v, torch.Tensor):
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def parse_range(text: str) -> tuple[float, float]:
    """``'0,30522'`` → ``(0.0, 30522.0)``: low (inclusive), high (exclusive)."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        lo = hi = 0.0
    if not lo < hi:
        raise InputError(f"input range {text!r}: expected LOW,HIGH with LOW < HIGH, e.g. 0,30522 (HIGH excluded)")
    return lo, hi


def read_input_file(path: Any) -> Any:
    """A tensor or a dict of tensors from ``path`` (torch file or safetensors), read the safe way
    (no code runs; the same reader as checkpoints)."""
    path = os.fspath(path)
    fmt = formats.sniff(path)
    obj = formats.read(path, fmt, DevicePlan("cpu", source=path), trust=False).obj
    if inert.find(obj):  # a global outside the allow-list, read as a placeholder: no place for one in an input
        ensure_safe(path, fmt)  # the refusal that names every such global
    return check_tensors(obj, path)


def check_tensors(obj: Any, where: str = "input") -> Any:
    """``obj`` if it is a tensor or a dict of str → tensor (plain values allowed beside them), else an InputError."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        plain = (torch.Tensor, int, float, bool, str, type(None))
        odd = [k for k, v in obj.items() if not isinstance(v, plain)]
        if not odd:
            return dict(obj)
        raise InputError(f"{where}: entries {', '.join(odd[:5])} are not tensors; an input file holds a tensor, "
                         "or a dict of tensors passed as model(**dict)")
    raise InputError(f"{where}: holds a {type(obj).__name__}; an input file holds a tensor (model(x)), or a dict "
                     "of tensors (model(**dict)): torch.save(x, PATH) or safetensors' save_file({'input_ids': x}, PATH)")


def resolve_input(net: Any, shape: tuple[int, ...] | None = None, dtype: str | None = None,
                  value_range: tuple[float, float] | None = None, seed: int = INPUT_SEED, inputs: Any = None,
                  recorded: dict[str, Any] | None = None) -> InputRecipe:
    """The input for ``net``'s forward check: ``inputs`` given (a path, a tensor or a dict of tensors),
    the ``recorded`` recipe of a golden file, or a seeded one with whatever is not given inferred.

    A first ``Embedding(N, …)`` implies ``dtype='long'`` and ``value_range=(0, N)``; the shape is
    inferred for image classifiers and a first ``Linear``. When it can't be, the InputError says
    what to pass for this model.
    """
    given = {"--input-shape": shape, "--input-dtype": dtype, "--input-range": value_range}
    if recorded is not None and "file" not in recorded:
        return _recorded(recorded, given, inputs)
    if inputs is not None:  # (never with a recipe's options: VerifyOptions' RULES)
        if isinstance(inputs, (str, os.PathLike)):
            recipe = InputRecipe(tensors=read_input_file(inputs), source=os.fspath(inputs), seed=None)
        else:
            recipe = InputRecipe(tensors=check_tensors(inputs), source="given tensors", seed=None)
        if recorded is not None and recorded.get("sha256") != digest(recipe.tensors):
            raise GoldenError(f"the golden outputs were recorded for other --input tensors ({recorded['file']}); "
                              "pass the same ones, or record the golden file again (--record-golden)")
        return recipe
    if recorded is not None:
        raise GoldenError(f"the golden outputs were recorded for the tensors of --input {recorded['file']}; "
                          "pass that file with --input")
    if dtype is not None and dtype not in INPUT_DTYPES:
        raise InputError(f"input dtype {dtype!r}: choose {', '.join(INPUT_DTYPES)}")
    if len(models.forward_arguments(net)) > 1:  # one generated tensor can't feed it
        raise InputError(what_to_pass(net))
    vocab = models.embedding_size(net)
    dtype = dtype or ("long" if vocab is not None else "float")
    if dtype != "float" and value_range is None:
        if vocab is None:
            raise InputError(f"--input-dtype {dtype} needs --input-range LOW,HIGH (e.g. 0,VOCAB_SIZE: token IDs "
                             "are drawn from LOW to HIGH-1)")
        value_range = (0, vocab)
    shape = tuple(shape) if shape else models.infer_input_shape(net)
    if shape is None:
        raise InputError(what_to_pass(net))
    return InputRecipe(shape=shape, dtype=dtype, range=value_range, seed=seed)


def _recorded(recorded: dict[str, Any], given: dict[str, Any], inputs: Any) -> InputRecipe:
    """A golden file's generated input; options asking for another input are an error, not ignored."""
    recipe = InputRecipe.from_dict(recorded)
    mine = {"--input-shape": recipe.shape, "--input-dtype": recipe.dtype, "--input-range": recipe.range}
    clash = [f"{name} {v if isinstance(v, str) else ','.join(number(n) for n in v)}" for name, v in given.items()
             if v is not None and (v if isinstance(v, str) else tuple(v)) != mine[name]]
    clash += ["--input"] if inputs is not None else []
    if clash:
        raise GoldenError(f"the golden outputs were recorded for {recipe.describe()}; {', '.join(clash)} asks for "
                          "another input: drop it, or record the golden file again (--record-golden)")
    return recipe


def what_to_pass(net: Any) -> str:
    """Why the input can't be inferred for ``net``, and exactly which options make one."""
    name = type(models.unwrap_model(net)).__name__
    needs = models.forward_arguments(net)
    if len(needs) > 1:
        return (f"{name}.forward takes {', '.join(needs)}: pass --input FILE (.pt or .safetensors) holding a dict "
                f"of those tensors, called as model(**dict) (library: inputs={{{', '.join(repr(n) for n in needs)}: …}}), "
                "or --no-forward")
    vocab = models.embedding_size(net)
    if vocab is not None:
        return (f"{name} starts with an Embedding of {vocab} token IDs; pass --input-shape 1,SEQ_LEN (e.g. 1,16) "
                f"--input-dtype long --input-range 0,{vocab} (library: input_shape=(1, 16), input_dtype='long', "
                f"input_range=(0, {vocab})), or --input FILE, or --no-forward")
    return (f"can't tell the input shape of {name} for the forward check; pass --input-shape (library: "
            "input_shape=(1, 3, 224, 224)), with --input-dtype long --input-range 0,N for token IDs, or --input FILE "
            "(a tensor, or a dict of tensors), or --no-forward")
