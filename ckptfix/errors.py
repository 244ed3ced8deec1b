"""The one error hierarchy of ckptfix: every failure a user can cause or meet is a CkptfixError.

Messages name the file, the key or the device, and say what to do next, on one line. The CLI
prints ``Error: <message>`` and exits 1; ``CKPTFIX_DEBUG=1`` shows the traceback. Each subclass is
also the built-in type code would already catch for that failure: a ValueError for a bad file,
argument or combination of options (FormatError, DeviceError, KeyCollisionError, WrapperError,
ConversionError, ModelSpecError, DeepSpeedZeroError, InputError, GoldenError), a LookupError when
the state dict to select isn't there (SelectError), a RuntimeError where torch raises one (LoadError,
like ``load_state_dict``; ForwardError, a failing forward), a FileNotFoundError (MissingFileError)
and an OSError (DestinationError, RemoteError). UnsafeCheckpointError and LimitError are none: no built-in means
"refused" or "over a limit ckptfix sets" (a MemoryError or ValueError there would be caught as
something else, inside ckptfix too).
"""

from __future__ import annotations

import errno

#: The tail of a message about a failed write: the destination is as it was.
NOTHING_WRITTEN = "nothing was written"


def pass_flag(name: str) -> str:
    """The advice to turn on a boolean option, for both audiences: ``pass --trust (library: trust=True)``."""
    return f"pass --{name.replace('_', '-')} (library: {name}=True)"


def trust_advice(what: str = "file") -> str:
    """``If you trust this file and its author, pass --trust (library: trust=True)``: how to load what was refused."""
    return f"If you trust this {what} and its author, {pass_flag('trust')}"


class CkptfixError(Exception):
    """Base class: a problem with a checkpoint, a request or the machine, explained for a person."""

    #: the state dicts an ambiguous automatic choice was between (another rule, the model's keys, may choose)
    candidates: tuple[str, ...] = ()


class FormatError(CkptfixError, ValueError):
    """The file is not a checkpoint ckptfix can read, or it is malformed or truncated (also a ValueError)."""


class MissingFileError(FormatError, FileNotFoundError):
    """A path given to ckptfix does not exist (also a FileNotFoundError: ``errno``, ``filename`` set)."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno.ENOENT, "No such file or directory", filename

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno 2] …" form
        return str(self.args[0]) if self.args else ""


class UnsafeCheckpointError(CkptfixError):
    """Loading the file would need globals outside the allow-list (code could run); pass trust."""

    #: the checkpoint ``verify`` judges was refused (not its --input or --reference): the CLI's exit 3, a finding
    finding = False

    def __init__(self, message: str, globals_: list[str] | None = None):
        super().__init__(message)
        self.globals = list(globals_ or [])


class DeviceError(CkptfixError, ValueError):
    """A map_location asks for a device this machine does not have, or is not understood."""


class SelectError(CkptfixError, LookupError):
    """The state dict inside a training checkpoint can't be found, or the choice is ambiguous."""


class KeyCollisionError(CkptfixError, ValueError):
    """Two keys would become the same key after renaming; nothing is written."""


class WrapperError(CkptfixError, ValueError):
    """Keys that can't be normalised (e.g. FSDP1 flat parameters)."""


class DestinationError(CkptfixError, OSError):
    """The output path can't be written: exists without force, is the source, an I/O failure, or a destination ckptfix
    doesn't write (``https://``, ``hf://``, a directory to ``s3://``) (also an OSError)."""


class RemoteError(CkptfixError, OSError):
    """A remote checkpoint (https://, s3://, hf://) can't be read as asked: access refused, a server error or
    timeout, a redirect loop, a server that ignores Range requests, a file that changed between two requests,
    or a verb that needs a local copy (also an OSError)."""

    def __str__(self) -> str:  # the message alone, not OSError's "[Errno …]" form
        return str(self.args[0]) if self.args else ""


class NeedsLocalCopy(RemoteError):
    """A URL given where only a local file will do (a verb, an option or a format that reads the whole file).

    The one message for it: ``URL: WHAT needs a local copy (WHY); download it first``. ``what`` names the
    request (``"reading a tar archive"``, ``"converting it with --dtype bf16"``), ``why`` the reason when it
    is not obvious (``"torch.load reads the whole file"``)."""

    def __init__(self, location: str, what: str, why: str | None = None):
        self.location, self.what, self.why = location, what, why
        reason = f" ({why})" if why else ""
        super().__init__(f"{location}: {what} needs a local copy{reason}; download it first")


class ConversionError(CkptfixError, ValueError):
    """The checkpoint can't be written in the requested format as asked."""


class ModelSpecError(CkptfixError, ValueError):
    """A model spec (torchvision:NAME, pkg.mod:fn, file.py:fn) can't be resolved or built."""


class LoadError(CkptfixError, RuntimeError):
    """A checkpoint does not load into the given model; the message is the short report."""


class InputError(CkptfixError, ValueError):
    """The forward check's input can't be made as asked (--input-shape/-dtype/-range, --input FILE); says what to pass."""


class GoldenError(CkptfixError, ValueError):
    """A golden file recorded another input or dtype than this run asks for, or record_golden has no path to write."""


class ForwardError(CkptfixError, RuntimeError):
    """The model's forward raised on the check's input (also a RuntimeError, as torch's own failures are)."""


class LimitError(CkptfixError):
    """Reading the file would pass a resource limit (memory, nesting); the message names the limit."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


class DeepSpeedZeroError(CkptfixError, ValueError):
    """A DeepSpeed ZeRO checkpoint that can't give its fp32 weights as given (a rank file missing or from another
    save, ZeRO-3 placeholders, a half-precision copy not selected); the message says what to give."""


class SigningError(CkptfixError, ValueError):
    """A signature can't be made or checked as asked: model-signing not installed, a key it doesn't take, a
    signature file it can't read; the message says what to give instead."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived while ckptfix was working; its temp output has been removed.

    A KeyboardInterrupt, so whatever stops on Ctrl-C stops on it too. ``signum`` is the signal and
    ``exit_code`` the shell's 128 + signum (130 SIGINT, 143 SIGTERM, 129 SIGHUP); ``written`` is
    True when the signal came while the finished output was being renamed into place (it is kept).
    ``outcome`` says what became of the work where it isn't a written output (``load_into``: nothing was loaded, or
    the model was loaded first).
    """

    def __init__(self, signum: int, written: bool = False, outcome: str | None = None):
        import signal

        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        self.written = written
        self.outcome = outcome
        super().__init__(self.describe())

    def describe(self) -> str:
        """``interrupted; nothing was written`` / ``terminated (SIGTERM); nothing was written``."""
        what = "interrupted" if self.signal_name == "SIGINT" else f"terminated ({self.signal_name})"
        if self.outcome:
            return f"{what}; {self.outcome}"
        return what + ("; the output was already complete and is in place" if self.written else f"; {NOTHING_WRITTEN}")
