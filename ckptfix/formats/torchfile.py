"""torch.save files: the zip format (torch >= 1.6) and the legacy pickle stream, plus TorchScript.

Reading goes through torch's ``weights_only`` unpickler with ckptfix's allow-list (unless the
caller trusts the file), ``mmap=True`` for zip files, and a map_location callable that records the
saved device tag of every storage. torch's own exceptions become FormatError/UnsafeCheckpointError.
"""

from __future__ import annotations

import pickle
import re
import warnings
from typing import Any

from ..errors import CkptfixError, FormatError, UnsafeCheckpointError
from . import TORCH_LEGACY, TORCH_ZIP, TORCHSCRIPT, RawRead

# "Unsupported global: GLOBAL a.b was not…" and "Trying to load unsupported GLOBAL posix.system whose…"
_UNSUPPORTED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")
_UNSUPPORTED_OPERAND = re.compile(r"Unsupported operand \d+")
_WEIGHTS_ONLY_DETAIL = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")


def read(path: str, fmt: str, plan: Any, trust: bool) -> RawRead:
    import torch

    from .. import safety

    if fmt == TORCHSCRIPT:
        return _read_torchscript(path, plan, trust)
    if not trust:
        safety.ensure_safe(path, fmt)
    tags: dict[int, str] = {}
    kwargs: dict[str, Any] = {"map_location": plan.torch_map_location(tags), "weights_only": not trust}
    # torch.load routes any path ending in .safetensors to safetensors: hand it a file object then.
    by_name = not path.endswith(".safetensors")
    if fmt == TORCH_ZIP and by_name:
        kwargs["mmap"] = True
    try:
        with open(path, "rb") as f:
            source: Any = path if by_name else f
            if trust:
                obj = torch.load(source, **kwargs)
            else:
                with safety.safe_unpickling() as finish, warnings.catch_warnings():
                    # torch warns about any pickle protocol but 2 on stderr; the outcome is reported anyway
                    warnings.filterwarnings("ignore", message="Detected pickle protocol")
                    if fmt == TORCH_LEGACY and plan.is_meta:
                        # Structure only: skip reading the legacy file's tensor bytes altogether.
                        with torch.serialization.skip_data():
                            obj = torch.load(source, **kwargs)
                    else:
                        obj = torch.load(source, **kwargs)
                obj = finish(obj)
    except CkptfixError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad files; all become FormatError
        raise translate_load_error(path, fmt, e) from None
    return RawRead(obj=obj, format=fmt, tags=tags)


def translate_load_error(path: str, fmt: str, e: BaseException) -> CkptfixError:
    """torch's exception for a bad or refused file → UnsafeCheckpointError or FormatError."""
    if isinstance(e, MemoryError):
        return FormatError(f"{path}: ran out of memory reading it (a corrupt size field?)")
    if isinstance(e, pickle.UnpicklingError):
        return _unpickling_error(path, e)
    return FormatError(f"{path}: can't be read as a {fmt} checkpoint: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _unpickling_error(path: str, e: Exception, weights_only: bool = False) -> CkptfixError:
    """``weights_only``: the error came from torch's weights_only unpickler itself (a refusal)."""
    text = str(e)
    operand = _UNSUPPORTED_OPERAND.search(text)
    if operand:
        return UnsafeCheckpointError(
            f"{path}: refused: it uses a pickle opcode torch's safe loader does not read ({operand.group(0)}; "
            "saved with pickle_protocol > 2?). If you trust this file and its author, pass --trust "
            "(library: trust=True)."
        )
    names = sorted(set(_UNSUPPORTED_GLOBAL.findall(text)))
    if names:
        return UnsafeCheckpointError(
            f"{path}: refused: loading it would need globals outside the safe allow-list ({', '.join(names)}). "
            "If you trust this file and its author, pass --trust (library: trust=True); "
            "`ckptfix scan` lists everything it references.",
            names,
        )
    if weights_only or "Weights only load failed" in text:
        detail = _WEIGHTS_ONLY_DETAIL.search(text)
        return UnsafeCheckpointError(
            f"{path}: refused: torch's safe loader would not build it "
            f"({detail.group(1).strip() if detail else _first_line(e)}). "
            "If you trust this file and its author, pass --trust (library: trust=True)."
        )
    return FormatError(f"{path}: is corrupt or truncated (the pickle can't be read: {_first_line(e)})")


def _read_torchscript(path: str, plan: Any, trust: bool) -> RawRead:
    import torch

    if plan.is_meta:
        from . import torchscript

        try:
            return torchscript.read_meta(path)  # runs none of the archive's code
        except CkptfixError:
            if not trust:
                raise
    if not trust:
        raise UnsafeCheckpointError(
            f"{path}: is a TorchScript archive; loading it runs the code inside it. "
            "If you trust this file and its author, pass --trust (library: trust=True) to extract "
            "its state dict; `ckptfix inspect` lists its tensors without running anything."
        )
    dev = "cpu" if plan.user_fn is not None or plan.mapping is not None else plan.target("cpu")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.load. is deprecated", category=FutureWarning)
            module = torch.jit.load(path, map_location="cpu" if dev == "meta" else dev)
    except (RuntimeError, ValueError, OSError) as e:
        raise FormatError(f"{path}: can't be read as a TorchScript archive: {_first_line(e)}") from None
    sd = module.state_dict()
    if dev == "meta":
        sd = type(sd)((k, v.to("meta")) for k, v in sd.items())
    return RawRead(obj=sd, format=TORCHSCRIPT, notes=["state dict extracted from a TorchScript module"])


def write(obj: Any, path: str) -> list[str]:
    """``torch.save`` in the zip format, which plain ``torch.load(weights_only=True)`` reads."""
    import torch

    from ..standins import pickle_module_for

    # Through a file object: given a path, torch names the archive's root folder after the file,
    # which here is the atomic writer's temp name. Stand-ins are written under their original names.
    try:
        with open(path, "wb") as f:
            torch.save(obj, f, pickle_module=pickle_module_for(obj))
    except RuntimeError as e:
        # A failed write (disk full, Ctrl-C) makes torch's cleanup raise "unexpected pos", hiding it.
        if isinstance(e.__context__, (OSError, KeyboardInterrupt)):
            raise e.__context__ from None
        raise
    return []
