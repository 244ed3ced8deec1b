"""The command-line options, each defined once.

``ckptfix convert``'s options come from :class:`ckptfix.ops.convert_options.ConvertOptions`, one click option per
field in its order (:func:`convert_options`), and go back to ``ckptfix.convert``'s keywords through
:func:`convert_kwargs`; ``ckptfix verify``'s from :class:`ckptfix.model.verify_options.VerifyOptions` in the same
way (:func:`verify_options`, :func:`verify_kwargs`). A flag's ``kind`` names its click type and how its text becomes
the library's value (:data:`KINDS`). The options several commands share are decorators made from the same
declarations (``--select``, ``--trust``, ``--map-location``, ``--json``) or defined here (``--model``/``--arg``,
``diff``'s ``--atol``/``--rtol``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import Field, fields
from typing import Any

import click

from ..model import verify_options as verify_declared
from ..ops.convert_options import JSON, ConvertOptions, Flag, flag_of

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
_FIELDS = {f.name: f for f in fields(ConvertOptions)}


def map_location_value(values: tuple[str, ...]) -> Any:
    """``--map-location`` as the library takes it: the values parsed, or convert's default (cpu) without any."""
    from ..core.devices import parse_cli_map_location

    return parse_cli_map_location(values) if values else _FIELDS["map_location"].default


def _shape(text: str | None) -> Any:
    from ..model.spec import parse_shape

    return parse_shape(text) if text else None


def _range(text: str | None) -> Any:
    from ..model.inputs import parse_range

    return parse_range(text) if text else None


def _model_args(pairs: tuple[str, ...]) -> Any:
    from ..model.spec import parse_model_args

    return parse_model_args(pairs)


#: ``Flag.kind`` → the click type that checks the value, and how its text becomes the library's value (None: as is)
KINDS: dict[str, tuple[click.ParamType | None, Callable[[Any], Any] | None]] = {
    "path": (click.Path(dir_okay=True), None),
    "file": (click.Path(dir_okay=False), None),
    "tolerance": (click.FloatRange(min=0), None),
    "devices": (None, map_location_value),
    "shape": (None, _shape),
    "range": (None, _range),
    "model-args": (None, _model_args),
}


def flag_option(flag: Flag, name: str, default: Any = None) -> Decorator:
    """``flag`` as a click option for the parameter ``flag.dest`` (else ``name``)."""
    extra: dict[str, Any] = {}
    if flag.choices is not None:
        extra["type"] = click.Choice(list(flag.choices))
    if flag.kind is not None and KINDS[flag.kind][0] is not None:
        extra["type"] = KINDS[flag.kind][0]
    if default is not None and not (flag.is_flag or flag.multiple):  # click's own defaults there: None, False, ()
        extra["default"] = default
    if not flag.dash_value:  # click: an explicit is_flag=False reads a following "-…" token as an option
        extra["is_flag"] = flag.is_flag
    return click.option(*flag.decls, flag.dest or name, multiple=flag.multiple, metavar=flag.metavar,
                        show_default=flag.show_default, help=flag.help, **extra)


def _field_option(f: Field) -> Decorator:
    return flag_option(flag_of(f), f.name, f.default)


json_option = flag_option(JSON, "as_json")
select_option = _field_option(_FIELDS["select"])
trust_option = _field_option(_FIELDS["trust"])
allow_option = _field_option(_FIELDS["allow"])
map_location_option = _field_option(_FIELDS["map_location"])


def model_option(model_help: str, required: bool = False) -> Decorator:
    """``--model SPEC``: a model spec (``verify``'s model, the one ``convert --by-order`` takes)."""
    return click.option("--model", "model_spec", required=required, metavar="SPEC", help=model_help)


