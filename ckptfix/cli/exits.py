"""Exit codes, and how a failure becomes one ``Error:`` line (and, with ``--json``, one JSON object).

0 ok, 1 error, 2 usage (click's), 3 a finding (verify failed or found unsafe content, diff differs, scan found
unsafe content);
128+N after signal N (temp output removed), 141 when the reader of stdout went away. ``CKPTFIX_DEBUG=1``
shows the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from typing import Any

import click

from ..core.units import shown
from ..errors import NOTHING_WRITTEN, CkptfixError
from .output import emit_json

OK, ERROR, USAGE, FINDING = 0, 1, 2, 3
INTERRUPTED = 130  # SIGINT; ckptfix.errors.Interrupted carries its own 128+N for SIGTERM, SIGHUP
BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports it
#: an Error line is escaped (no control character reaches the terminal) and cut past this many characters: the
#: messages cap the names they show, this is the net under them
ERROR_CHARS = 20_000
#: torch's deprecation notes about its own internals that reading a file can set off (a legacy TypedStorage touched
#: while a checkpoint is read): not the user's concern, so a command prints its output or one Error line only.
#: ckptfix's own warnings (load_into's NaN/Inf note) still show.
TORCH_NOISE = ("TypedStorage is deprecated",  # and reading a quantized tensor, which a quantize_dynamic model saves:
               r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor creation")
_JSON = "ckptfix.json"  # ctx.meta key: --json was on the command line


class Group(click.Group):
    """Maps CkptfixError (and anything unexpected) to one ``Error:`` line and exit 1; with ``--json``
    every failure (usage errors and interrupts included) also prints one JSON object on stdout."""

    #: this process is the ``ckptfix`` command (``main()``), not a caller invoking ``cli`` in-process
    standalone = False

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_JSON] = "--json" in args  # known even when the command's own parsing fails
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        from ..core.interrupts import signals_as_interrupts

        try:
            with signals_as_interrupts(), warnings.catch_warnings():  # SIGTERM, SIGHUP: one line and 128+N
                for message in TORCH_NOISE:
                    warnings.filterwarnings("ignore", message=message, category=UserWarning)
                return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except click.ClickException as e:  # click prints it (usage errors: exit 2)
            _json_error(ctx, e.format_message(), e, e.exit_code)
            raise
        except click.Abort as e:
            _json_error(ctx, "aborted", e, ERROR)
            raise
        except KeyboardInterrupt as e:
            describe = getattr(e, "describe", None)
            message, code = describe() if describe else f"interrupted; {NOTHING_WRITTEN}", getattr(e, "exit_code", INTERRUPTED)
            if self.standalone:
                # The temp output is already gone. End the process here, while the interrupted frames are
                # alive: a torch zip writer in them (torch.save inside DCP's writer) writes its end records
                # when destroyed, into a file its caller has closed, and that aborts the process (exit -6
                # after our Error line) once the traceback is freed.
                _report(ctx, message, e, code)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            fail(ctx, message, e, code)
        except BrokenPipeError:  # the reader (e.g. `| head`) closed the pipe: stop quietly, like cat
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            ctx.exit(BROKEN_PIPE)
        except CkptfixError as e:
            fail(ctx, str(e), e)
        except Exception as e:  # the CLI's edge: no traceback for users
            fail(ctx, f"unexpected {type(e).__name__}: {e} (a bug in ckptfix; CKPTFIX_DEBUG=1 shows the traceback)", e)


def fail(ctx: click.Context, message: str, exc: BaseException, code: int = ERROR) -> None:
    """One ``Error:`` line on stderr (and the JSON object with --json), then exit ``code``."""
    _report(ctx, message, exc, code)
    ctx.exit(code)


def _report(ctx: click.Context, message: str, exc: BaseException, code: int) -> None:
    if os.environ.get("CKPTFIX_DEBUG") and not isinstance(exc, KeyboardInterrupt):
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    click.echo(f"Error: {shown(message, ERROR_CHARS)}", err=True)
    _json_error(ctx, message, exc, code)


def _json_error(ctx: click.Context, message: str, exc: BaseException, code: int) -> None:
    if ctx.meta.get(_JSON):
        emit_json({"error": message, "error_type": type(exc).__name__, "exit_code": code})
