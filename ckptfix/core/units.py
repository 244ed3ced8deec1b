"""How ckptfix writes byte sizes, dtypes and names from a file in messages, reports and progress lines, and reads
the sizes users give (``--max-shard-size 5GB``).

Imports only :mod:`ckptfix.errors` (no torch), so every layer can use it.

>>> human_size(1536), human_size(3 * 2**30), dtype_name("torch.bfloat16")
('1.5 KiB', '3.0 GiB', 'bfloat16')
>>> print(shown("Run\\x1b[2JConfig"), "|", few(["a", "b", "c"], 2))
Run\\x1b[2JConfig | a, b and 1 more
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import ConversionError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_size(n: float, largest: str = "TiB") -> str:
    """``1536`` → ``'1.5 KiB'``: binary units up to ``largest`` (``'KiB'`` … ``'TiB'``); whole bytes below 1 KiB."""
    for unit in _UNITS[:_UNITS.index(largest)]:
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {largest}"


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` → ``'float32'``: the name reports, JSON and safetensors headers use."""
    return str(dtype).removeprefix("torch.")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` → 5·10⁹ bytes, ``"40KiB"`` → 40·2¹⁰, ``"1000"`` → 1000 (transformers' units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE_RE.match(str(text))
        unit = (m.group(2) or "") if m else ""
        if not m or unit[-1:] == "b":  # transformers reads a lowercase b as bits: refuse the ambiguity
            raise ConversionError(
                f"shard size {text!r} is not a size: use bytes or a number with KB/MB/GB (10^3…) "
                "or KiB/MiB/GiB (2^10…), e.g. 5GB or 500MiB"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS.get(unit.lower(), 1))
    if n <= 0:
        raise ConversionError(f"shard size {text!r} must be more than 0 bytes")
    return n


#: a name from a file (a key, a global, a zip member) is shown at most this long in text and messages; JSON keeps it whole
SHOWN_CHARS = 200
#: a list of names in a text listing or a message shows at most this many (``few``'s default is shorter, for one line)
SHOWN_ITEMS = 20


def escaped(text: str) -> str:
    """``text`` with every character a terminal acts on (C0 and C1 controls, DEL, line separators, Unicode format
    and bidi controls: what ``str.isprintable`` rejects) written as ``repr`` writes it: ``'\\x1b'``, ``'\\u202e'``."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def shown(name: object, limit: int = SHOWN_CHARS) -> str:
    """A name from a file as text and messages show it: :func:`escaped`, and past ``limit`` characters cut, with
    how many were left out (``'mod.RunConfig…(+262,000 chars)'``). Keys and globals can be anything a file holds."""
    text = name if isinstance(name, str) else str(name)
    if len(text) > limit:
        return f"{escaped(text[:limit])}…(+{len(text) - limit:,} chars)"
    return escaped(text)


def listed(texts: Sequence[str], n: int = SHOWN_ITEMS, sep: str = ", ") -> str:
    """The first ``n`` of ``texts`` joined, and how many more: ``'a, b and 3 more'`` (texts already made safe)."""
    return sep.join(texts[:n]) + _more(len(texts), n)


def few(names: Sequence[Any], n: int = 5, sep: str = ", ") -> str:
    """The first ``n`` names from a file, each :func:`shown`, and how many more: ``'a, b, c, d, e and 3 more'``."""
    return sep.join(shown(x) for x in names[:n]) + _more(len(names), n)


def _more(total: int, n: int) -> str:
    return f" and {total - n} more" if total > n else ""
