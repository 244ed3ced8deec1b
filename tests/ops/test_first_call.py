"""A server's first ``load_into`` (issue 29): after the warm-up — resolving the verb, ``from ckptfix import load_into``
(or ``ckptfix.load_into``), which imports everything a call needs — the first call in a fresh process imports nothing,
and nothing heavy is imported at all; a small load starts no thread. Bounds that hold on any machine: counts of
modules and threads, not wall-clock times (bench/load.py's ``first-call`` mode measures those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from torch import nn

import ckptfix
from ckptfix.core import tensorcopy

ROOT = Path(__file__).resolve().parents[2]
#: modules a load has no use for, each costing a first call hundreds of milliseconds if something imported them
HEAVY = ["torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo",
         "numpy.testing", "concurrent.futures.process", "transformers"]

MODEL = """
import torch
from torch import nn

def gpt() -> nn.Module:
    '''GPT-2's kinds of tensors and names, small: embeddings, blocks of LayerNorms and Linears, a final LayerNorm.'''
    block = lambda: nn.ModuleDict({"ln_1": nn.LayerNorm(8), "attn": nn.Linear(8, 24), "proj": nn.Linear(8, 8),
                                   "ln_2": nn.LayerNorm(8), "fc": nn.Linear(8, 32), "out": nn.Linear(32, 8)})
    return nn.ModuleDict({"wte": nn.Embedding(50, 8), "wpe": nn.Embedding(16, 8),
                          "h": nn.ModuleList(block() for _ in range(3)), "ln_f": nn.LayerNorm(8)})
"""
CHILD = MODEL + """
import json, sys
from ckptfix import load_into  # the warm-up

heavy, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert not [m for m in heavy if m in sys.modules], "imported before the first call"
imported, late = {}, []
for built in ("cpu", "meta"):  # (building on meta imports torch._dynamo and torch.distributed.tensor: torch's doing)
    late = late or [m for m in heavy if m in sys.modules]
    for name, path in files.items():
        if built == "meta":
            with torch.device("meta"):
                model = gpt()
        else:
            model = gpt()
        before = set(sys.modules)
        report = load_into(model, path)
        imported[f"{name} {built}"] = sorted(set(sys.modules) - before)
        want = json.loads(sys.argv[3])
        assert report.matched == want and not any(t.is_meta for t in model.state_dict().values()), (name, built)
print(json.dumps({"imported": imported, "heavy": late}))
"""


def _gpt() -> nn.Module:
    scope: dict[str, object] = {}
    exec(MODEL, scope)
    return scope["gpt"]()  # type: ignore[operator,no-any-return]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The small GPT's values as a safetensors file and a torch zip."""
    folder = tmp_path_factory.mktemp("first-call")
    state_dict = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))) for k, v in
                  _gpt().state_dict().items()}
    st.save_file(state_dict, folder / "model.safetensors")
    torch.save(state_dict, folder / "model.pth")
    return {"safetensors": str(folder / "model.safetensors"), "pth": str(folder / "model.pth")}


def test_the_first_call_after_the_warm_up_imports_nothing(files: dict[str, str]) -> None:
    """In a fresh process, after ``from ckptfix import load_into``: the first load of each format into a built and a
    meta-built model imports no module, and none of the heavy ones is imported by the warm-up or the loads into
    built models."""
    keys = len(_gpt().state_dict())
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(HEAVY), json.dumps(files), json.dumps(keys)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert set(result["imported"]) == {"safetensors cpu", "safetensors meta", "pth cpu", "pth meta"}
    assert result["imported"] == {case: [] for case in result["imported"]}
    assert result["heavy"] == []


@pytest.mark.parametrize("built", ["cpu", "meta"])
@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
def test_a_small_load_starts_no_thread(files: dict[str, str], monkeypatch: pytest.MonkeyPatch, fmt: str,
                                       built: str) -> None:
    """Below :data:`tensorcopy.THREAD_BYTES` of reads and checks the load runs on the caller's thread: a thread's
    start costs more than it would read (on a busy machine, a wait for a core)."""
    started: list[threading.Thread] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self), start(self))[1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # (what a machine with cores to spare would allow)
    if built == "meta":
        with torch.device("meta"):
            model = _gpt()
    else:
        model = _gpt()
    ckptfix.load_into(model, files[fmt])
    assert started == []
    assert all(torch.equal(v, st.load_file(files["safetensors"])[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("nbytes", "threads", "want"), [
    (0, 4, 1), (tensorcopy.THREAD_BYTES - 1, 4, 1), (tensorcopy.THREAD_BYTES * 2, 4, 2),
    (tensorcopy.THREAD_BYTES * 100, 4, 4), (tensorcopy.THREAD_BYTES * 100, 1, 1),
    (tensorcopy.THREAD_BYTES * 100, 64, tensorcopy.MAX_READERS)])
def test_threads_follow_the_bytes(monkeypatch: pytest.MonkeyPatch, nbytes: int, threads: int, want: int) -> None:
    """One thread per THREAD_BYTES of work, at most torch's thread count and MAX_READERS."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert tensorcopy.workers_for(nbytes) == want
