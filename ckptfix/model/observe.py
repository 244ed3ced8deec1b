"""``verify --exact`` observes the serving loader: the real call, on the file as saved, in a child process.

ckptfix's own reader decides what a file *is*; whether the server *takes* it is what the server's loader does. A
child process (:mod:`ckptfix.model.observe_child`) builds the model the way verify does (the spec the user named:
its code runs, as it does in verify; on meta) and then makes the serving call:

- ``--serving-loader torch`` (default): ``sd = torch.load(PATH, weights_only=True[, mmap=True])`` (``mmap`` for a
  zip file only, where torch allows it; no ``map_location``: each storage goes back where it was saved, and with
  ``--serving-device cpu`` the child sees no GPU, as a CPU box), or ``safetensors.torch.load_file(PATH)``; a
  sharded directory shard by shard (the same call per shard), the union loaded as one; then
  ``model.load_state_dict(sd, strict=True)``.
- ``--serving-loader transformers``: ``type(model).from_pretrained(DIR, config=model.config,
  output_loading_info=True)`` on a directory that links the file (``model.safetensors``/``pytorch_model.bin``) beside
  the model's config; every missing, unexpected or mismatched key it reports is a failure, except those it ties.

The checkpoint is never unpickled beyond ``weights_only=True`` there. Where it is safe (:func:`start`: Linux, no
other thread, the torch loader, a local file), the child is forked as soon as the static scan and ckptfix's read
have passed, and runs beside the gate's own work: it inherits torch imported and the read, and compares each
tensor it loaded with the read byte for byte. Elsewhere (:func:`observe`) a fresh interpreter runs
``python -m ckptfix.model.observe_child REQUEST OUT`` at the check, and sends back per tensor its dtype, shape,
stride and the SHA-256 of its bytes, which the parent compares with its own read's. Either way the child reports
what raised (its type and message) and the torch and transformers versions. A crash, a timeout or a runaway
allocation ends the child, not the gate: its address space is capped (``RLIMIT_AS``, Linux) at what it held after
building the model plus twice the checkpoint's size plus :data:`HEADROOM` — unless the load may touch a GPU, whose
driver reserves far more address space than it uses — and it runs at most :func:`timeout_for` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

from ..core import forked, locations
from ..core.devices import available_devices
from ..core.units import shown
from ..errors import NeedsLocalCopy
from ..formats.sharded import load_index
from ..parse.format_registry import get as format_of
from . import observe_child, serving

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
    #: the child compared each tensor with ckptfix's read itself (a forked child): ``digests`` hold no hashes, and
    #: their last field is :data:`SAME` where the bytes are ckptfix's
    compared: bool = False
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
    load = ("safetensors.torch.load_file(PATH)" if observe_child.load_file_serves(spec) else
            f"torch.load(PATH, weights_only=True{', mmap=True' if spec.zip else ''})")
    return load + " + load_state_dict(strict=True)"


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
    """The model as a spawned child gets it: a spec as is, a module as a copy on meta (no weights), a factory by
    reference; ``(None, why)`` when it can't be pickled (a class defined inside a function)."""
    model = observe_child.meta_copy(model)
    try:
        pickle.dumps(model)
    except Exception as e:  # whatever the user's object holds that pickle refuses
        return None, f"{type(e).__name__}: {e}"
    return model, None


def _request(path: str, fmt: str, model: Any, options: Any, devices: dict[str, int],
             select_key: str | None) -> tuple[Observation, dict[str, Any]]:
    """The observation to fill and what the child needs: the files, the call's arguments, its limits."""
    loader, device = options.serving_loader, options.serving_device
    obs = Observation(serving_call(fmt, loader, device))
    files = shards(path, fmt)
    size = sum(os.path.getsize(f) for f in files)
    gpu = device != "cpu" and any(not str(tag).lower().startswith(("cpu", "meta")) for tag in devices)
    stand_in = stand_in_location(devices, device)
    if stand_in:
        obs.call += f" (here map_location={stand_in}: the serving device {device} is not on this machine)"
    request = {"files": files, "format": fmt, "loader": loader, "model": model, "model_args": options.model_args,
               "map_location": stand_in, "cpu_only": device == "cpu",
               "dtype": options.dtype, "select_key": select_key, "sys_path": sys.path, "timeout": timeout_for(size),
               "memory_limit": None if gpu else 2 * size + HEADROOM}
    return obs, request


