"""The safety policy: the one allow-list and what each allowed global may do, the guards that build the
unpickler's policy from it, numpy and stand-in policies, the DCP and DeepSpeed pickle policies, the
scanners behind ``ckptfix scan`` and every untrusted load, ``integrity`` (a file's SHA-256, its zip CRC-32
findings) and ``signing`` (OpenSSF model signatures).

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.errors`.

>>> from ckptfix.safety import scan                                    # doctest: +SKIP
>>> scan("downloaded.pth").ok
"""

from .file_scanners import ScanReport
from .scanner import ensure_safe, scan

__all__ = ["ScanReport", "ensure_safe", "scan"]
