"""The ``ckptfix`` commands: each parses its options, makes one library call and renders the result
(text, or one JSON object with --json); :mod:`.exits` turns failures into exit codes.

This module imports no torch at import time: each command imports the library when it runs.
"""

from __future__ import annotations

from typing import Any

import click

from .. import __version__
from . import exits
from .options import (
    allow_option, convert_kwargs, convert_options, json_option, map_location_option, map_location_value, select_option,
    tolerance_options, trust_option, verify_kwargs, verify_options,
)
from .output import render


@click.group(cls=exits.Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 ok, 1 error (one 'Error:' line; CKPTFIX_DEBUG=1 shows the traceback), "
                    "2 usage, 3 a finding (verify failed or found unsafe content, diff differs, scan found unsafe content); "
                    "130, 143, 129 interrupted by SIGINT, SIGTERM, SIGHUP (temp output removed).")
@click.version_option(__version__, prog_name="ckptfix")
def cli() -> None:
    """Load, fix, convert, verify and scan PyTorch checkpoints: wrapper prefixes, devices, formats, safety."""


@cli.command()
@click.argument("src", type=click.Path(dir_okay=True))
@click.argument("dst", type=click.Path())
@convert_options
def convert(src: str, dst: str, model_spec: str | None, model_args: tuple[str, ...], **values: Any) -> None:
    """Convert SRC to DST: normalise wrapper prefixes, remap devices, rename, cast, change format (SRC may be an
    https://, s3:// or hf:// URL).

    DST may be s3://BUCKET/KEY (one .safetensors or .pth file): it is written to a temp file in TMPDIR, then
    uploaded in parts; nothing is at the key until the upload completes, and a failure or an interrupt aborts it.
    """
    from .. import text
    from ..ops.api import convert as do_convert

    if values["by_order"] != bool(model_spec):
        raise click.UsageError("--by-order and --model go together")
    model = None
    if model_spec:
        from ..model.spec import build_model, parse_model_args

        model = build_model(model_spec, parse_model_args(model_args))
    report = do_convert(src, dst, **convert_kwargs(values, by_order=model))
    render(report, values["as_json"], text.convert_text)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@click.option("--all", "all_keys", is_flag=True, help="List every key (without it: the first and last five; "
                                                       "--json always lists every key).")
@select_option
@trust_option
@allow_option
@json_option
def inspect(path: str, all_keys: bool, select: str, trust: bool, allow: tuple[str, ...], as_json: bool) -> None:
    """Summarise a checkpoint without reading its tensor data (PATH may be an https://, s3:// or hf:// URL)."""
    from .. import text
    from ..ops.api import describe, inspect as do_inspect

    # Without --trust, torch is imported only for files that need it (see ckptfix.formats.describe).
    report = do_inspect(path, trust=True, select=select) if trust else describe(path, select=select, allow=allow)
    render(report, as_json, lambda r: text.inspect_text(r.to_dict(), all_keys=all_keys))


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@verify_options
@click.pass_context
def verify(ctx: click.Context, path: str, model_spec: str | None, **values: Any) -> None:
    """Check PATH against a model: keys, shapes, dtypes, NaN/Inf, tied weights, forward outputs; without --model,
    the file alone: CRCs, NaN/Inf, every quantized group intact (exit 3: failed)."""
    from ..model.verify import verify as do_verify

    from ..errors import UnsafeCheckpointError

    try:
        report = do_verify(path, model_spec, **verify_kwargs(values, has_model=model_spec is not None))
    except UnsafeCheckpointError as e:  # PATH refused for what it would run: a finding, as scan's (convert: exit 1)
        if not e.finding:
            raise
        exits.fail(ctx, str(e), e, exits.FINDING)
    render(report, values["as_json"], _format_text)
    if not report.ok:
        ctx.exit(exits.FINDING)


@cli.command()
@click.argument("a", type=click.Path(dir_okay=True))
@click.argument("b", type=click.Path(dir_okay=True))
@click.option("--raw", is_flag=True, help="Compare keys as saved (wrapper segments kept).")
@tolerance_options
@map_location_option
@select_option
@trust_option
@json_option
@click.pass_context
def diff(ctx: click.Context, a: str, b: str, raw: bool, atol: float, rtol: float, map_location: tuple[str, ...],
         select: str, trust: bool, as_json: bool) -> None:
    """Compare checkpoints A and B: keys, shapes, dtypes, per-tensor max abs diff (exit 3: they differ)."""
    from ..ops.diff import diff as do_diff

    report = do_diff(a, b, raw=raw, atol=atol, rtol=rtol, map_location=map_location_value(map_location),
                     select=select, trust=trust)
    render(report, as_json, _format_text)
    if not report.identical:
        ctx.exit(exits.FINDING)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=True))
@json_option
@click.pass_context
def scan(ctx: click.Context, path: str, as_json: bool) -> None:
    """Statically check PATH (or an https://, s3:// or hf:// URL) for code it would run when loaded; nothing is
    executed (exit 3: unsafe)."""
    from .. import text
    from ..safety.scanner import scan as do_scan

    report = do_scan(path)
    render(report, as_json, text.scan_text)
    if not report.ok:
        ctx.exit(exits.FINDING)


@cli.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=True))
@click.option("--key", required=True, metavar="KEY.pem", type=click.Path(dir_okay=False),
              help="The EC private key to sign with (PEM; P-256, P-384 or P-521, as model_signing's key method takes).")
@click.option("--signature", metavar="SIG", type=click.Path(dir_okay=False),
              help="Where to write the signature (default: PATH.sig beside a file, PATH/model.sig in a directory).")
@click.option("--certificate", metavar="CERT.pem", type=click.Path(dir_okay=False),
              help="Sign with model_signing's certificate method: KEY's signing certificate (PEM).")
@click.option("--certificate-chain", multiple=True, metavar="CHAIN.pem", type=click.Path(dir_okay=False),
              help="With --certificate: the certificates up to the root (repeatable, or several in one file).")
@click.option("--key-password-env", metavar="VAR", help="The environment variable holding an encrypted KEY's password.")
@json_option
def sign(path: str, key: str, signature: str | None, certificate: str | None, certificate_chain: tuple[str, ...],
         key_password_env: str | None, as_json: bool) -> None:
    """Sign PATH (a checkpoint file or directory) in the OpenSSF Model Signing format, offline: each file's
    SHA-256, hashed in parallel; `model_signing verify key` and `ckptfix verify --signature` check it."""
    import os

    from ..safety.signing import sign as do_sign

    if certificate_chain and certificate is None:
        raise click.UsageError("--certificate-chain goes with --certificate")
    password = os.environ.get(key_password_env) if key_password_env else None
    if key_password_env and password is None:
        raise click.UsageError(f"--key-password-env {key_password_env}: that variable is not set")
    report = do_sign(path, key, signature, certificate=certificate, certificate_chain=certificate_chain,
                     password=password)
    render(report, as_json, _format_text)


def _format_text(report: Any) -> str:
    return str(report.format_text())


def main() -> None:
    """Entry point (``ckptfix`` / ``python -m ckptfix``)."""
    exits.Group.standalone = True
    cli(prog_name="ckptfix")


if __name__ == "__main__":
    main()  # click exits with the command's code