def observe(path: str, fmt: str, model: Any, options: Any, devices: dict[str, int], select_key: str | None) -> Observation:
    """Run the serving call on ``path`` in a fresh child process and read what it did (see the module docstring)."""
    obs, request = _request(path, fmt, None, options, devices, select_key)
    request["model"], why = sendable_model(model)
    if request["model"] is None:
        obs.notes.append(f"the model object can't be sent to the serving loader's process ({shown(why)}): its strict "
                         "load is not observed; pass a model spec or a module-level factory")
    with tempfile.TemporaryDirectory(prefix="ckptfix-observe-") as tmp:
        req, out = os.path.join(tmp, "request.pkl"), os.path.join(tmp, "observed.json")
        with open(req, "wb") as request_file:
            pickle.dump(request, request_file)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        if request["cpu_only"]:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU box: the loader sees no GPU
        start = time.perf_counter()
        done = _run(child_command(req, out), env, request["timeout"])
        obs.seconds = time.perf_counter() - start
        if done is not None:
            obs.stage, obs.error = "process", done
            return obs
        with open(out, encoding="utf-8") as f:
            return _filled(obs, json.load(f))


def _filled(obs: Observation, result: dict[str, Any]) -> Observation:
    obs.ok, obs.stage, obs.error = result["ok"], result["stage"], result["error"]
    obs.digests, obs.others, obs.versions = result["digests"], result["others"], result["versions"]
    obs.compared = result.get("compared", False)
    return obs


class Forked:
    """The serving call observed in a forked child, started as soon as the file's static scan and ckptfix's read
    have passed (:func:`start`); :meth:`result` waits for it, :meth:`close` ends it if the gate stops first."""

    def __init__(self, obs: Observation, child: forked.Child, timeout: float):
        self.obs, self.child, self.timeout = obs, child, timeout

    def result(self) -> Observation:
        result, why = self.child.wait(self.timeout, "the loader's process")
        if result is None:
            self.obs.stage, self.obs.error = "process", why
            return self.obs
        self.obs.seconds = result.pop("seconds", 0.0)
        return _filled(self.obs, result)

    def close(self) -> None:
        self.child.close()


def start(path: str, fmt: str, model: Any, options: Any, devices: dict[str, int], select_key: str | None,
          read: Any, with_values: bool) -> Forked | None:
    """The serving call in a forked child, now, beside the gate's own work: the child inherits torch imported and
    ckptfix's read (``read``: the state dict as the plain loader returns it), so it compares each tensor with it
    byte for byte instead of hashing both. None where forking is unsafe (:func:`ckptfix.core.forked.can_fork`; the
    GPU already in use here) or the loader is transformers': :func:`observe` then runs it in a fresh process."""
    import torch

    if options.serving_loader != "torch" or not forked.can_fork() or torch.cuda.is_initialized():
        return None
    obs, request = _request(path, fmt, model, options, devices, select_key)
    child = forked.start(lambda: observe_child.forked_child(request, read, with_values))
    return Forked(obs, child, request["timeout"])


def stand_in_location(devices: dict[str, int], serving_device: str | None) -> dict[str, str] | None:
    """Where ``--serving-device`` names a GPU this machine lacks: its storages mapped onto the CPU here (the
    serving box has it; every other saved device still fails as it would there); None otherwise."""
    want = None if serving_device is None else serving.device_of(serving_device)
    if want in (None, "cpu", "meta") or want in available_devices():
        return None
    return {tag: "cpu" for tag in devices if serving.device_of(tag) == want} or None


def child_command(request: str, out: str) -> list[str]:
    """The child's command line: this interpreter, this module."""
    return [sys.executable, "-m", "ckptfix.model.observe_child", request, out]


def _run(command: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run the child; None when it wrote its answer, else why it didn't (a signal, an exit status, the timeout)."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"the loader's process ran past its {timeout:.0f} s limit and was killed"
    return None if done.returncode == 0 else forked.exit_reason("the loader's process", done.returncode, done.stderr)


def read_differs(obs: Observation, read: Any, with_values: bool) -> list[str]:
    """Where ckptfix's read (``read``: the state dict as the plain loader returns it) and what the loader returned
    part: keys only one has, tensors whose dtype, shape, stride or bytes differ (bytes only ``with_values``).
    transformers returns the model's own state dict: only the keys both hold are compared there."""
    if obs.compared:  # a forked child compared the bytes: only the layout is read here, nothing hashed
        mine, my_others = observe_child.compared(read, {}, False)
        for entry in mine.values():
            entry[3] = observe_child.SAME if with_values else None
    else:
        mine, my_others = observe_child.digests(read)
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
