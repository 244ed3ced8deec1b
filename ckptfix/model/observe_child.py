"""The serving loader's side of ``verify --exact`` (:mod:`ckptfix.model.observe`): what runs in the child process.

A fresh interpreter runs ``python -m ckptfix.model.observe_child REQUEST OUT`` and hashes every tensor the loader
returned (:func:`digests`) for the parent to compare with its read; a forked child (:func:`forked_child`) has the
parent's read in its memory and compares each tensor with it byte for byte (:func:`compared`) instead. Either way
the model is built on meta (its initialisers skipped: no values to fill), the loader called, and the result loaded
strictly into the model; the first step that raises ends the child with its exception as the verdict.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import itertools
import json
import os
import pickle
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..parse.format_registry import get as format_of
from .spec import ModelSource, unwrap_model


def load_file_serves(spec: Any) -> bool:
    """Whether the registry says safetensors' ``load_file`` serves the format (else ``torch.load``)."""
    return (spec.exact_loader or "").startswith("safetensors.")


def meta_copy(model: Any) -> Any:
    """A module as a copy on meta (its parameters and buffers empty there: no weights copied); anything else as is."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return model
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(m, t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
    return copy.deepcopy(model, memo)


#: a forked child's verdict on a tensor whose bytes equal ckptfix's read (in place of both hashes)
SAME = "same bytes as ckptfix's read"


def digest(t: Any) -> list:
    """``[dtype, shape, stride, sha256 of its bytes]`` (``.contiguous()``, on the CPU); no hash on meta."""
    import torch

    meta = t.device.type == "meta"
    sha = None
    if not meta:
        try:
            flat = t.detach().cpu().contiguous().reshape(-1)
            sha = hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()
        except (RuntimeError, TypeError) as e:  # a layout without plain bytes (quantized, sparse): named, not hashed
            sha = f"unhashed ({type(e).__name__})"
    return [str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()), sha]


def digests(sd: Any) -> tuple[dict[str, list], dict[str, str]]:
    """Each tensor's :func:`digest`, and each other entry's type name, by key."""
    import torch

    tensors, others = {}, {}
    for k, v in (sd.items() if isinstance(sd, dict) else ()):
        if isinstance(v, torch.Tensor):
            tensors[str(k)] = digest(v)
        else:
            others[str(k)] = type(v).__name__
    return tensors, others


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (bit for bit: NaN payloads and -0.0 included);
    layouts without plain bytes (quantized, sparse) compared by their :func:`digest`."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:
        return torch.equal(*(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)))
    except (RuntimeError, TypeError):
        return digest(a)[3] == digest(b)[3]


def compared(sd: Any, read: Any, with_values: bool) -> tuple[dict[str, list], dict[str, str]]:
    """A forked child's :func:`digests` of what the loader returned, each tensor compared with ckptfix's read
    (``read``) in memory instead of hashed: its last field :data:`SAME`, or its hash where the bytes differ."""
    import torch

    tensors, others = {}, {}
    for k, v in (sd.items() if isinstance(sd, dict) else ()):
        if not isinstance(v, torch.Tensor):
            others[str(k)] = type(v).__name__
            continue
        mine = read.get(k) if hasattr(read, "get") else None
        entry = [str(v.dtype).removeprefix("torch."), list(v.shape), list(v.stride()), None]
        if with_values and v.device.type != "meta":
            entry[3] = SAME if isinstance(mine, torch.Tensor) and same_bytes(v, mine) else digest(v)[3]
        tensors[str(k)] = entry
    return tensors, others


def forked_child(request: dict[str, Any], read: Any, with_values: bool) -> dict[str, Any]:
    """The forked child's work: one torch thread (this process's own: no OpenMP team carried over the fork)."""
    import torch

    start = time.perf_counter()
    torch.set_num_threads(1)
    if request["cpu_only"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA here: a CPU box
    result = observe_child(request, lambda sd: compared(sd, read, with_values))
    result["compared"], result["seconds"] = True, time.perf_counter() - start
    return result


# --- the child --------------------------------------------------------------------------------------------------


def _error(e: BaseException) -> str:
    """``'RuntimeError: Error(s) in loading … Missing key(s) …'``: the type and the message on one line."""
    text = " ".join(str(e).split())
    why = text.partition("WeightsUnpickler error:")[2]  # torch's long advice first, the reason after it
    return f"{type(e).__name__}: " + (f"Weights only load failed: {why.strip()}" if why else text)


def _limit_memory(extra: int | None) -> None:
    """Cap the address space at what this process holds now plus ``extra`` bytes (Linux)."""
    if extra is None or not os.path.exists("/proc/self/statm"):
        return
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (now + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _load(files: list[str], fmt: str, map_location: dict[str, str] | None) -> Any:
    """The serving loader's call on each file; the union of the shards' state dicts (a single file: its object)."""
    import torch

    out: dict[str, Any] = {}
    for file in files:
        spec = format_of(format_of(fmt).shard_format or fmt)
        if load_file_serves(spec):
            from safetensors.torch import load_file

            obj = load_file(file)
        else:
            obj = torch.load(file, weights_only=True, mmap=bool(spec.zip), map_location=map_location)
        if len(files) == 1:
            return obj
        out.update(obj)
    return out


def _selected(obj: Any, key: str | None) -> Any:
    """The state dict inside what the loader returned, where ckptfix's read found it (for the digests)."""
    if key is None or not isinstance(obj, dict):
        return obj
    if key in obj:
        return obj[key]
    for part in key.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _from_pretrained(model: Any, files: list[str], fmt: str) -> tuple[Any, list[str]]:
    """transformers' own load on a directory linking the file(s) beside the model's config; what it reported."""
    inner = unwrap_model(model)
    with tempfile.TemporaryDirectory(prefix="ckptfix-pretrained-") as tmp:
        if len(files) == 1 and not format_of(fmt).index_name:
            name = "model.safetensors" if load_file_serves(format_of(fmt)) else "pytorch_model.bin"
            os.symlink(os.path.abspath(files[0]), os.path.join(tmp, name))
        else:
            here = os.path.dirname(os.path.abspath(files[0]))
            for member in [str(format_of(fmt).index_name), *map(os.path.basename, files)]:
                os.symlink(os.path.join(here, member), os.path.join(tmp, member))
        inner.config.save_pretrained(tmp)
        if getattr(inner, "generation_config", None) is not None:
            inner.generation_config.save_pretrained(tmp)
        loaded, info = type(inner).from_pretrained(tmp, config=inner.config, output_loading_info=True)
    uses: dict[int, int] = {}
    for _name, p in loaded.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    tied = {k for k, v in loaded.state_dict(keep_vars=True).items() if uses.get(id(v), 0) > 1}
    problems = [f"{what}: {', '.join(sorted(map(str, info[key])))}" for what, key in (
        ("missing", "missing_keys"), ("unexpected", "unexpected_keys"), ("shape mismatch", "mismatched_keys"))
        if key == "missing_keys" and set(info[key]) - tied or key != "missing_keys" and info[key]]
    return loaded.state_dict(), problems + [str(m) for m in info.get("error_msgs", [])]


