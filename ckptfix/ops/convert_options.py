"""Convert's options, declared once.

Each field of :class:`ConvertOptions` is one keyword of :func:`ckptfix.convert` (name, type, default) and
carries its command-line :class:`Flag` (spelling, help, choices): ``ckptfix.cli.options`` builds
``ckptfix convert``'s click options from these fields, in this order, and :mod:`ckptfix.ops.convert.steps`
validates them in one place (``validate``). Options other commands share (``--select``, ``--trust``,
``--map-location``, ``--json``) are made from the same declarations.

Plain data: it imports only the tables it names (the format registry, the wrapper targets, the cast dtypes),
so ``ckptfix --help`` reads it without the library.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..parse.format_registry import WRITE_NAMES
from ..statedict.transforms import CAST_DTYPES
from ..statedict.wrappers import TARGETS

DTYPES = tuple(CAST_DTYPES)
WRAPPER_FORMS = tuple(TARGETS)
OUTPUT_FORMATS = WRITE_NAMES  # the registry's --format names


@dataclass(frozen=True)
class Flag:
    """How an option is spelled on the command line (``ckptfix.cli.options`` makes it a click option)."""

    decls: tuple[str, ...]
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    is_flag: bool = False
    multiple: bool = False
    show_default: bool = False
    #: the command's parameter, where it isn't the option's own name (``--quiet`` sets ``quiet``, not ``progress``)
    dest: str | None = None
    #: the flag turns the option off: ``--quiet`` means ``progress=False``
    negate: bool = False
    #: what the value is where it isn't plain text (``"devices"``, ``"file"``, ``"shape"`` …): the name of the check and
    #: parse ``ckptfix.cli.options.KINDS`` gives it on the command line
    kind: str | None = None
    #: the value may begin with ``-`` (``--input-range -1,1``); without it, click takes a following token that
    #: looks like an option for one, not for the value
    dash_value: bool = False


#: ``--json``, on every command that prints a report
JSON = Flag(("--json",), dest="as_json", is_flag=True, help="Print one JSON object on stdout.")


def option(default: Any, flag: Flag) -> Any:
    """An options field (:class:`ConvertOptions`, ``VerifyOptions``): the library's default and the command-line flag."""
    return field(default=default, metadata={"flag": flag})


