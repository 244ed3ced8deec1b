"""load_into stays all or nothing when the file is truncated while it is read (issue 27 item 2), or a signal comes
(SIGINT, SIGTERM: see the end of this module). Two ways for a truncation: a read
lease on the file (another process's truncation waits until the load is done: the model holds the file's values),
or, where no lease can be had, the undo log (a read that comes up short is a FormatError, and every parameter and
buffer is bit-identical to before the call — the direct reads, the casts and torch's own loads (BatchNorm) alike).
The hook tests truncate from this process, which would wait on its own lease: they run without one. A meta-built
model holds views of the mapped file: truncating it later is SIGBUS, as with ``torch.load(mmap=True)``."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from torch import nn

import ckptfix
from ckptfix.core import filefill, rollback, tensorcopy
from ckptfix.errors import FormatError, Interrupted
from ckptfix.ops.load_into import commit


class Net(nn.Module):
    """Direct reads (the Linears), torch's own load (BatchNorm: its own ``_load_from_state_dict``), an int buffer."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, 64)
        self.register_buffer("steps", torch.arange(5))


def _save(tmp_path: Path, fmt: str, sd: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / f"m.{fmt}"
    st.save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    return path


def _other_values(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A state dict for ``model`` whose every value differs from the model's (a load that happened shows)."""
    return {k: (v.float() + 1 + torch.rand(v.shape)).to(dtype if v.is_floating_point() else v.dtype)
            for k, v in model.state_dict().items()}


def _snapshot(model: nn.Module) -> dict[str, tuple[int, torch.Tensor | None]]:
    """Each parameter and buffer: its object's id and a copy of its bytes (None on meta)."""
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        raw = None if v.is_meta else v.detach().clone().contiguous().view(-1).view(torch.uint8)
        out[k] = (id(v), raw)
    return out


def _assert_as_before(model: nn.Module, before: dict[str, tuple[int, torch.Tensor | None]]) -> None:
    objects = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    assert objects == {k: ident for k, (ident, _raw) in before.items()}, "another object (first: a view of the file)"
    after = _snapshot(model)
    for k, (_ident, raw) in before.items():
        got = after[k][1]
        assert (got is None) == (raw is None) and (raw is None or torch.equal(got, raw)), f"{k}: changed"


@pytest.fixture
def no_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leases unavailable (as on a filesystem without them): the load keeps the undo log."""
    monkeypatch.setattr(rollback, "SETLEASE", None)


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Every ``rollback.<name>`` the load makes, kept (the class itself unchanged)."""
    made: list[Any] = []
    real = getattr(rollback, name)

    def make(*args: Any) -> Any:
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(rollback, name, make)
    return made


def _truncate_after(monkeypatch: pytest.MonkeyPatch, path: Path, reads: int, size: int,
                    cut: Any = None) -> dict[str, int]:
    """Another writer's truncation, timed by a hook: once the commit's reads start, the file is cut to ``size``
    bytes (or by ``cut()``) just before its read number ``reads + 1`` (0: before the first); later reads of it come
    up short."""
    real = os.preadv
    lock = threading.Lock()
    state = {"armed": 0, "reads": 0, "cut": 0}

    def preadv(fd: int, buffers: Any, offset: int, *flags: Any) -> int:
        later = None
        with lock:
            if state["armed"] and os.readlink(f"/proc/self/fd/{fd}") == str(path):
                if state["reads"] == reads and not state["cut"]:
                    state["cut"] = 1  # (first: a signal's exception may come out of cut())
                    if getattr(cut, "unlocked", False):
                        later = cut
                    else:
                        cut() if cut else os.truncate(path, size)
                state["reads"] += 1
        if later is not None:  # (a signal's hook waits for the main thread, which may be waiting for this lock)
            later()
        return real(fd, buffers, offset, *flags)

    def armed(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            state["armed"] = 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(filefill, "fill_from_file", armed(filefill.fill_from_file))
    monkeypatch.setattr(filefill, "fill_staged", armed(filefill.fill_staged))
    return state


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("kind", ["as_stored", "cast", "bf16_file", "bn_on_meta"])
@pytest.mark.parametrize("reads", [0, 3, 12])
@pytest.mark.usefixtures("no_lease")
def test_truncated_mid_load_leaves_the_model_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                                       kind: str, reads: int) -> None:
    """Cut after 0, 3 or 12 chunk reads (4 KiB chunks, the casts' windows too): FormatError, no "partly loaded", every
    tensor as before — the direct reads (file dtype), the casts (fp32 file, fp64 model; bf16 file, fp32 model),
    BatchNorm's load through torch (in place, or assigned where its module is on meta: the objects put back)."""
    monkeypatch.setattr(tensorcopy, "READ_BYTES", 4096)
    monkeypatch.setattr(tensorcopy, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(filefill, "JOB_BYTES", 4096)
    model = Net()
    if kind == "cast":
        model = model.double()
    if kind == "bn_on_meta":
        model.bn.to("meta")
    path = _save(tmp_path, fmt, _other_values(Net(), torch.bfloat16 if kind == "bf16_file" else torch.float32))
    before = _snapshot(model)
    state = _truncate_after(monkeypatch, path, reads, os.path.getsize(path) // 2)
    with pytest.raises(FormatError) as info:
        ckptfix.load_into(model, path)
    assert state["cut"], "the hook never ran"
    message = str(info.value)
    assert "truncated while it was read; nothing was loaded" in message and "partly" not in message
    _assert_as_before(model, before)


def test_the_log_of_replaced_bytes_puts_back_any_layout(tmp_path: Path) -> None:
    """rollback.Undo: contiguous bytes, a strided tensor and a replaced attribute all back as they were."""
    module = nn.Linear(8, 6)
    strided = torch.randn(6, 8).t()
    raw = torch.arange(100, dtype=torch.uint8)
    old = (module.weight, strided.clone(), raw.clone())
    undo = rollback.Undo()
    undo.save(raw.numpy()[10:60])
    undo.save_tensor(strided)
    undo.keep(module, "weight")
    raw.zero_()
    strided.fill_(7)
    module.weight = nn.Parameter(torch.zeros(6, 8))
    undo.restore()
    undo.close()
    assert module.weight is old[0] and torch.equal(strided, old[1])
    assert torch.equal(raw[10:60], old[2][10:60]) and not raw[:10].any() and not raw[60:].any()


_TRUNCATOR = "import os, sys; sys.stdin.readline(); os.truncate(sys.argv[1], int(sys.argv[2])); print('cut', flush=True)"


@pytest.mark.usefixtures("no_lease")
def test_a_real_concurrent_truncation_without_a_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process truncates a 16 MiB file after the commit's 5th read of it (the reads wait until it has: not
    timed, so not flaky on a busy machine): FormatError, the model as it was."""
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    path = _save(tmp_path, "safetensors", _other_values(model, torch.float32))
    before, size = _snapshot(model), os.path.getsize(path)
    child = subprocess.Popen([sys.executable, "-c", _TRUNCATOR, str(path), str(size // 4)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def cut() -> None:
        child.stdin.write("go\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.stdout.readline() == "cut\n"  # type: ignore[union-attr]

    state = _truncate_after(monkeypatch, path, 5, 0, cut)
    try:
        with pytest.raises(FormatError, match="truncated while it was read; nothing was loaded"):
            ckptfix.load_into(model, path)
    finally:
        child.communicate(timeout=60)
    assert state["cut"] and os.path.getsize(path) == size // 4
    _assert_as_before(model, before)


_WAITER = ("import os, sys, time; sys.stdin.readline(); os.truncate(sys.argv[1], int(sys.argv[2])); "
           "print(time.monotonic(), flush=True)")


def test_a_truncation_by_another_process_waits_for_the_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the file leased, another process's truncate during the commit waits (the lease shows its break pending)
    until the load is done: the load succeeds with the file's values, the truncation lands after the release."""
    model = Net()
    path = _save(tmp_path, "safetensors", _other_values(model, torch.float32))
    want = {k: v.clone() for k, v in st.load_file(path).items()}  # (not views of the file this test truncates)
    size = os.path.getsize(path)
    released: list[float] = []
    real_release = rollback.Leases.release

    def release(self: rollback.Leases) -> None:
        released.append(time.monotonic())
        real_release(self)

    monkeypatch.setattr(rollback.Leases, "release", release)
    leases = _spy(monkeypatch, "Leases")
    child = subprocess.Popen([sys.executable, "-c", _WAITER, str(path), str(size // 4)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    fill = filefill.fill_from_file

    def go(*args: Any, **kwargs: Any) -> Any:
        assert leases[-1].held and leases[-1].intact()
        child.stdin.write("go\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        for _ in range(600):  # the child blocked in truncate(2): the kernel breaks the lease, then waits for us
            if not leases[-1].intact():
                break
            time.sleep(0.05)
        assert not leases[-1].intact(), "the truncation never reached the lease"
        out = fill(*args, **kwargs)
        assert os.path.getsize(path) == size
        return out

    monkeypatch.setattr(filefill, "fill_from_file", go)
    try:
        ckptfix.load_into(model, path)
    finally:
        cut_at = float(child.communicate(timeout=60)[0])
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []
    assert os.path.getsize(path) == size // 4 and cut_at >= released[-1]


def test_the_leased_load_keeps_no_undo_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every file leased the commit reads at full speed: no log is made (one would raise here) — direct
    reads, casts, BatchNorm through torch, a pth file's records alike; the model holds the file's values."""

    class NoLog:
        def __init__(self) -> None:
            raise AssertionError("an undo log on the leased path")

    monkeypatch.setattr(rollback, "Undo", NoLog)
    for fmt, model in [("safetensors", Net()), ("pth", Net()), ("safetensors", Net().double())]:
        path = _save(tmp_path, fmt, _other_values(Net(), torch.float32))
        ckptfix.load_into(model, path)
        want = torch.load(path) if fmt == "pth" else st.load_file(path)
        assert all(torch.equal(v, want[k].to(v.dtype)) for k, v in model.state_dict().items())


def test_a_short_read_under_a_broken_lease_says_partly_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that still comes up short with the file leased (a writer waited out lease-break-time: simulated here,
    the real wait is 45 s) can't be undone, and the error says so instead of "nothing was loaded"."""
    path = _save(tmp_path, "safetensors", _other_values(Net(), torch.float32))
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset, *a: 0 if os.readlink(f"/proc/self/fd/{fd}") == str(
        path) and offset > 4096 else real(fd, bufs, offset, *a))
    monkeypatch.setattr(rollback.Leases, "intact", lambda self: False)  # (broken: the fill reads, never maps)
    with pytest.raises(FormatError, match=r"the model is partly loaded \(the load held the file longer than the \d+ s"):
        ckptfix.load_into(Net(), path)


_HOLDER = "import sys; f = open(sys.argv[1], 'r+b'); print('open', flush=True); sys.stdin.readline()"


def _refused(code: int) -> Any:
    real = fcntl.fcntl

    def call(fd: int, cmd: int, *arg: Any) -> Any:
        if cmd == fcntl.F_SETLEASE and arg and arg[0] == fcntl.F_RDLCK:
            raise OSError(code, os.strerror(code))
        return real(fd, cmd, *arg)
    return call


@pytest.mark.parametrize("why", ["open_for_writing", errno.EACCES, errno.EINVAL, errno.ENOLCK, "shrunk"])
def test_no_lease_keeps_the_undo_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: Any) -> None:
    """Where a lease can't be had — the file open for writing in another process (EAGAIN), not the owner (EACCES),
    a filesystem without leases (EINVAL, ENOLCK), the file's size changed after the plan checked it — the load
    keeps the undo log, holds no lease, and loads all the same."""
    model = Net()
    path = _save(tmp_path, "safetensors", _other_values(model, torch.float32))
    want = st.load_file(path)
    holder = None
    if why == "open_for_writing":
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    elif why == "shrunk":
        real = rollback.Leases._lease
        monkeypatch.setattr(rollback.Leases, "_lease", lambda self, p, size: real(self, p, size + 1))
    else:
        monkeypatch.setattr(fcntl, "fcntl", _refused(why))
    logs, leases = _spy(monkeypatch, "Undo"), _spy(monkeypatch, "Leases")
    try:
        ckptfix.load_into(model, path)
    finally:
        if holder is not None:
            holder.communicate("\n", timeout=60)
    assert len(logs) == 1 and len(leases) == 1 and not leases[0].held and not leases[0]._fds
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_meta_built_truncated_before_the_load_loads_nothing(tmp_path: Path) -> None:
    """The failure comes earlier for a meta-built model: the plan finds the file too short, nothing is assigned."""
    path = _save(tmp_path, "safetensors", _other_values(Net(), torch.float32))
    os.truncate(path, os.path.getsize(path) - 100)
    with torch.device("meta"):
        model = Net()
    with pytest.raises(FormatError, match="outside the data"):
        ckptfix.load_into(model, path)
    assert all(t.is_meta for t in model.state_dict().values())


_META_THEN_TRUNCATE = """
import os, sys, torch
from torch import nn
import ckptfix
with torch.device("meta"):
    model = nn.Linear(1024, 1024)
ckptfix.load_into(model, sys.argv[1])
assert not model.weight.is_meta
os.truncate(sys.argv[1], 0)
print("truncated", flush=True)
print(float(model.weight.sum()))
"""


def test_meta_built_model_truncated_later_is_sigbus(tmp_path: Path) -> None:
    """A meta-built model's tensors are views of the mapped file (as torch.load(mmap=True) gives): truncating the
    file afterwards kills the process that touches them with SIGBUS (docs/library.md says so beside ``assign``)."""
    path = _save(tmp_path, "safetensors", {"weight": torch.randn(1024, 1024), "bias": torch.randn(1024)})
    run = subprocess.run([sys.executable, "-c", _META_THEN_TRUNCATE, str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout == "truncated\n" and run.returncode == -signal.SIGBUS, (run.returncode, run.stderr[-2000:])


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch deprecates its legacy quantized tensors)
def test_the_log_puts_back_a_quantized_tensor_with_its_own_scale() -> None:
    """rollback.Undo: a quantized buffer torch's load copied into (copy_ takes the source's scale and zero point with
    its integers) is put back whole — the same object, its old quantizer and values."""
    q = torch.quantize_per_tensor(torch.randn(8, 8), 0.1, 3, torch.qint8)
    before = q.clone()
    undo = rollback.Undo()
    undo.save_tensor(q)
    with torch.no_grad():
        q.copy_(torch.quantize_per_tensor(torch.randn(8, 8), 0.02, 9, torch.qint8))
    assert (q.q_scale(), q.q_zero_point()) == (pytest.approx(0.02), 9)
    undo.restore()
    undo.close()
    assert (q.q_scale(), q.q_zero_point()) == (pytest.approx(0.1), 3) and torch.equal(q.int_repr(), before.int_repr())


# --- a signal mid-commit: with the undo log, nothing was loaded; leased (no log), the load finishes first ---


@pytest.fixture
def default_handlers() -> Iterator[None]:
    """SIGINT and SIGTERM at Python's defaults (as in a notebook or a script): ckptfix's own handlers go in."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _signal(name: str) -> Any:
    """A hook that sends signal ``name`` to the main thread (where Python runs handlers: sent to the process from
    another thread, the kernel may hand it to that thread, and a main thread blocked on a lock never hears of it) and
    goes on only once the handler ran (deferred it, or raised): from another thread of the fill, whose reads wait
    meanwhile, so the fill can't run ahead of the handler on a busy machine (nor two signals arrive as one)."""
    from ckptfix.core import interrupts

    def send() -> None:
        pending, raised = interrupts._State.pending, interrupts._State.raised
        signal.pthread_kill(threading.main_thread().ident or 0, signal.Signals[name])
        deadline = time.monotonic() + 60
        while threading.current_thread() is not threading.main_thread() and time.monotonic() < deadline:
            if interrupts._State.pending != pending or interrupts._State.raised is not raised:
                return
            time.sleep(0.001)
    send.unlocked = True  # type: ignore[attr-defined]
    return send


def _values_in(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in (torch.load(path) if fmt == "pth" else st.load_file(path)).items()}


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
@pytest.mark.parametrize("kind", ["as_stored", "cast", "bn_on_meta"])
@pytest.mark.parametrize("reads", [0, 2])
@pytest.mark.parametrize("lease", ["leased", "no_lease"])
@pytest.mark.usefixtures("default_handlers")
def test_a_signal_mid_commit_loads_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str,
                                                  kind: str, reads: int, lease: str) -> None:
    """A real SIGINT to this process just before the commit's 1st or 3rd read (4 KiB reads, threads beside this
    one): with the undo log, Interrupted "nothing was loaded" and every tensor as before; leased, no log could undo
    the fills, so the signal waits: the model holds the file's values, then Interrupted says so. The leases are
    released and Python's handlers back either way."""
    monkeypatch.setattr(tensorcopy, "READ_BYTES", 4096)
    monkeypatch.setattr(tensorcopy, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(tensorcopy, "THREAD_BYTES", 4096)
    if lease == "no_lease":
        monkeypatch.setattr(rollback, "SETLEASE", None)
    model = Net(256).double() if kind == "cast" else Net(256)
    if kind == "bn_on_meta":
        model.bn.to("meta")
    path = _save(tmp_path, fmt, _other_values(Net(256), torch.float32))
    want, before = _values_in(path, fmt), _snapshot(model)
    leases = _spy(monkeypatch, "Leases")
    state = _truncate_after(monkeypatch, path, reads, 0, _signal("SIGINT"))
    with pytest.raises(Interrupted) as info:
        ckptfix.load_into(model, path)
    assert state["cut"] and info.value.signum == signal.SIGINT and leases[-1].held == (lease == "leased")
    if lease == "leased":
        assert str(info.value) == f"interrupted; {commit.LOADED_FIRST}"
        assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k].to(v.dtype))] == []
    else:
        assert str(info.value) == "interrupted; nothing was loaded"
        _assert_as_before(model, before)
    assert not leases[-1]._fds and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ckptfix.load_into(model, path)  # (and the next load takes it)


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGHUP",), ("SIGINT", "SIGINT")], ids="+".join)
@pytest.mark.usefixtures("default_handlers")
def test_sigterm_or_a_second_sigint_cuts_a_leased_fill_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             signals: tuple[str, ...]) -> None:
    """The process is being ended (SIGTERM, SIGHUP), or Ctrl-C came twice: a leased fill stops at once — the jobs
    in flight finish, no other starts — and Interrupted says the model is partly loaded; the leases are released."""
    monkeypatch.setattr(tensorcopy, "READ_BYTES", 4096)
    monkeypatch.setattr(tensorcopy, "THREAD_BYTES", 4096)
    monkeypatch.setattr(filefill, "JOB_BYTES", 8192)  # (dozens of jobs)
    model = Net(256)
    path = _save(tmp_path, "safetensors", _other_values(model, torch.float32))
    want = _values_in(path, "safetensors")
    leases = _spy(monkeypatch, "Leases")
    states = [_truncate_after(monkeypatch, path, 2 + 6 * n, 0, _signal(sig)) for n, sig in enumerate(signals)]
    with pytest.raises(Interrupted) as info:
        ckptfix.load_into(model, path)
    assert all(state["cut"] for state in states) and leases[-1].held
    assert info.value.signal_name == signals[-1] and str(info.value).endswith(f"; {commit.CUT_SHORT}")
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])], "the fill was not cut short"
    assert not leases[-1]._fds


