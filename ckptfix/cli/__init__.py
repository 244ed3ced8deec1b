"""The ``ckptfix`` command: click commands that parse, make one library call and render its result.

``commands`` (the commands and the group), ``options`` (each option defined once; convert's from
:class:`ckptfix.ops.convert_options.ConvertOptions`, verify's from :class:`ckptfix.model.verify_options.VerifyOptions`),
``exits`` (exit codes, failures → one ``Error:`` line), ``output`` (text or one JSON object).

May import: everything, but only inside a command: at import time only ``ckptfix``, :mod:`ckptfix.errors`,
:mod:`ckptfix.core.units` and the plain-data :mod:`ckptfix.ops.convert_options` and
:mod:`ckptfix.model.verify_options`, so ``ckptfix --help`` imports no torch.
"""

from .commands import cli, main

__all__ = ["cli", "main"]
