"""Stand-ins for the torch globals a ``data.pkl`` names (``torch._utils._rebuild_tensor_v2``,
``torch.FloatStorage``, ``torch.float16`` …), so Python's C pickler can write them without importing torch.

Each stand-in is an attribute of this module under torch's name, and pickles as a global (its
``__reduce__`` returns that name), so the pickler writes ``GLOBAL ckptfix.formats.torchsave.torch_globals NAME``;
:func:`to_torch` then rewrites each such opcode into torch's module (``GLOBAL torch._utils NAME``).
Nothing here is ever called: it is a name to write.
"""

from __future__ import annotations

from typing import Any

from ...core.torch_tables import DTYPE_ITEMSIZE, STORAGE_DTYPES

_PREFIX = b"c" + __name__.encode("ascii") + b"\n"  # how the pickler writes GLOBAL of this module (protocol 2)


class Name:
    """``module.name`` of torch's, written into a pickle by name."""

    def __init__(self, torch_module: str, name: str):
        self.torch_module, self.name = torch_module, name

    def __reduce__(self) -> str:  # a string: pickled as the global of that name in this module
        return self.name

    def __call__(self, *args: Any) -> Any:  # a reduce tuple's callable must be callable
        raise TypeError(f"{self.torch_module}.{self.name} is a name to write, not a function")

    def __repr__(self) -> str:
        return f"{self.torch_module}.{self.name}"


def _define(torch_module: str, name: str) -> Name:
    stand_in = NAMES[name] = Name(torch_module, name)
    globals()[name] = stand_in  # getattr(this module, name) is the stand-in: what the pickler checks
    return stand_in


NAMES: dict[str, Name] = {}
REBUILD_TENSOR = _define("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = _define("torch._utils", "_rebuild_tensor_v3")
REBUILD_PARAMETER = _define("torch._utils", "_rebuild_parameter")
UNTYPED_STORAGE = _define("torch.storage", "UntypedStorage")
#: dtype name → its legacy storage class (what ``TypedStorage._pickle_storage_type`` names)
STORAGE_CLASS = {dtype: _define("torch", cls) for cls, dtype in STORAGE_DTYPES.items() if dtype in DTYPE_ITEMSIZE}
#: dtype name → ``torch.<dtype>``
DTYPES = {name: _define("torch", name) for name in DTYPE_ITEMSIZE}


def marker() -> bytes:
    """The bytes every stand-in's GLOBAL opcode starts with (a pickle holding them elsewhere can't be rewritten)."""
    return _PREFIX[1:-1]


def to_torch(data: bytes) -> bytes:
    """``data`` with each stand-in's GLOBAL rewritten to torch's module. Protocol 2 has no frames or
    offsets, so a GLOBAL's text may change length. Each stand-in is written once (the pickler memoizes
    it); the caller made sure its marker appears nowhere else (:func:`marker`), checked again here."""
    found = data.count(_PREFIX)
    for name, stand_in in NAMES.items():
        ours = _PREFIX + name.encode("ascii") + b"\n"
        if ours in data:
            data = data.replace(ours, b"c" + f"{stand_in.torch_module}\n{name}\n".encode("ascii"))
            found -= 1
    if found or marker() in data:
        raise ValueError("a stand-in name was written where it can't be rewritten")
    return data
