"""The ``ckptfix`` command: parse → one library call → render (text, or one JSON object with --json).

Exit codes: 0 ok, 1 error (one ``Error: …`` line on stderr), 2 usage, 3 a finding; 130, 143, 129 after
SIGINT, SIGTERM, SIGHUP (temp output removed, one ``Error:`` line). With ``--json`` a failure also
prints one ``{"error", "error_type", "exit_code"}`` object on stdout, so stdout always parses.
``CKPTFIX_DEBUG=1`` shows tracebacks. This module imports no torch at import time.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from .. import __version__
from ..errors import NOTHING_WRITTEN, CkptfixError
from ..parse.format_registry import WRITE_NAMES

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_FINDING = 0, 1, 2, 3
_JSON = "ckptfix.json"  # ctx.meta key: --json was on the command line


class Group(click.Group):
    """Maps CkptfixError (and anything unexpected) to one ``Error:`` line and exit 1; with ``--json``
    every failure (usage errors and interrupts included) also prints one JSON object on stdout."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_JSON] = "--json" in args  # known even when the command's own parsing fails
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        from ..core.interrupts import signals_as_interrupts

        try:
            with signals_as_interrupts():  # SIGTERM, SIGHUP: the cleanup, one line and 128+N, like Ctrl-C
                return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except click.ClickException as e:  # click prints it (usage errors: exit 2)
            _json_error(ctx, e.format_message(), e, e.exit_code)
            raise
        except click.Abort as e:
            _json_error(ctx, "aborted", e, EXIT_ERROR)
            raise
        except KeyboardInterrupt as e:
            describe = getattr(e, "describe", None)
            message, code = describe() if describe else f"interrupted; {NOTHING_WRITTEN}", getattr(e, "exit_code", 130)
            if _PROCESS["standalone"]:
                # The temp output is already gone. End the process here, while the interrupted frames are
                # alive: a torch zip writer in them (torch.save inside DCP's writer) writes its end records
                # when destroyed, into a file its caller has closed, and that aborts the process (exit -6
                # after our Error line) once the traceback is freed.
                _report(ctx, message, e, code)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            _fail(ctx, message, e, code)
        except BrokenPipeError:  # the reader (e.g. `| head`) closed the pipe: stop quietly, like cat
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(141)
        except CkptfixError as e:
            _fail(ctx, str(e), e)
        except Exception as e:  # the CLI's edge: no traceback for users
            _fail(ctx, f"unexpected {type(e).__name__}: {e} (a bug in ckptfix; CKPTFIX_DEBUG=1 shows the traceback)", e)


def _fail(ctx: click.Context, message: str, exc: BaseException, code: int = EXIT_ERROR) -> None:
    """One ``Error:`` line on stderr (and the JSON object with --json), then exit ``code``."""
    _report(ctx, message, exc, code)
    ctx.exit(code)


def _report(ctx: click.Context, message: str, exc: BaseException, code: int) -> None:
    if os.environ.get("CKPTFIX_DEBUG") and not isinstance(exc, KeyboardInterrupt):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    click.echo(f"Error: {message}", err=True)
    _json_error(ctx, message, exc, code)


def _json_error(ctx: click.Context, message: str, exc: BaseException, code: int) -> None:
    if ctx.meta.get(_JSON):
        _emit_json({"error": message, "error_type": type(exc).__name__, "exit_code": code})


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")(f)


def trust_option(f: Callable) -> Callable:
    return click.option(
        "--trust", is_flag=True,
        help="Load with full unpickling (runs code from the file): only for files you trust.",
    )(f)


def select_option(f: Callable) -> Callable:
    return click.option(
        "--select", default="auto", show_default=True, metavar="KEY",
        help="Where the state dict sits in a training checkpoint (e.g. state_dict_ema).",
    )(f)


def map_location_option(default: str) -> Callable:
    def deco(f: Callable) -> Callable:
        return click.option(
            "--map-location", "map_location", multiple=True, metavar="SPEC",
            help=f"cpu, cuda, cuda:N, meta, auto, or FROM=TO (repeatable). Default: {default}.",
        )(f)

    return deco


def dtype_option(help: str) -> Callable:
    """``--dtype fp32|fp16|bf16``: convert casts the file to it; verify runs the model in it."""
    return click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), help=help)


def _map_location(values: tuple[str, ...], default: str) -> Any:
    from ..core.devices import parse_cli_map_location

    return parse_cli_map_location(values) if values else default


def _emit_json(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 ok, 1 error (one 'Error:' line; CKPTFIX_DEBUG=1 shows the traceback), "
                    "2 usage, 3 a finding (verify failed, diff differs, scan found unsafe content); "
                    "130, 143, 129 interrupted by SIGINT, SIGTERM, SIGHUP (temp output removed).")
@click.version_option(__version__, prog_name="ckptfix")
def cli() -> None:
    """Load, fix, convert, verify and scan PyTorch checkpoints: wrapper prefixes, devices, formats, safety."""