def flag_of(option_field: Any) -> Flag:
    """The :class:`Flag` an options field was declared with."""
    flag: Flag = option_field.metadata["flag"]
    return flag


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """Everything :func:`ckptfix.convert` takes after ``src`` and ``dst``, in ``ckptfix convert --help``'s order."""

    to: str = option("single", Flag(("--to",), choices=WRAPPER_FORMS, show_default=True,
                                    help="Wrapper form of the output keys."))
    map_location: Any = option("cpu", Flag(("--map-location",), multiple=True, metavar="SPEC", kind="devices",
                                           help="cpu, cuda, cuda:N, meta, auto, or FROM=TO (repeatable). Default: cpu."))
    select: str = option("auto", Flag(("--select",), metavar="KEY", show_default=True,
                                      help="Where the state dict sits in a training checkpoint (e.g. state_dict_ema)."))
    keep_extra: bool = option(False, Flag(("--keep-extra",), is_flag=True,
                                          help="Keep optimizer, epoch, … around the fixed state dict (pth only)."))
    strip_prefix: str | None = option(None, Flag(("--strip-prefix",), metavar="P",
                                                 help="Remove this leading prefix (whole segments), e.g. model."))
    add_prefix: str | None = option(None, Flag(("--add-prefix",), metavar="P",
                                               help="Add this prefix (whole segments), e.g. backbone."))
    format: str | None = option(None, Flag(("--format",), choices=OUTPUT_FORMATS,
                                           help="Output format (default: by DST's extension; dcp: a "
                                                "torch.distributed.checkpoint directory)."))
    max_shard_size: int | str | None = option(None, Flag(
        ("--max-shard-size",), metavar="SIZE",
        help="Write a Hugging Face sharded directory at DST, shards at most SIZE (5GB, 500MiB, 40KB)."))
    rename: tuple[str, ...] | list[str] = option((), Flag(
        ("--rename",), multiple=True, metavar="REGEX=REPL",
        help="Rename keys (Python re, full match, applied in order to the single form); repeatable."))
    #: an nn.Module; on the command line, the one --model and --arg build
    by_order: Any = option(None, Flag(("--by-order",), is_flag=True,
                                      help="Give the tensors --model's key names by position (counts and shapes must agree)."))
    untie: bool = option(False, Flag(("--untie",), is_flag=True,
                                     help="Store each tied tensor under every key it has: the default for safetensors "
                                          "output (the flag kept for scripts that name it)."))
    compact_ties: bool = option(False, Flag(("--compact-ties",), is_flag=True,
                                            help="Safetensors output: store a tied tensor once, its other keys as "
                                                 "aliases that only ckptfix's reader restores (transformers' "
                                                 "from_pretrained re-ties tie_word_embeddings' head itself; plain "
                                                 "load_file returns one key of the tie)."))
    dtype: str | None = option(None, Flag(("--dtype",), choices=DTYPES,
                                          help="Cast floating-point tensors (never integer or bool buffers)."))
    allow_overflow: bool = option(False, Flag(("--allow-overflow",), is_flag=True,
                                              help="With --dtype fp16: allow values beyond ±65504 to become inf."))
    dequantize: bool = option(False, Flag(
        ("--dequantize",), is_flag=True,
        help="Write each quantized group (FP8, NVFP4, MXFP4, GPTQ …) as one plain weight, scales dropped, in "
             "--dtype (default: the config's torch_dtype if bf16/fp16, else fp32). Without it --dtype keeps "
             "quantized groups as stored."))
    cast_unknown_quantized: bool = option(False, Flag(
        ("--cast-unknown-quantized",), is_flag=True,
        help="Treat float8 / packed-integer tensors beside scales of no known scheme as plain tensors (--dtype "
             "casts them, without their scales) instead of refusing."))
    hash: bool = option(False, Flag(("--hash",), is_flag=True,
                                    help="Append the first 8 hex digits of DST's SHA-256 to its name."))
    sign: str | None = option(None, Flag(("--sign",), metavar="KEY.pem", kind="file", help=(
        "Sign the output with this EC private key (P-256/384/521): an OpenSSF model signature, DST.sig beside a "
        "file, DST/model.sig in a directory, that `model_signing verify key` accepts (needs ckptfix[sign]).")))
    force: bool = option(False, Flag(("--force",), is_flag=True,
                                     help="Replace DST if it exists (a directory DST: only the files the output consists "
                                          "of; the rest is kept)."))
    progress: bool = option(False, Flag(("--quiet", "-q"), is_flag=True, dest="quiet", negate=True,
                                        help="No progress line on stderr."))
    trust: bool = option(False, Flag(("--trust",), is_flag=True,
                                     help="Load with full unpickling (runs code from the file): only for files you trust."))
    allow: tuple[str, ...] | list[str] = option((), Flag(
        ("--allow",), multiple=True, metavar="MODULE.NAME",
        help="Take this global as inert data inside the state dict too (never imported or called); outside it, "
             "globals beyond the allow-list are inert placeholders anyway. With --keep-extra: write objects of this "
             "class that torch.load(weights_only=True) refuses (the loader resuming from DST allows it). Repeatable."))
    #: SRC's and DST's SHA-256 in the report. The command line has no flag of its own for it: --json turns it on.
    checksums: bool = option(False, replace(JSON, help="Print one JSON object on stdout; it includes SRC's and DST's "
                                                       "SHA-256 (sha256_in, sha256_out), which reads both files once more."))

    def __post_init__(self) -> None:
        object.__setattr__(self, "rename", tuple(self.rename))
        object.__setattr__(self, "allow", tuple(self.allow))


P = ParamSpec("P")
R = TypeVar("R")


def takes(options: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[Concatenate[Any, Any, P], R]]:
    """Give ``fn(src, dst, **kwargs)`` the keywords of ``options`` (a dataclass): type checkers, ``help()`` and
    ``inspect.signature`` see each one, though the function declares none of them itself."""

    def decorate(fn: Callable[..., R]) -> Callable[Concatenate[Any, Any, P], R]:
        own = inspect.signature(fn)
        positional = [p for p in own.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        fn.__signature__ = own.replace(  # type: ignore[attr-defined]
            parameters=positional + list(inspect.signature(options).parameters.values()))
        return fn

    return decorate
