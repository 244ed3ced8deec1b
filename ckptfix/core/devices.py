"""map_location: parse every form torch.load accepts, check it against this machine, the auto policy.

A checkpoint records a location tag per storage (``cpu``, ``cuda:1``, …). ``DevicePlan`` turns a
map_location into one function ``tag -> device`` so every path (torch files, safetensors) maps
the same way, refuses a device this machine lacks with a readable error — never torch's
"Attempting to deserialize object on a CUDA device" — and records which tag each storage had.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import DeviceError, FormatError


class NeedsValues(FormatError):
    """A tensor torch can't build on ``meta`` (quantized, nested, a legacy ``set_``): a structure read
    of it is read on the CPU instead, mapped (torch.load's ``mmap``), which its caller does on catching this."""

_DEVICE_RE = re.compile(r"^(cpu|meta|cuda|mps|xpu|hpu|npu|xla|privateuseone)(?::(\d+))?$")


def normalise_device(spec: Any) -> str:
    """``'cuda'``/``torch.device('cuda', 1)``/``'CUDA:1 '`` → canonical strings like ``'cuda:1'``."""
    s = str(spec).strip().lower()
    m = _DEVICE_RE.match(s)
    if not m:
        raise DeviceError(
            f"map_location {spec!r} is not a device: use cpu, cuda, cuda:N, meta, auto, "
            "or FROM=TO pairs such as cuda:1=cuda:0"
        )
    return s


def available_devices() -> list[str]:
    """Devices this process can put tensors on (without initialising CUDA when it's absent)."""
    import torch

    out = ["cpu", "meta"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def _describe_available() -> str:
    real = [d for d in available_devices() if d != "meta"]
    return ", ".join(real)


def check_device(device: str, tag: str | None = None, source: str = "") -> str:
    """Return ``device`` in canonical form if this machine has it, else a DeviceError that says so."""
    dev = normalise_device(device)
    if dev == "cuda":
        import torch

        if torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
    if dev in ("cpu", "meta") or dev in available_devices():
        return dev
    where = f"{source}: " if source else ""
    saved = f" (saved on {tag})" if tag and tag != dev else ""
    raise DeviceError(
        f"{where}device {dev}{saved} is not available on this machine (available: "
        f"{_describe_available()}). Load with map_location='cpu' (CLI: --map-location cpu), "
        f"or remap it, e.g. --map-location {tag or dev}=cpu."
    )


def parse_cli_map_location(values: Iterable[str]) -> Any:
    """CLI ``--map-location`` values: one device/keyword, or repeatable ``FROM=TO`` pairs."""
    values = [v for v in values if v]
    if not values:
        return "cpu"
    if any("=" in v for v in values):
        pairs: dict[str, str] = {}
        for v in values:
            if "=" not in v:
                raise DeviceError(f"--map-location {v!r}: mix of a device and FROM=TO pairs; use pairs only")
            src, dst = (p.strip() for p in v.split("=", 1))
            pairs[normalise_device(src)] = normalise_device(dst)
        return pairs
    if len(values) > 1:
        raise DeviceError("--map-location takes one device, or repeatable FROM=TO pairs")
    return values[0]


class DevicePlan:
    """One map_location, resolved: ``target(tag)`` says where a storage saved on ``tag`` goes."""

    def __init__(self, map_location: Any = "cpu", source: str = ""):
        self.source = source
        self.spec = map_location
        self.user_fn: Callable | None = None
        self.mapping: dict[str, str] | None = None
        self.fixed: str | None = None
        self.auto = False
        if map_location is None:
            self.mapping = {}
        elif callable(map_location) and not isinstance(map_location, (str, Mapping)):
            self.user_fn = map_location
        elif isinstance(map_location, Mapping):
            self.mapping = {normalise_device(k): normalise_device(v) for k, v in map_location.items()}
            for v in self.mapping.values():
                check_device(v, source=source)
        elif str(map_location).strip().lower() == "auto":
            self.auto = True
        else:
            self.fixed = check_device(map_location, source=source)

    @property
    def is_meta(self) -> bool:
        return self.fixed == "meta"

    def reaches_gpu(self) -> bool:
        """Whether a storage may go to a GPU: a fixed CUDA device; ``auto`` or a mapping (a saved tag may stay on,
        or be mapped to, a GPU) where CUDA is available; never through a callable (the caller's own)."""
        if self.user_fn is not None or self.is_meta:
            return False
        if self.fixed is not None:
            return self.fixed.startswith("cuda")
        import torch

        return bool(torch.cuda.is_available())

    def values_instead(self) -> DevicePlan:
        """For a structure read (``meta``) of tensors that need their values (:class:`NeedsValues`): the CPU."""
        return DevicePlan("cpu", source=self.source) if self.is_meta else self

    def target(self, tag: str) -> str:
        """Where a storage saved on ``tag`` goes; raises DeviceError for a device not here."""
        tag = str(tag)
        if self.fixed is not None:
            return self.fixed
        if self.auto:
            return auto_device(tag)
        assert self.mapping is not None
        return check_device(self.mapping.get(tag, tag), tag=tag, source=self.source)

    def torch_map_location(self, record: dict[int, str]) -> Callable:
        """A callable for ``torch.load(map_location=…)`` that also records ``storage id → saved tag``."""
        import torch
        from torch.serialization import default_restore_location

        def restore(storage: Any, location: str) -> Any:
            if self.user_fn is not None:
                result = self.user_fn(storage, location)
                if result is None:
                    result = default_restore_location(storage, location)
            else:
                dev = self.target(location)
                if dev == "meta":
                    result = torch.UntypedStorage(storage.nbytes(), device="meta")
                elif dev == "cpu" and storage.device.type == "cpu":
                    result = storage
                else:
                    result = default_restore_location(storage, dev)
            record[storage_id(result)] = str(location)
            return result

        return restore


def auto_device(tag: str) -> str:
    """The ``auto`` policy: under torchrun with CUDA, ``cuda:LOCAL_RANK``; else the saved device if
    it exists here, else CPU. Never every rank onto cuda:0."""
    dev = normalise_device(tag)
    if dev.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            local_rank = os.environ.get("LOCAL_RANK")
            if local_rank is not None and local_rank.isdigit():
                return f"cuda:{int(local_rank)}"
    if dev in available_devices():
        return dev
    return "cpu"


def storage_id(obj: Any) -> int:
    """Identity of the storage behind a tensor or storage (``_cdata``: same for every view); a sparse or
    other non-strided tensor, which has no single storage, is its own identity."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return id(obj)
        obj = obj.untyped_storage()
    elif isinstance(obj, torch.storage.TypedStorage):
        obj = obj._untyped_storage
    return int(obj._cdata)
