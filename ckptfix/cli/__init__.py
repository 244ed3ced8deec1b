"""The ``ckptfix`` command: click commands that parse, make one library call and render its result.

May import: everything, but only inside a command: at import time only ``ckptfix``, :mod:`ckptfix.errors` and
:mod:`ckptfix.core.units`, so ``ckptfix --help`` imports no torch.
"""

from .commands import cli, main

__all__ = ["cli", "main"]
