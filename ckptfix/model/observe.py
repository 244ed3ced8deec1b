"""``verify --exact`` observes the serving loader: the real call, on the file as saved, in a child process.

ckptfix's own reader decides what a file *is*; whether the server *takes* it is what the server's loader does. The
parent (:func:`observe`) hands a request to ``python -m ckptfix.model.observe REQUEST OUT``, which builds the model
the way verify does (the spec the user named: its code runs, as it does in verify) and then makes the serving call:

- ``--serving-loader torch`` (default): ``sd = torch.load(PATH, weights_only=True[, mmap=True])`` (``mmap`` for a
  zip file only, where torch allows it; no ``map_location``: each storage goes back where it was saved, and with
  ``--serving-device cpu`` the child sees no GPU, as a CPU box), or ``safetensors.torch.load_file(PATH)``; a
  sharded directory shard by shard (the same call per shard), the union loaded as one; then
  ``model.load_state_dict(sd, strict=True)``.
- ``--serving-loader transformers``: ``type(model).from_pretrained(DIR, config=model.config,
  output_loading_info=True)`` on a directory that links the file (``model.safetensors``/``pytorch_model.bin``) beside
  the model's config; every missing, unexpected or mismatched key it reports is a failure, except those it ties.

The checkpoint is never unpickled beyond ``weights_only=True`` there. The child writes JSON: what raised (its type
and message), the torch and transformers versions, and per tensor its dtype, shape, stride and the SHA-256 of its
bytes (``.contiguous()``), which the parent compares with ckptfix's read (:func:`digest`). A crash, a timeout or a
runaway allocation ends the child, not the gate: its address space is capped (``RLIMIT_AS``, Linux) at what it held
after building the model plus twice the checkpoint's size plus :data:`HEADROOM` — unless the load may touch a GPU,
whose driver reserves far more address space than it uses — and it runs at most :func:`timeout_for` seconds.
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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

from ..core import locations
from ..core.devices import available_devices
from ..core.units import shown
from ..errors import NeedsLocalCopy
from ..formats.sharded import load_index
from ..parse.format_registry import get as format_of
from . import serving
from .spec import ModelSource, unwrap_model

#: the address space the child may take beyond what it holds after building the model and twice the file's size
HEADROOM = 1 << 30
#: the child's time limit: a base, plus this many seconds per GiB of checkpoint
TIMEOUT_BASE_S, TIMEOUT_PER_GIB_S = 300, 30
LOADERS = ("torch", "transformers")


@dataclass
class Observation:
    """What the serving loader did with the file (the child's JSON), and what it cost."""

    call: str  #: the serving call, as the docs write it
    ok: bool = False
    stage: str | None = None  #: where it stopped: build, load, strict, process (a crash or a timeout)
    error: str | None = None  #: ``"RuntimeError: Error(s) in loading state_dict …"``
    digests: dict[str, list] = field(default_factory=dict)  #: key → [dtype, shape, stride, sha256]
    others: dict[str, str] = field(default_factory=dict)  #: non-tensor key → type name
    versions: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0  #: the child's wall time, start to exit (the observation's cost)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The report's ``observed`` field (digests left out: one line per tensor)."""
        return {"call": self.call, "ok": self.ok, "stage": self.stage, "error": self.error,
                "seconds": round(self.seconds, 3), **self.versions}


def timeout_for(size: int) -> float:
    """Seconds the child may run: :data:`TIMEOUT_BASE_S` plus :data:`TIMEOUT_PER_GIB_S` per GiB of checkpoint."""
    return TIMEOUT_BASE_S + TIMEOUT_PER_GIB_S * size / (1 << 30)


def serving_call(fmt: str, loader: str, serving_device: str | None) -> str:
    """The call the server makes, as the report and the docs name it."""
    if loader == "transformers":
        return "type(model).from_pretrained(DIR, config=model.config, output_loading_info=True)"
    spec = format_of(fmt)
    if spec.index_name:
        one = serving_call(spec.shard_format or fmt, loader, serving_device)
        return f"each shard: {one.split(' + ')[0]}; the union + load_state_dict(strict=True)"
    load = ("safetensors.torch.load_file(PATH)" if _load_file(spec) else
            f"torch.load(PATH, weights_only=True{', mmap=True' if spec.zip else ''})")
    return load + " + load_state_dict(strict=True)"


def _load_file(spec: Any) -> bool:
    """Whether the registry says safetensors' ``load_file`` serves the format (else ``torch.load``)."""
    return (spec.exact_loader or "").startswith("safetensors.")


#: bytes of a URL fetched per window into the local copy the loader is observed on
FETCH_WINDOW = 64 << 20


@contextlib.contextmanager
def local_copy(path: str, fmt: str) -> Iterator[str]:
    """What the serving loader is observed on: a local path as it is; a URL's file fetched once (ranged, each
    fetch checked against the source's validator) into a private temp directory, deleted after — the static
    scan runs on those bytes, and the loader's tensors are compared with ckptfix's read of the URL, so a file
    changed between the two reads is a finding. A sharded directory at a URL needs a local copy."""
    if not locations.is_remote(path):
        yield path
        return
    if format_of(fmt).index_name:
        raise NeedsLocalCopy(path, "observing the serving loader on a sharded directory (verify --exact)",
                             "it fetches one file; download the directory, or verify each shard's file")
    with locations.session(), tempfile.TemporaryDirectory(prefix="ckptfix-observe-") as tmp:  # mode 0700
        source = locations.open_source(path)
        local = os.path.join(tmp, os.path.basename(path.rstrip("/")) or "checkpoint")
        with open(local, "wb") as f:
            for offset in range(0, source.size, FETCH_WINDOW):
                buf = bytearray(min(FETCH_WINDOW, source.size - offset))
                source.read_into(offset, memoryview(buf))
                f.write(buf)
        yield local


def shards(path: str, fmt: str) -> list[str]:
    """The files the serving loader reads: the file itself, or a sharded checkpoint's shards in the index's order."""
    spec = format_of(fmt)
    if not spec.index_name:
        return [path]
    index = path if os.path.isfile(path) else os.path.join(path, spec.index_name)
    return [os.path.join(os.path.dirname(index), s) for s in dict.fromkeys(load_index(index).values())]


def sendable_model(model: Any) -> tuple[Any, str | None]:
    """The model as the child gets it: a spec as is, a module as a copy on meta (no weights), a factory by
    reference; ``(None, why)`` when it can't be pickled (a class defined inside a function)."""
    import torch

    if isinstance(model, torch.nn.Module):
        memo: dict[int, Any] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            m = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(m, t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
        model = copy.deepcopy(model, memo)
    try:
        pickle.dumps(model)
    except Exception as e:  # whatever the user's object holds that pickle refuses
        return None, f"{type(e).__name__}: {e}"
    return model, None


def observe(path: str, fmt: str, model: Any, options: Any, devices: dict[str, int], select_key: str | None) -> Observation:
    """Run the serving call on ``path`` in a child process and read what it did (see the module docstring)."""
    loader, device = options.serving_loader, options.serving_device
    obs = Observation(serving_call(fmt, loader, device))
    sent, why = sendable_model(model)
    if sent is None:
        obs.notes.append(f"the model object can't be sent to the serving loader's process ({shown(why)}): its strict "
                         "load is not observed; pass a model spec or a module-level factory")
    files = shards(path, fmt)
    size = sum(os.path.getsize(f) for f in files)
    gpu = device != "cpu" and any(not str(tag).lower().startswith(("cpu", "meta")) for tag in devices)
    stand_in = stand_in_location(devices, device)
    if stand_in:
        obs.call += f" (here map_location={stand_in}: the serving device {device} is not on this machine)"
    request = {"files": files, "format": fmt, "loader": loader, "model": sent, "model_args": options.model_args,
               "map_location": stand_in,
               "dtype": options.dtype, "select_key": select_key, "sys_path": sys.path,
               "memory_limit": None if gpu else 2 * size + HEADROOM}
    with tempfile.TemporaryDirectory(prefix="ckptfix-observe-") as tmp:
        req, out = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "observed.json")
        with open(req, "wb") as request_file:
            pickle.dump(request, request_file)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU box: the loader sees no GPU
        start = time.perf_counter()
        done = _run(child_command(req, out), env, timeout_for(size))
        obs.seconds = time.perf_counter() - start
        if done is not None:
            obs.stage, obs.error = "process", done
            return obs
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    obs.ok, obs.stage, obs.error = result["ok"], result["stage"], result["error"]
    obs.digests, obs.others, obs.versions = result["digests"], result["others"], result["versions"]
    return obs


def stand_in_location(devices: dict[str, int], serving_device: str | None) -> dict[str, str] | None:
    """Where ``--serving-device`` names a GPU this machine lacks: its storages mapped onto the CPU here (the
    serving box has it; every other saved device still fails as it would there); None otherwise."""
    want = None if serving_device is None else serving.device_of(serving_device)
    if want in (None, "cpu", "meta") or want in available_devices():
        return None
    return {tag: "cpu" for tag in devices if serving.device_of(tag) == want} or None


def child_command(request: str, out: str) -> list[str]:
    """The child's command line: this interpreter, this module."""
    return [sys.executable, "-m", "ckptfix.model.observe", request, out]


def _run(command: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run the child; None when it wrote its answer, else why it didn't (a signal, an exit status, the timeout)."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"the loader's process ran past its {timeout:.0f} s limit and was killed"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or [""])[-1]
    how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
           else f"exited with status {done.returncode}")
    return f"the loader's process {how}" + (f" ({shown(last)})" if last else "")


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


def read_differs(obs: Observation, read: Any, with_values: bool) -> list[str]:
    """Where ckptfix's read (``read``: the state dict as the plain loader returns it) and what the loader returned
    part: keys only one has, tensors whose dtype, shape, stride or bytes differ (bytes only ``with_values``).
    transformers returns the model's own state dict: only the keys both hold are compared there."""
    mine, my_others = digests(read)
    theirs, their_others = obs.digests, obs.others
    both = [k for k in theirs if k in mine]
    upto = 4 if with_values else 3
    out = [f"{len(keys)} {what}: {', '.join(shown(k) for k in keys[:3])}{' …' if len(keys) > 3 else ''}" for what, keys in (
        ("tensor(s) differ", [k for k in both if mine[k][:upto] != theirs[k][:upto]]),
        ("key(s) only the loader returns", [] if obs.call.startswith("type(model)") else
         [k for k in [*theirs, *their_others] if k not in mine and k not in my_others]),
        ("key(s) only ckptfix's read has", [] if obs.call.startswith("type(model)") else
         [k for k in [*mine, *my_others] if k not in theirs and k not in their_others])) if keys]
    return out


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
        if _load_file(spec):
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
            name = "model.safetensors" if _load_file(format_of(fmt)) else "pytorch_model.bin"
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


def _observe_child(request: dict[str, Any]) -> dict[str, Any]:
    """The child's work: build, load, digest, load strictly; the first step that raises ends it."""
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    import torch

    result: dict[str, Any] = {"ok": False, "stage": "build", "error": None, "digests": {}, "others": {}, "versions": {
        "torch": torch.__version__, "transformers": _version("transformers"), "safetensors": _version("safetensors")}}
    try:
        model = None if request["model"] is None else \
            ModelSource(request["model"], request["model_args"], request["dtype"]).fresh(meta=True)
        _limit_memory(request["memory_limit"])
        result["stage"] = "load"
        files, fmt = request["files"], request["format"]
        if request["loader"] == "transformers":
            sd, problems = _from_pretrained(model, files, fmt)
            result["digests"], result["others"] = digests(sd)
            result["stage"] = "strict"
            if problems:
                raise RuntimeError("from_pretrained reported " + "; ".join(problems))
        else:
            obj = _load(files, fmt, request["map_location"])
            result["digests"], result["others"] = digests(_selected(obj, request["select_key"]))
            result["stage"] = "strict"
            if model is not None:
                model.load_state_dict(obj, strict=True)
    except (Exception, MemoryError) as e:  # the loader's exception, named, is the verdict
        result["error"] = _error(e)
        return result
    result["ok"], result["stage"] = True, None
    return result


def _version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def main(argv: list[str]) -> int:
    """``python -m ckptfix.model.observe REQUEST OUT``: the request (pickled by the parent) → OUT (JSON)."""
    with open(argv[0], "rb") as f:
        request = pickle.load(f)  # written by the parent verify process, not read from the checkpoint
    result = _observe_child(request)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
