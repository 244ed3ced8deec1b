"""torch.save files: the zip format (torch >= 1.6) and the legacy pickle stream, through torch.load and torch.save.

Reading goes through ``torch.load`` with ckptfix's restricted unpickler (unless the caller trusts
the file), ``mmap=True`` for zip files, and a map_location callable that records the saved device
tag of every storage. torch's own exceptions become FormatError/UnsafeCheckpointError.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

from ...core import locations
from ...core.devices import NeedsValues
from ...core.tensorinfo import layout_name
from ...safety import guards, scanner, subclasses
from ...errors import CkptfixError, ConversionError, FormatError, NeedsLocalCopy, UnsafeCheckpointError, trust_advice
from ...safety.standins import pickle_module_for
from ...parse.unpickler import Refused, SafePickle
from ...parse.format_registry import get
from ..base import RawRead


def read(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    """``torch.load`` of ``path`` with the device plan, restricted unless ``trust`` (a zip mapped, not read;
    a legacy file on meta without its tensor bytes)."""
    if locations.is_remote(path):
        raise NeedsLocalCopy(path, f"reading this {fmt} file{' with trust' if trust else ''}",
                             "torch.load reads the whole file")
    zipped = get(fmt).zip
    if not trust:
        scanner.ensure_safe(path, fmt, placeholders=True)  # others: inert, refused in the state dict
    tags: dict[int, str] = {}
    # torch.load routes any path ending in .safetensors to safetensors: hand it a file object then.
    by_name = not path.endswith(".safetensors")
    locations.hold(path)  # (torch maps a zip: mmap=True)
    try:
        with open(path, "rb") as f:
            obj = torch_load(path if by_name else f, plan.torch_map_location(tags), trust=trust,
                             mmap=zipped and by_name, skip_data=not zipped and plan.is_meta, placeholders=True)
    except CkptfixError:
        raise
    except Exception as e:  # torch raises many types for bad files; all become FormatError
        if not zipped and plan.is_meta and _META_VIEW in str(e):
            # a torch <= 0.3 storage view (a slice of its root storage): torch can't slice a meta storage
            raise NeedsValues(f"{path}: a legacy storage view can't be built on meta") from None
        raise translate_load_error(path, fmt, e) from None
    if plan.is_meta and not zipped and any(layout_name(t) is not None for t in tensors_in(obj)):
        # a legacy file's sparse tensor, its indices unread on meta: read with values, where they are checked
        raise NeedsValues(f"{path}: a sparse tensor's indices are checked on its values")
    return RawRead(obj=obj, format=fmt, tags=tags, notes=subclasses.take_notes())


def tensors_in(obj: Any) -> Iterator[Any]:
    """The tensors in ``obj``'s containers (dicts, lists, tuples), depth first."""
    import torch

    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


#: what torch's legacy loader raises slicing a root storage on meta (a structure read of a storage view)
_META_VIEW = "Not available for 'meta' device type"


def torch_load(source: Any, map_location: Any, trust: bool, mmap: bool = False, skip_data: bool = False,
               placeholders: bool = False) -> Any:
    """``torch.load`` of a torch zip or legacy file (a path or file object), untrusted unless ``trust``.

    Untrusted, every pickle torch reads goes through ckptfix's restricted unpickler
    (:mod:`ckptfix.parse.unpickler` with :func:`ckptfix.safety.guards.torch_policy`); the stand-ins it makes
    are turned into the real objects before returning. ``skip_data`` reads a legacy file's structure
    without its tensor bytes; ``placeholders``: globals outside the allow-list become inert placeholders
    (a torch file read whole, whose reader refuses them inside the state dict).
    Errors are torch's or the unpickler's; callers translate them.
    """
    import torch

    kwargs: dict[str, Any] = {"map_location": map_location}
    if mmap:
        kwargs["mmap"] = True
    if trust:
        with _skipping_data(skip_data):
            return torch.load(source, weights_only=False, **kwargs)
    _refuse_torchscript(source)
    policy = guards.torch_policy(placeholders)
    guards.start_load()
    with _skipping_data(skip_data), _no_forced_weights_only(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        where = str(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "pickle")
        obj = torch.load(source, weights_only=False, pickle_module=SafePickle(policy, str(where)), **kwargs)
    return policy.finish(obj)


@contextlib.contextmanager
def _skipping_data(skip: bool) -> Iterator[None]:
    import torch

    if not skip:
        yield
        return
    with torch.serialization.skip_data():
        yield


@contextlib.contextmanager
def _no_forced_weights_only() -> Iterator[None]:
    """torch.load refuses any pickle_module when TORCH_FORCE_WEIGHTS_ONLY_LOAD is set; ckptfix's is the
    stricter one, so the variable is lifted for the call (and restored)."""
    saved = os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved


def _refuse_torchscript(source: Any) -> None:
    """torch.load without weights_only hands a TorchScript archive to torch.jit.load, which runs its
    code: ask torch's own reader, exactly as torch.load will, and refuse such an archive first."""
    import torch

    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return _refuse_torchscript(f)
    start = source.tell()
    is_zip = source.read(4) == b"PK\x03\x04"
    source.seek(start)
    if not is_zip:
        return
    try:
        reader = torch._C.PyTorchFileReader(source)
        scripted = torch.serialization._is_torchscript_zip(reader)
    except RuntimeError:
        return  # torch.load will fail on it too
    finally:
        source.seek(start)
    if scripted:
        raise UnsafeCheckpointError(
            f"{getattr(source, 'name', 'the file')}: is a TorchScript archive (it has constants.pkl); loading it "
            f"runs the code inside it. {trust_advice()}."
        )


def translate_load_error(path: str, fmt: str, e: BaseException) -> CkptfixError:
    """torch's exception for a bad or refused file → UnsafeCheckpointError or FormatError."""
    if isinstance(e, MemoryError):
        return FormatError(f"{path}: ran out of memory reading it (a corrupt size field?)")
    if isinstance(e, pickle.UnpicklingError):
        return unpickling_error(path, e)
    return FormatError(f"{path}: can't be read as a {fmt} checkpoint: {first_line(e)}")


def first_line(e: BaseException) -> str:
    """The exception's first line of text (its type's name when it has none)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def unpickling_error(path: str, e: Exception) -> CkptfixError:
    """A pickle the restricted unpickler refused (UnsafeCheckpointError), or a broken one (FormatError)."""
    if isinstance(e, Refused):
        names = [e.name] if e.name else []
        return UnsafeCheckpointError(
            f"{path}: refused: {first_line(e)}. {trust_advice()}; `ckptfix scan` lists everything it references.",
            names,
        )
    return FormatError(f"{path}: is corrupt or truncated (the pickle can't be read: {first_line(e)})")


def write(obj: Any, path: str) -> list[str]:
    """``torch.save`` in the zip format, which plain ``torch.load(weights_only=True)`` reads."""
    import torch

    # Through a file object: given a path, torch names the archive's root folder after the file,
    # which here is the atomic writer's temp name. Stand-ins are written under their original names.
    try:
        with open(path, "wb") as f:
            torch.save(obj, f, pickle_module=pickle_module_for(obj))
    except RuntimeError as e:
        # A failed write (disk full, Ctrl-C) makes torch's cleanup raise "unexpected pos", hiding it.
        if isinstance(e.__context__, (OSError, KeyboardInterrupt)):
            raise e.__context__ from None
        if "view the same data as different types" in str(e):  # loaded from a file whose records say so
            raise ConversionError(
                "two tensors or storages view the same bytes as different dtypes, which torch.save refuses to write; "
                "convert to the CPU without --trust, which copies the file's records as they are") from None
        raise
    return []
