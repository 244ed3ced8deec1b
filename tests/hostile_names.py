"""Checkpoints whose names are hostile or whose structure is odd, written with torch's own code paths.

``write_with_globals`` saves an object with ``torch.save`` and renames the globals of its placeholder objects
(``marker(i)``) in ``data.pkl`` to any text: control characters, bidi controls, names of 256 KiB. Item 13's
files (``meta_rebuild_state_dict``, ``namespace_class_swap``, ``safetensors_bad_order``) are the ones the first
adversarial corpus ended in "a bug in ckptfix" with.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from tests.adversarial import write_zip

#: what a terminal does with it: clears the screen (ESC [2J), retitles the window (OSC 0 ; … BEL)
ESCAPES = "Run\x1b[2J\x1b]0;pwned\x07Config\u202e\x9b"
_MODULE = "ckptfix_marker_mod"


def marker(i: int) -> Any:
    """An instance of the importable class ``ckptfix_marker_mod.P<i>``: ``write_with_globals`` renames it."""
    module = sys.modules.setdefault(_MODULE, types.ModuleType(_MODULE))
    cls = getattr(module, f"P{i}", None)
    if cls is None:
        cls = type(f"P{i}", (), {"__module__": _MODULE})
        setattr(module, f"P{i}", cls)
    return cls()


def write_with_globals(path: Path, obj: Any, names: list[tuple[str, str]]) -> Path:
    """``torch.save(obj)`` with the global of ``marker(i)`` named ``names[i]`` (module, qualname) in data.pkl."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    members = []
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/data.pkl"):
                for i, (module, name) in enumerate(names):
                    old = f"c{_MODULE}\nP{i}\n".encode()
                    assert data.count(old) == 1, old
                    data = data.replace(old, b"c" + f"{module}\n{name}\n".encode())
            members.append((info.filename, data))
    write_zip(path, members)
    return path


# -- item 13: files the first corpus ended in "a bug in ckptfix" with ----------------------------------

def meta_rebuild_state_dict(path: Path) -> Path:
    """A state dict whose tensors torch rebuilds with ``_rebuild_meta_tensor_no_storage`` (saved on meta)."""
    torch.save({"w": torch.empty(3, 2, device="meta"), "b": torch.empty(2, device="meta")}, path)
    return path


def namespace_class_swap(path: Path) -> Path:
    """``{"state_dict": {...}, "args": Namespace()}`` whose Namespace BUILD slot state sets ``__class__``:
    pickle's BUILD would ``setattr(ns, "__class__", cls)``, swapping the object's type."""
    import argparse
    import collections

    class Swap:
        def __reduce__(self) -> Any:
            return argparse.Namespace, (), ({"lr": 0.1}, {"__class__": collections.OrderedDict})

    torch.save({"state_dict": {"w": torch.ones(2)}, "args": Swap()}, path)
    return path


def safetensors_with_metadata(path: Path, metadata: dict[str, str]) -> Path:
    """A one-tensor safetensors file with ``metadata`` as its ``__metadata__``."""
    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + struct.pack("<2f", 1.0, 2.0))
    return path