def observe_child(request: dict[str, Any], describe: Callable[[Any], tuple[dict, dict]] = digests) -> dict[str, Any]:
    """The child's work: build, load, describe (:func:`digests`, or a forked child's :func:`compared`), load
    strictly; the first step that raises ends it."""
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import torch

    result: dict[str, Any] = {"ok": False, "stage": "build", "error": None, "digests": {}, "others": {}, "versions": {
        "torch": torch.__version__, "transformers": _version("transformers"), "safetensors": _version("safetensors")}}
    try:
        if request["model"] is not None:
            with _no_init():
                model = ModelSource(meta_copy(request["model"]), request["model_args"], request["dtype"]).fresh(meta=True)
        else:
            model = None
        _limit_memory(request["memory_limit"])
        result["stage"] = "load"
        files, fmt = request["files"], request["format"]
        if request["loader"] == "transformers":
            sd, problems = _from_pretrained(model, files, fmt)
            result["digests"], result["others"] = describe(sd)
            result["stage"] = "strict"
            if problems:
                raise RuntimeError("from_pretrained reported " + "; ".join(problems))
        else:
            obj = _load(files, fmt, request["map_location"])
            result["digests"], result["others"] = describe(_selected(obj, request["select_key"]))
            result["stage"] = "strict"
            if model is not None:
                model.load_state_dict(obj, strict=True)
    except (Exception, MemoryError) as e:  # the loader's exception, named, is the verdict
        result["error"] = _error(e)
        return result
    result["ok"], result["stage"] = True, None
    return result


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s fills as no-ops while the child builds its model on meta, where there are no values to
    fill (transformers' ``no_init_weights`` does the same): a first random fill on meta imports torch's
    decompositions, a second of the child's time for nothing. The child's own process only."""
    from torch.nn import init

    saved = {name: fn for name, fn in vars(init).items() if name.endswith("_") and not name.startswith("_")
             and callable(fn)}
    for name in saved:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def main(argv: list[str]) -> int:
    """``python -m ckptfix.model.observe REQUEST OUT``: the request (pickled by the parent) → OUT (JSON)."""
    with open(argv[0], "rb") as f:
        request = pickle.load(f)  # written by the parent verify process, not read from the checkpoint
    result = observe_child(request)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