@pytest.mark.usefixtures("default_handlers", "no_lease")
def test_a_second_signal_while_the_log_puts_back_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM mid-fill, then SIGINT while the undo log is put back: the putting back finishes, one Interrupted
    (the first signal's) says nothing was loaded, the model as it was."""
    monkeypatch.setattr(tensorcopy, "READ_BYTES", 4096)
    model = Net(256)
    path = _save(tmp_path, "safetensors", _other_values(model, torch.float32))
    before = _snapshot(model)
    restore = rollback.Undo.restore

    def restore_under_a_signal(self: rollback.Undo) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler would run by now: it waits)
        restore(self)

    monkeypatch.setattr(rollback.Undo, "restore", restore_under_a_signal)
    state = _truncate_after(monkeypatch, path, 4, 0, _signal("SIGTERM"))
    with pytest.raises(Interrupted) as info:
        ckptfix.load_into(model, path)
    assert state["cut"] and info.value.signum == signal.SIGTERM and info.value.exit_code == 143
    assert str(info.value) == "terminated (SIGTERM); nothing was loaded"
    _assert_as_before(model, before)


@pytest.mark.usefixtures("default_handlers")
def test_a_signal_while_meta_built_values_are_checked_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A meta-built model: the assigned values are checked before any is set; a signal then leaves it on meta."""
    path = _save(tmp_path, "safetensors", _other_values(Net(256), torch.float32))
    check = tensorcopy.all_finite_many

    def check_under_a_signal(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return check(*args, **kwargs)

    monkeypatch.setattr(tensorcopy, "all_finite_many", check_under_a_signal)
    with torch.device("meta"):
        model = Net(256)
    with pytest.raises(Interrupted, match="^interrupted; nothing was loaded$"):
        ckptfix.load_into(model, path)
    assert all(t.is_meta for t in model.state_dict().values())


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group (FSDP2 on the CPU)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("what", ["truncated", "signal_no_lease", "signal_leased", "truncated_meta"])
@pytest.mark.usefixtures("one_rank", "default_handlers")
def test_an_fsdp2_models_shards_are_all_or_nothing_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       what: str) -> None:
    """A real fully_shard model (its parameters DTensors, each rank's shard filled from its byte runs): the file
    truncated by another writer, or a SIGINT, at the second shard's fill — without a lease every shard is put back
    ("nothing was loaded"), and a model sharded on meta, whose shards the commit allocated first, is on meta again;
    leased, the signal waits for the load."""
    from torch.distributed.fsdp import fully_shard

    from ckptfix.ops.load_into import shards

    if what != "signal_leased":
        monkeypatch.setattr(rollback, "SETLEASE", None)
    with torch.device("meta" if what.endswith("_meta") else "cpu"):
        model = Net(256)
        fully_shard(model.a)
        fully_shard(model)
    path = _save(tmp_path, "safetensors", _other_values(Net(256), torch.float32))
    want = _values_in(path, "safetensors")
    if what.endswith("_meta"):
        on_meta = sorted(k for k, v in model.state_dict().items() if shards.on_meta(v))
        assert len(on_meta) == len(want)
    else:
        before = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
    real, calls = shards.fill_local, []

    def second_fails(*args: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            if what.startswith("truncated"):
                os.truncate(path, os.path.getsize(path) // 2)
            else:
                os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(shards, "fill_local", second_fails)
    raised = FormatError if what.startswith("truncated") else Interrupted
    with pytest.raises(raised) as info:
        ckptfix.load_into(model, path)
    if what.endswith("_meta"):
        assert len(calls) >= 2 and "nothing was loaded" in str(info.value)
        assert sorted(k for k, v in model.state_dict().items() if shards.on_meta(v)) == on_meta
        return
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    assert len(calls) >= 2 and any(hasattr(v, "full_tensor") for v in model.state_dict().values())
    if what == "signal_leased":
        assert str(info.value) == f"interrupted; {commit.LOADED_FIRST}"
        assert [k for k, v in full.items() if not torch.equal(v, want[k].to(v.dtype))] == []
    else:
        assert "nothing was loaded" in str(info.value) and "partly" not in str(info.value)
        assert [k for k, v in full.items() if not torch.equal(v, before[k])] == []


_CUT_BEFORE = """
import os, sys, torch
from torch import nn
import ckptfix
from ckptfix.core import rollback
from ckptfix.errors import FormatError
from ckptfix.ops.load_into import commit

class Net(nn.Module):  # BatchNorm (torch's own load) and a strided parameter (copied from its source, not read)
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4096)
        self.t = nn.Parameter(torch.randn(512, 256).t())
        self.a = nn.Linear(256, 256)

