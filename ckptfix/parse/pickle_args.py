"""The text arguments of the protocol-0 opcodes, read exactly as CPython's C unpickler (``_pickle``, the one
``torch.load`` uses) reads them: the static walker and the restricted unpickler share these, so neither
refuses (or misreads) a numeral that ``pickle.loads`` takes, such as ``I0x10``, ``L0o17L`` or ``I1_000``.

Each function takes the line as read, its newline included, and raises ValueError (or OverflowError)
where ``_pickle`` refuses it. C string functions stop at a NUL byte, so the text is cut there.

>>> int_arg(b"0x10\\n"), int_arg(b"017\\n"), int_arg(b"01\\n"), long_arg(b"0o17L\\n")
(16, 15, True, 15)
"""

from __future__ import annotations

import codecs
import math
import re

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1  # a C long (LP64)
# What strtol(s, &end, 0) takes when it stops at the newline or a NUL: C-style octal, hex, decimal.
_STRTOL = re.compile(rb"[ \t\n\v\f\r]*([+-]?)(?:0[xX]([0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*))[\n\0]")
# What PyOS_string_to_double takes (no whitespace, no underscores, no hex), up to the newline or a NUL.
_DOUBLE = re.compile(rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan))[\n\0]")


def _checked(line: bytes) -> bytes:
    if not line.endswith(b"\n") or len(line) < 2:
        raise ValueError("pickle data was truncated")
    return line


def _c_text(line: bytes) -> bytes:
    return line.split(b"\0", 1)[0]


def int_arg(line: bytes) -> int | bool:
    """INT: ``strtol(s, &end, 0)``, else ``int(s, 0)`` when strtol stops early or overflows; a 3-byte
    line whose value is 0 or 1 (``I00``, ``I01``, ``I 1``, ``I-0``) is a bool."""
    _checked(line)
    value = _strtol(line)
    if value is None or not _LONG_MIN <= value <= _LONG_MAX:
        return int(_c_text(line), 0)
    return bool(value) if len(line) == 3 and value in (0, 1) else value


def _strtol(line: bytes) -> int | None:
    """What ``strtol(s, &end, 0)`` converts when it ends at the newline or a NUL (unbounded), else None."""
    if line[:1] == b"\0":
        return 0  # nothing converted, and the end (the start) is a NUL
    m = _STRTOL.match(line)
    if m is None:
        return None
    sign, hex_digits, octal, decimal = m.groups()
    value = int(hex_digits, 16) if hex_digits else int(octal, 8) if octal else int(decimal)
    return -value if sign == b"-" else value


def long_arg(line: bytes) -> int:
    """LONG: ``int(s, 0)``, without the ``L`` Python 2 wrote before the newline."""
    _checked(line)
    return int(_c_text(line[:-2] if line[-2:-1] == b"L" else line), 0)


def float_arg(line: bytes) -> float:
    """FLOAT: ``PyOS_string_to_double``; a finite numeral too large for a double is refused."""
    m = _DOUBLE.match(_checked(line))
    if m is None:
        raise ValueError("could not convert string to float")
    text = m.group()[:-1]
    value = float(text)
    if math.isinf(value) and b"n" not in text.lower():
        raise OverflowError("value too large to convert to float")
    return value


def memo_arg(line: bytes) -> int:
    """GET / PUT: ``int(s, 10)`` that fits a ``Py_ssize_t``."""
    value = int(_c_text(_checked(line)), 10)
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise OverflowError("memo index too large")
    return value


def string_arg(line: bytes) -> bytes:
    """STRING: a quoted, backslash-escaped byte string (the caller decodes it with the pickle's encoding)."""
    if not line.endswith(b"\n"):
        raise ValueError("pickle data was truncated")
    data = line[:-1]
    if len(data) < 2 or data[0] != data[-1] or data[:1] not in (b"'", b'"'):
        raise ValueError("the STRING opcode argument must be quoted")
    return codecs.escape_decode(data[1:-1])[0]


def unicode_arg(line: bytes) -> str:
    """UNICODE: raw-unicode-escape text."""
    if not line.endswith(b"\n"):
        raise ValueError("pickle data was truncated")
    return str(line[:-1], "raw-unicode-escape")


def persid_arg(line: bytes) -> str:
    """PERSID: an ASCII persistent id."""
    if not line.endswith(b"\n"):
        raise ValueError("pickle data was truncated")
    return line[:-1].decode("ascii")


def name_arg(line: bytes, encoding: str) -> str:
    """One line of GLOBAL (UTF-8) or INST (ASCII): never empty."""
    return _checked(line)[:-1].decode(encoding)