def model_options(model_help: str, arg_help: str, required: bool = False) -> Decorator:
    """``--model SPEC`` and ``--arg NAME=VALUE`` (repeatable): a model spec and its builder's keywords."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--arg", "model_args", multiple=True, metavar="NAME=VALUE", help=arg_help)(f)
        return model_option(model_help, required)(f)

    return deco


#: the options that follow one of convert's on the command line, to complete it
_FOLLOWERS = {"by_order": model_options("Model for --by-order: torchvision:NAME, pkg.mod:fn or file.py:fn.",
                                        "Keyword for the --model builder; repeatable.")}


def _stacked(f: Callable[..., Any], decorators: list[Decorator]) -> Callable[..., Any]:
    for deco in reversed(decorators):  # click lists options in the order their decorators are written
        f = deco(f)
    return f


def convert_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Every :class:`ConvertOptions` field as its click option, in declaration order (``--model``/``--arg``
    after ``--by-order``: they build the model it takes)."""
    decorators: list[Decorator] = []
    for name, fld in _FIELDS.items():
        decorators.append(_field_option(fld))
        if name in _FOLLOWERS:
            decorators.append(_FOLLOWERS[name])
    return _stacked(f, decorators)


def _keywords(declared: Iterable[Field], values: dict[str, Any]) -> dict[str, Any]:
    """The library's keywords from the command's parameters, as the flags say: each from its flag's parameter
    (``--json`` gives ``checksums``, ``--quiet`` the opposite of ``progress``), as typed (no ``kind``'s parse yet)."""
    kwargs: dict[str, Any] = {}
    for fld in declared:
        flag = flag_of(fld)
        value = values[flag.dest or fld.name]
        kwargs[fld.name] = not value if flag.negate else value
    return kwargs


def _parsed(declared: Iterable[Field], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each value whose flag has a ``kind`` parsed by it (``--map-location``'s devices …)."""
    for fld in declared:
        kind = flag_of(fld).kind
        parse = KINDS[kind][1] if kind is not None else None
        if parse is not None:
            kwargs[fld.name] = parse(kwargs[fld.name])
    return kwargs


def convert_kwargs(values: dict[str, Any], by_order: Any) -> dict[str, Any]:
    """``ckptfix.convert``'s keywords from the command's parameters (:func:`_keywords`, parsed), ``by_order`` the
    model ``--model`` built."""
    return {**_parsed(_FIELDS.values(), _keywords(_FIELDS.values(), values)), "by_order": by_order}


VERIFY_MODEL_HELP = "torchvision:NAME, package.module:callable or path/to/file.py:callable."


def verify_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--model``, then every :class:`~ckptfix.model.verify_options.VerifyOptions` field with a flag as its click
    option, in ``HELP_ORDER``."""
    decorators = [model_option(VERIFY_MODEL_HELP + " Without it: the model-free gate (CRCs, NaN/Inf, quantized "
                                                   "groups intact, --original).")]
    return _stacked(f, decorators + [_field_option(fld) for fld in verify_declared.flagged()])


def verify_kwargs(values: dict[str, Any], has_model: bool = True) -> dict[str, Any]:
    """``ckptfix.verify``'s keywords from the command's parameters: the options that go together, and without
    ``--model`` the ones that need it, checked first (a usage error, exit 2), then each value parsed as its flag's
    ``kind`` says."""
    declared = list(verify_declared.flagged())
    kwargs = _keywords(declared, values)
    rule = verify_declared.broken_rule(kwargs)
    if rule is not None:
        raise click.UsageError(rule.usage.format(**kwargs))
    modelled = None if has_model else verify_declared.option_needing_model(kwargs)
    if modelled is not None:
        raise click.UsageError(f"{flag_of(modelled).decls[0]} needs --model")
    return _parsed(declared, kwargs)


def tolerance_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``diff``'s ``--atol``/``--rtol`` (default 0: bit-exact)."""
    for name in ("--rtol", "--atol"):
        f = click.option(name, type=click.FloatRange(min=0), default=0.0, metavar="X", show_default=True,
                         help=f"{'Absolute' if name == '--atol' else 'Relative'} tolerance (0: bit-exact).")(f)
    return f
