"""How ckptfix writes byte sizes and dtypes in messages, reports and progress lines.

Imports nothing (no torch), so every layer can use it.

>>> human_size(1536), human_size(3 * 2**30), dtype_name("torch.bfloat16")
('1.5 KiB', '3.0 GiB', 'bfloat16')
"""

from __future__ import annotations

from typing import Any

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