path, where = sys.argv[1], sys.argv[2]
torch.save({k: v.detach().contiguous() + 1 for k, v in Net().state_dict().items()}, path)
rollback.SETLEASE = None  # (as on a filesystem without leases: the undo log)
model = Net()
before = {k: v.detach().clone() for k, v in model.state_dict().items()}
real = getattr(commit, where)

def cut_first(*args):
    os.truncate(path, 4096)  # (another writer, cutting the file while the load copies from it)
    return real(*args)

setattr(commit, where, cut_first)
try:
    ckptfix.load_into(model, path)
except FormatError as e:
    assert "nothing was loaded" in str(e), e
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model changed"
    print("refused", flush=True)
"""


@pytest.mark.parametrize("where", ["_by_torch", "_copy"])
def test_a_file_cut_before_what_a_load_copies_is_an_error_not_sigbus(tmp_path: Path, where: str) -> None:
    """Without a lease, what is copied rather than read straight into the model — BatchNorm's load through torch, a
    strided parameter — is read from the file first, not copied from its mapping: a file cut just before is a
    FormatError and the model as it was (in a child: SIGBUS would kill it), not a crash."""
    run = subprocess.run([sys.executable, "-c", _CUT_BEFORE, str(tmp_path / "m.pth"), where], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "refused\n", (run.returncode, run.stderr[-2000:])