@cli.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path())
@click.option("--to", "to", type=click.Choice(["single", "ddp", "dp", "compile", "keep"]), default="single",
              show_default=True, help="Wrapper form of the output keys.")
@map_location_option("cpu")
@select_option
@click.option("--keep-extra", is_flag=True, help="Keep optimizer, epoch, … around the fixed state dict (pth only).")
@click.option("--strip-prefix", metavar="P", help="Remove this leading prefix (whole segments), e.g. model.")
@click.option("--add-prefix", metavar="P", help="Add this prefix (whole segments), e.g. backbone.")
@click.option("--format", "fmt", type=click.Choice(list(WRITE_NAMES)),
              help="Output format (default: by DST's extension; dcp: a torch.distributed.checkpoint directory).")
@click.option("--max-shard-size", metavar="SIZE",
              help="Write a Hugging Face sharded directory at DST, shards at most SIZE (5GB, 500MiB, 40KB).")
@click.option("--rename", multiple=True, metavar="REGEX=REPL",
              help="Rename keys (Python re, full match, applied in order to the single form); repeatable.")
@click.option("--by-order", is_flag=True, help="Give the tensors --model's key names by position (counts and shapes must agree).")
@click.option("--model", "model_spec", metavar="SPEC", help="Model for --by-order: torchvision:NAME, pkg.mod:fn or file.py:fn.")
@click.option("--arg", "model_args", multiple=True, metavar="NAME=VALUE", help="Keyword for the --model builder; repeatable.")
@dtype_option("Cast floating-point tensors (never integer or bool buffers).")
@click.option("--allow-overflow", is_flag=True, help="With --dtype fp16: allow values beyond ±65504 to become inf.")
@click.option("--hash", "add_hash", is_flag=True, help="Append the first 8 hex digits of DST's SHA-256 to its name.")
@click.option("--force", is_flag=True,
              help="Replace DST if it exists (a directory DST: only the files the output consists of; the rest is kept).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
@trust_option
@json_option
def convert(src: str, dst: str, to: str, map_location: tuple[str, ...], select: str, keep_extra: bool,
            strip_prefix: str | None, add_prefix: str | None, fmt: str | None, max_shard_size: str | None,
            rename: tuple[str, ...], by_order: bool,
            model_spec: str | None, model_args: tuple[str, ...], dtype: str | None, allow_overflow: bool,
            add_hash: bool, force: bool, quiet: bool, trust: bool, as_json: bool) -> None:
    """Convert SRC to DST: normalise wrapper prefixes, remap devices, rename, cast, change format."""
    from .. import text
    from ..ops.api import convert as do_convert

    if by_order != bool(model_spec):
        raise click.UsageError("--by-order and --model go together")
    model = None
    if model_spec:
        from ..model.spec import build_model, parse_model_args

        model = build_model(model_spec, parse_model_args(model_args))
    report = do_convert(src, dst, to=to, map_location=_map_location(map_location, "cpu"), select=select,
                        keep_extra=keep_extra, strip_prefix=strip_prefix, add_prefix=add_prefix, format=fmt,
                        force=force, trust=trust, progress=not quiet, rename=rename, by_order=model, dtype=dtype,
                        allow_overflow=allow_overflow, hash=add_hash, checksums=as_json, max_shard_size=max_shard_size)
    if as_json:
        _emit_json(report.to_dict())
        return
    click.echo(text.convert_text(report))


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@select_option
@trust_option
@json_option
def inspect(path: str, select: str, trust: bool, as_json: bool) -> None:
    """Summarise a checkpoint without reading its tensor data."""
    from .. import text
    from ..ops.api import describe, inspect as do_inspect

    # Without --trust, torch is imported only for files that need it (see ckptfix.formats.describe).
    info = (do_inspect(path, trust=True, select=select) if trust else describe(path, select=select)).to_dict()
    if as_json:
        _emit_json(info)
        return
    click.echo(text.inspect_text(info))


def tolerance_options(forward: bool = False) -> Callable:
    """``--atol``/``--rtol``: for ``diff`` (default 0: bit-exact), for ``verify``'s forward check
    (default: bit-exact against --reference, the recorded-value default against --golden)."""
    default = ("bit-exact against --reference (with --dtype fp16/bf16: that dtype's default); against --golden, "
               "the recorded-value default for the output dtype (float32: atol 1e-6, rtol 1e-5)") if forward \
        else "0: bit-exact"

    def deco(f: Callable) -> Callable:
        for name in ("--rtol", "--atol"):
            f = click.option(name, type=click.FloatRange(min=0), default=None if forward else 0.0, metavar="X",
                             show_default=not forward,
                             help=f"{'Absolute' if name == '--atol' else 'Relative'} tolerance ({default}).")(f)
        return f

    return deco


def input_options(f: Callable) -> Callable:
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


def _render_finding(ctx: click.Context, report: Any, as_json: bool, ok: bool) -> None:
    """Print ``report`` (``--json``: ``to_dict()``, else ``format_text()``); exit 3 unless ``ok``."""
    if as_json:
        _emit_json(report.to_dict())
    else:
        click.echo(report.format_text())
    if not ok:
        ctx.exit(EXIT_FINDING)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@click.option("--model", "model_spec", required=True, metavar="SPEC",
              help="torchvision:NAME, package.module:callable or path/to/file.py:callable.")
@click.option("--arg", "args", multiple=True, metavar="NAME=VALUE",
              help="Keyword for the model builder (a Python literal, else a string); repeatable.")
@click.option("--exact", is_flag=True,
              help="Pass only if the serving loader (torch.load(weights_only=True), or safetensors.torch.load_file for "
                   "safetensors) + load_state_dict(strict=True) takes the file as saved, dtypes included.")
@click.option("--reference", metavar="REF", type=click.Path(dir_okay=True),
              help="Compare forward outputs with this checkpoint's (e.g. the original before a conversion).")
@input_options
@click.option("--golden", metavar="FILE.safetensors", type=click.Path(dir_okay=False),
              help="Compare outputs with the ones this file records; if it does not exist, record them in it.")
@click.option("--record-golden", is_flag=True, help="Write --golden again from this run, even if it exists.")
@dtype_option("Serving dtype: the model is built, then cast to it; the forward (and --reference) run in it.")
@tolerance_options(forward=True)
@click.option("--no-forward", is_flag=True, help="Keys, shapes and dtypes only: reads on meta, no tensor data.")
@map_location_option("cpu")
@select_option
@trust_option
@json_option
@click.pass_context
def verify(ctx: click.Context, path: str, model_spec: str, args: tuple[str, ...], exact: bool, reference: str | None,
           input_shape: str | None, input_dtype: str | None, input_range: str | None, input_file: str | None,
           golden: str | None, record_golden: bool, dtype: str | None, atol: float | None, rtol: float | None,
           no_forward: bool, map_location: tuple[str, ...], select: str, trust: bool, as_json: bool) -> None:
    """Check PATH against a model: keys, shapes, dtypes, NaN/Inf, tied weights, forward outputs (exit 3: failed)."""
    from ..model.inputs import parse_range
    from ..model.spec import parse_model_args, parse_shape
    from ..model.verify import verify as do_verify

    if record_golden and not golden:
        raise click.UsageError("--record-golden needs --golden FILE")
    report = do_verify(path, model_spec, model_args=parse_model_args(args), reference=reference, exact=exact,
                       forward=not no_forward, atol=atol, rtol=rtol, dtype=dtype,
                       input_shape=parse_shape(input_shape) if input_shape else None, input_dtype=input_dtype,
                       input_range=parse_range(input_range) if input_range else None, inputs=input_file,
                       golden=golden, record_golden=record_golden,
                       map_location=_map_location(map_location, "cpu"), select=select, trust=trust,
                       checksum=as_json)  # text + --no-forward: no tensor loaded, no hash (CRC-32s still checked)
    _render_finding(ctx, report, as_json, report.ok)


@cli.command()
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@click.option("--raw", is_flag=True, help="Compare keys as saved (wrapper segments kept).")
@tolerance_options()
@map_location_option("cpu")
@select_option
@trust_option
@json_option
@click.pass_context
def diff(ctx: click.Context, a: str, b: str, raw: bool, atol: float, rtol: float, map_location: tuple[str, ...],
         select: str, trust: bool, as_json: bool) -> None:
    """Compare checkpoints A and B: keys, shapes, dtypes, per-tensor max abs diff (exit 3: they differ)."""
    from ..ops.diff import diff as do_diff

    report = do_diff(a, b, raw=raw, atol=atol, rtol=rtol, map_location=_map_location(map_location, "cpu"),
                     select=select, trust=trust)
    _render_finding(ctx, report, as_json, report.identical)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@json_option
@click.pass_context
def scan(ctx: click.Context, path: str, as_json: bool) -> None:
    """Statically check PATH for code it would run when loaded; nothing is executed (exit 3: unsafe)."""
    from .. import text
    from ..safety.scanner import scan as do_scan

    report = do_scan(path)
    if as_json:
        _emit_json(report.to_dict())
    else:
        click.echo(text.scan_text(report))
    if not report.ok:
        ctx.exit(EXIT_FINDING)


#: ``standalone``: this process is the ``ckptfix`` command (main()), not a caller invoking ``cli`` in-process
_PROCESS = {"standalone": False}


def main() -> None:
    """Entry point (``ckptfix`` / ``python -m ckptfix``)."""
    _PROCESS["standalone"] = True
    cli(prog_name="ckptfix")


if __name__ == "__main__":
    main()  # click exits with the command's code
