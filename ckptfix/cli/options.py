"""The command-line options, each defined once.

``ckptfix convert``'s options come from :class:`ckptfix.ops.convert_options.ConvertOptions`, one click option per
field in its order (:func:`convert_options`), and go back to ``ckptfix.convert``'s keywords through
:func:`convert_kwargs`. The options several commands share are decorators made from the same declarations
(``--select``, ``--trust``, ``--map-location``, ``--json``) or defined here (``--model``/``--arg``,
``--dtype``, ``--atol``/``--rtol``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

import click

from ..ops.convert_options import DTYPES, JSON, ConvertOptions, Flag, flag_of

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
_FIELDS = {f.name: f for f in fields(ConvertOptions)}


def flag_option(flag: Flag, name: str, default: Any = None) -> Decorator:
    """``flag`` as a click option for the parameter ``flag.dest`` (else ``name``)."""
    extra: dict[str, Any] = {}
    if flag.choices is not None:
        extra["type"] = click.Choice(list(flag.choices))
    if default is not None and not (flag.is_flag or flag.multiple):  # click's own defaults there: None, False, ()
        extra["default"] = default
    return click.option(*flag.decls, flag.dest or name, is_flag=flag.is_flag, multiple=flag.multiple,
                        metavar=flag.metavar, show_default=flag.show_default, help=flag.help, **extra)


def _field_option(f: Field) -> Decorator:
    return flag_option(flag_of(f), f.name, f.default)


json_option = flag_option(JSON, "as_json")
select_option = _field_option(_FIELDS["select"])
trust_option = _field_option(_FIELDS["trust"])
allow_option = _field_option(_FIELDS["allow"])
map_location_option = _field_option(_FIELDS["map_location"])


def map_location_value(values: tuple[str, ...]) -> Any:
    """``--map-location`` as the library takes it: the values parsed, or convert's default (cpu) without any."""
    from ..core.devices import parse_cli_map_location

    return parse_cli_map_location(values) if values else _FIELDS["map_location"].default


def model_options(model_help: str, arg_help: str, required: bool = False) -> Decorator:
    """``--model SPEC`` and ``--arg NAME=VALUE`` (repeatable): a model spec and its builder's keywords."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--arg", "model_args", multiple=True, metavar="NAME=VALUE", help=arg_help)(f)
        return click.option("--model", "model_spec", required=required, metavar="SPEC", help=model_help)(f)

    return deco


def dtype_option(help: str) -> Decorator:
    """``--dtype fp32|fp16|bf16``: convert casts the file to it; verify runs the model in it."""
    return click.option("--dtype", type=click.Choice(list(DTYPES)), help=help)


#: the options that follow one of convert's on the command line, to complete it
_FOLLOWERS = {"by_order": model_options("Model for --by-order: torchvision:NAME, pkg.mod:fn or file.py:fn.",
                                        "Keyword for the --model builder; repeatable.")}


def convert_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Every :class:`ConvertOptions` field as its click option, in declaration order (``--model``/``--arg``
    after ``--by-order``: they build the model it takes)."""
    decorators: list[Decorator] = []
    for name, fld in _FIELDS.items():
        decorators.append(_field_option(fld))
        if name in _FOLLOWERS:
            decorators.append(_FOLLOWERS[name])
    for deco in reversed(decorators):  # click lists options in the order their decorators are written
        f = deco(f)
    return f


def convert_kwargs(values: dict[str, Any], by_order: Any) -> dict[str, Any]:
    """``ckptfix.convert``'s keywords from the command's parameters: each option from its flag's
    parameter (``--json`` gives ``checksums``, ``--quiet`` the opposite of ``progress``), ``map_location``
    parsed, ``by_order`` the model ``--model`` built."""
    kwargs: dict[str, Any] = {}
    for name, fld in _FIELDS.items():
        flag = flag_of(fld)
        value = values[flag.dest or name]
        kwargs[name] = not value if flag.negate else value
    return {**kwargs, "map_location": map_location_value(kwargs["map_location"]), "by_order": by_order}


def tolerance_options(forward: bool = False) -> Decorator:
    """``--atol``/``--rtol``: for ``diff`` (default 0: bit-exact), for ``verify``'s forward check
    (default: bit-exact against --reference, the recorded-value default against --golden)."""
    default = ("bit-exact against --reference (with --dtype fp16/bf16: that dtype's default); against --golden, "
               "the recorded-value default for the output dtype (float32: atol 1e-6, rtol 1e-5)") if forward \
        else "0: bit-exact"

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        for name in ("--rtol", "--atol"):
            f = click.option(name, type=click.FloatRange(min=0), default=None if forward else 0.0, metavar="X",
                             show_default=not forward,
                             help=f"{'Absolute' if name == '--atol' else 'Relative'} tolerance ({default}).")(f)
        return f

    return deco


def input_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The forward check's input: a seeded recipe (shape, dtype, range) or a file of tensors."""
    for option in reversed([
        click.option("--input-shape", metavar="SHAPE", help="Forward input shape, e.g. 1,3,224,224 (default: inferred)."),
        click.option("--input-dtype", type=click.Choice(["float", "long", "int"]),
                     help="float (randn, in the model's dtype; default), or long/int token IDs (default: long "
                          "when the first layer is an Embedding)."),
        click.option("--input-range", metavar="LOW,HIGH",
                     help="Token IDs from LOW to HIGH-1, e.g. 0,30522 (default for long: 0,the Embedding's size); "
                          "floats: uniform in [LOW, HIGH)."),
        click.option("--input", "input_file", metavar="FILE", type=click.Path(dir_okay=False),
                     help="The input itself: a tensor, or a dict of tensors passed as model(**dict) (.pt or .safetensors)."),
    ]):
        f = option(f)
    return f
