"""TorchScript archives read without running them: the module tree's tensors, from data.pkl.

``torch.jit.load`` compiles and runs the archive's code. For a summary (``inspect``) this reader
walks ``ROOT/data.pkl`` with the static pickle walker instead and turns each tensor of the module
tree into a meta tensor with the saved shape, dtype, strides and storage sharing, named by its
attribute path. The ``__parameters__``/``__buffers__`` lists in the archive's code, read as text
and never run, keep the names to what ``state_dict()`` holds.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections import OrderedDict
from typing import Any

from ..parse import pickle_walk, zipcheck
from ..safety import scanner
from ..safety.allowlist import REBUILD_PARAMETER, REBUILD_PARAMETER_WITH_STATE, REBUILD_TENSOR, REBUILD_TENSOR_V2
from ..core import locations
from ..core.devices import storage_id
from ..errors import CkptfixError, FormatError, UnsafeCheckpointError, trust_advice
from ..parse.format_registry import TORCHSCRIPT
from ..parse.pickle_walk import Call, Persistent, Ref
from ..parse.zipcheck import read_member
from .base import RawRead, Reader
from .torchsave.torch_io import first_line

def read(path: str, fmt: str, plan: Any, trust: bool, select: str | None, read_part: Reader) -> RawRead:
    """On meta, the state dict listed without running anything (:func:`read_meta`); else, trusted only,
    ``torch.jit.load``'s module's state dict (which runs the archive's code)."""
    import torch

    if plan.is_meta:
        try:
            return read_meta(path)  # runs none of the archive's code
        except CkptfixError:
            if not trust:
                raise
    if not trust:
        raise UnsafeCheckpointError(
            f"{path}: is a TorchScript archive; loading it runs the code inside it. "
            f"{trust_advice()} to extract "
            "its state dict; `ckptfix inspect` lists its tensors without running anything."
        )
    dev = "cpu" if plan.user_fn is not None or plan.mapping is not None else plan.target("cpu")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.load. is deprecated", category=FutureWarning)
            module = torch.jit.load(path, map_location="cpu" if dev == "meta" else dev)
    except (RuntimeError, ValueError, OSError) as e:
        raise FormatError(f"{path}: can't be read as a TorchScript archive: {first_line(e)}") from None
    sd = module.state_dict()
    if dev == "meta":
        sd = type(sd)((k, v.to("meta")) for k, v in sd.items())
    return RawRead(obj=sd, format=TORCHSCRIPT, notes=["state dict extracted from a TorchScript module"])


_TENSOR = {REBUILD_TENSOR_V2, REBUILD_TENSOR}
_PARAMETER = {REBUILD_PARAMETER, REBUILD_PARAMETER_WITH_STATE}
_CLASS = re.compile(r"^class (\w+)\(")
_DECLARED = re.compile(r"^\s+__(?:parameters|buffers)__ = (\[.*\])\s*$")


def read_meta(path: str) -> RawRead:
    """The archive's state dict on ``meta``, with each storage's saved device as its tag."""
    scanner.ensure_safe(path, TORCHSCRIPT, structure_only=True)
    with locations.open_buffer(path, whole=True) as buf:
        layout = zipcheck.check_zip(path, buf, len(buf), torchscript=True, check_crc=False)
        member = layout.unique(f"{layout.root}/data.pkl")
        if member is None:
            raise FormatError(f"{path}: TorchScript archive without {layout.root}/data.pkl")
        try:
            data = zipcheck.read_member(member, buf)
            declared = _declared_state(layout, buf)
        except ValueError as e:
            raise FormatError(f"{path}: member {member.name} {e}") from None
    walk = pickle_walk.walk(data, 0, member.name)
    if walk.error:
        raise FormatError(f"{path}: {member.name} is truncated or corrupt ({walk.error})")
    builder = _Builder(path, declared)
    builder.visit(walk.value, "", 0)
    return RawRead(obj=builder.state_dict, format=TORCHSCRIPT, tags=builder.tags,
                   notes=["TorchScript archive: tensors listed from data.pkl; its code was not run"])


def _declared_state(layout: Any, buf: Any) -> dict[str, set[str]]:
    """``__torch__.pkg.Class`` → the parameter and buffer names its code declares."""
    code = f"{layout.root}/code/"
    out: dict[str, set[str]] = {}
    for m in layout.members:
        if not (m.name.startswith(code) and m.name.endswith(".py")):
            continue
        module = m.name[len(code) : -len(".py")].replace("/", ".")
        current = None
        for line in read_member(m, buf).decode("utf-8", "replace").splitlines():
            if match := _CLASS.match(line):
                current = out.setdefault(f"{module}.{match.group(1)}", set())
            elif current is not None and (match := _DECLARED.match(line)):
                try:
                    current.update(str(n) for n in ast.literal_eval(match.group(1)))
                except (ValueError, SyntaxError):
                    continue
    return out


class _Builder:
    """Walks the simulated module tree and collects its tensors as meta tensors."""

    def __init__(self, path: str, declared: dict[str, set[str]]):
        self.path = path
        self.declared = declared
        self.state_dict: OrderedDict = OrderedDict()
        self.tags: dict[int, str] = {}
        self.storages: dict[str, Any] = {}
        self.seen: set[int] = set()

    def visit(self, value: Any, prefix: str, depth: int) -> None:
        if depth > 200 or id(value) in self.seen:
            return
        self.seen.add(id(value))
        if isinstance(value, Call) and isinstance(value.func, Ref):
            if value.func.full in _TENSOR | _PARAMETER:
                self.add(prefix, value)
                return
            names = self.declared.get(value.func.full)
            state = value.state if isinstance(value.state, dict) else {}
            for key, item in state.items():
                if isinstance(item, Call) and self.is_tensor(item):
                    if names is None or key in names:
                        self.add(_join(prefix, key), item)
                else:
                    self.visit(item, _join(prefix, key), depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.visit(item, _join(prefix, key), depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.visit(item, _join(prefix, i), depth + 1)

    @staticmethod
    def is_tensor(call: Any) -> bool:
        return isinstance(call.func, Ref) and call.func.full in _TENSOR | _PARAMETER

    def add(self, key: str, call: Any) -> None:
        import torch

        if call.func.full in _PARAMETER and call.args and isinstance(call.args[0], Call):
            call = call.args[0]
        try:
            if not isinstance(call.args[0], Persistent) or call.args[0].pid[0] != "storage":
                raise ValueError("its data is not a storage")
            pid, offset, size, stride = call.args[0].pid, call.args[1], call.args[2], call.args[3]
            dtype = torch.serialization.StorageType(pid[1].name).dtype
            location = str(pid[3])
            if pid[2] not in self.storages:
                nbytes = int(pid[4]) * dtype.itemsize
                self.storages[pid[2]] = torch.UntypedStorage(nbytes, device="meta")
            t = torch.empty(0, dtype=dtype, device="meta").set_(self.storages[pid[2]], offset, size, stride)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
            raise FormatError(f"{self.path}: tensor {key!r} in the TorchScript archive can't be read ({e})") from None
        self.state_dict[key] = t
        self.tags[storage_id(t)] = location


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def recorded_members(path: str, fmt: str, select: str | None, part_members: Any) -> list[Any]:
    """None: ``torch.jit.load`` reads the archive itself (trusted), not record by record through a check."""
    return []
