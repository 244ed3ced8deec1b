"""An adversarial corpus, generated offline: checkpoints that run code the moment they are unpickled.

``build_corpus(directory)`` writes every case into ``directory``. Each payload, if it ever ran,
would create its own canary file there (``webbrowser.open`` raises an audit event instead), so a
test proves nothing ran by the canary's absence. A ``Case`` lists the globals ``scan`` must name
unsafe and the findings it must report, and keeps its payload pickles so ``detonate`` can show
each payload is live under a plain ``pickle.loads`` — a corpus of duds would prove nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import shlex
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from tests.pickle_bytes import (  # noqa: F401  (also imported from here: the corpus's builders)
    LEGACY_MAGIC, Reduce, TinyNet, as_weight, benign_zip_members, call, glob, legacy_pickles, legacy_tar, patch_cd_entry,
    legacy_tar_polyglot, proto, tup, u, with_data_pkl, write_zip, zip64_two_directories)

CANARY_MODULE = "ckptfix_canary_mod"


@dataclass
class Case:
    """One malicious file and what a scan of it must report."""

    name: str
    path: Path
    canary: Path
    payloads: list[bytes]  # pickles that run the payload under pickle.loads
    unsafe: list[str]  # globals scan must class unsafe
    kinds: list[str] = field(default_factory=list)  # finding kinds scan must report
    live: bool = True  # a payload: detonating it creates the canary (False: unsafe but inert)
    env: dict[str, str] | None = None  # detonate in a subprocess with these variables set
    extension: tuple[str, str, int] | None = None  # copyreg extension the loading process has
    flag: tuple[Any, str] | None = None  # (object, attribute) the payload sets instead of a canary


# -- the corpus --------------------------------------------------------------------------------------

def canaries(directory: Path) -> tuple[Callable[[str], Path], Callable[[str], str], Callable[[str], str]]:
    """For a payload named ``name``: its canary file in ``directory`` (it exists only if the payload ran), and the
    shell command and the Python statement that create it."""

    def canary(name: str) -> Path:
        return directory / f"canary-{name}"

    def shell(name: str) -> str:
        return f"touch {shlex.quote(str(canary(name)))}"

    def py(name: str) -> str:
        return f"open({str(canary(name))!r}, 'w').close()"

    return canary, shell, py


def build_corpus(directory: Path) -> list[Case]:
    """Write every case into ``directory`` (created) and return them."""
    directory.mkdir(parents=True, exist_ok=True)
    cases: list[Case] = []
    canary, shell, py = canaries(directory)

    def add(name: str, kind: str, payload: bytes, unsafe: list[str], kinds: list[str] | None = None,
            live: bool = True, container: bytes | None = None, **how: Any) -> None:
        """``kind``: zip (payload is data.pkl), legacy (payload is the main pickle), or raw (``container``)."""
        path = directory / f"{name}.pt"
        if kind == "zip":
            write_zip(path, with_data_pkl(payload))
        elif kind == "legacy":
            path.write_bytes(b"".join(legacy_pickles(payload)))
        else:
            assert container is not None
            path.write_bytes(container)
        cases.append(Case(name, path, canary(name), [payload], unsafe, ["unsafe-global", *(kinds or [])]
                          if unsafe else list(kinds or []), live, **how))

    def posix_system(name: str, version: int = 2) -> bytes:
        return pickle.dumps({"weight": Reduce(os.system, shell(name))}, protocol=version)

    # os.system through pickle.dumps at every protocol: GLOBAL up to 3, STACK_GLOBAL + MEMOIZE from 4.
    system = f"{os.system.__module__}.system"
    for version in range(6):
        n = f"os-system-protocol-{version}"
        add(n, "zip", posix_system(n, version), [system])
    n = "os-system-legacy-main"
    add(n, "legacy", posix_system(n), [system])
    n = "os-system-named-os"
    add(n, "zip", as_weight(call(glob("os", "system"), u(shell(n)))), ["os.system"])

    n = "subprocess-popen"
    add(n, "zip", pickle.dumps({"weight": Reduce(subprocess.Popen, ["touch", str(canary(n))])}, protocol=2),
        ["subprocess.Popen"])
    for fn in ("eval", "exec"):
        n = f"builtins-{fn}"
        add(n, "zip", as_weight(call(glob("builtins", fn), u(py(n)))), [f"builtins.{fn}"])
    n = "builtins-import"  # __import__('os').system(cmd): a call on a computed object
    imp = call(glob("builtins", "getattr"), call(glob("__builtin__", "__import__"), u("os")), u("system"))
    add(n, "zip", as_weight(imp + tup(u(shell(n))) + b"R"), ["builtins.__import__", "builtins.getattr"],
        ["unsafe-construct"])
    n = "builtins-getattr-allowed-class"  # getattr(PosixPath(canary), 'touch')(): through an allowed class
    touch = call(glob("builtins", "getattr"), call(glob("pathlib", "PosixPath"), u(str(canary(n)))), u("touch"))
    add(n, "zip", as_weight(touch + b")R"), ["builtins.getattr"], ["unsafe-construct"])
    n = "runpy"
    script = directory / "payload_script.py"
    script.write_text(f"open({str(canary(n))!r}, 'w').close()\n")
    add(n, "zip", as_weight(call(glob("runpy", "run_path"), u(str(script)))), ["runpy.run_path"])
    n = "importlib"
    mod = call(glob("importlib", "import_module"), u("os"))
    add(n, "zip", as_weight(call(glob("builtins", "getattr"), mod, u("system")) + tup(u(shell(n))) + b"R"),
        ["importlib.import_module", "builtins.getattr"], ["unsafe-construct"])
    n = "webbrowser"  # detonated with BROWSER="touch %s" in a subprocess; tests also watch its audit event
    add(n, "zip", as_weight(call(glob("webbrowser", "open"), u(str(canary(n))))), ["webbrowser.open"],
        env={"BROWSER": "touch %s"})

    # The other ways to call: INST, OBJ, NEWOBJ, NEWOBJ_EX.
    n = "inst-opcode"
    add(n, "zip", proto(2) + b"}" + u("weight") + b"(" + u(shell(n)) + b"iposix\nsystem\ns.", ["posix.system"])
    n = "obj-opcode"
    add(n, "zip", as_weight(b"(" + glob("posix", "system") + u(shell(n)) + b"o"), ["posix.system"])
    n = "newobj-partial"  # partial.__new__(partial, system, cmd), then called: NEWOBJ then a computed call
    part = glob("functools", "partial") + tup(glob("posix", "system"), u(shell(n))) + b"\x81"
    add(n, "zip", as_weight(part + b")R"), ["functools.partial", "posix.system"], ["unsafe-construct"])
    n = "newobj-ex-partial"
    part = glob("functools", "partial") + tup(glob("posix", "system"), u(shell(n))) + b"}" + b"\x92"
    add(n, "zip", as_weight(part + b")R", 4), ["functools.partial", "posix.system"], ["unsafe-construct"])

    # STACK_GLOBAL fed from the memo, the way scanners that only read GLOBAL lines are beaten.
    n = "stack-global-memo"
    body = (proto(4) + b"(" + u("posix") + b"\x94" + u("decoy") + u("system") + b"\x94" + b"l" + b"0"
            + b"}" + u("weight") + b"h\x00h\x01\x93" + u(shell(n)) + b"\x85R" + b"s.")
    add(n, "zip", body, ["posix.system"])
    n = "stack-global-memo-overwrite"  # slot 0 first holds 'collections', then 'posix'
    body = (proto(4) + u("collections") + b"r\x00\x00\x00\x00" + u("OrderedDict") + b"\x93)R0"
            + u("posix") + b"r\x00\x00\x00\x00" + b"0" + u("system") + b"q\x05" + b"0"
            + b"}" + u("weight") + b"j\x00\x00\x00\x00" + b"h\x05" + b"\x93" + u(shell(n)) + b"\x85R" + b"s.")
    add(n, "zip", body, ["posix.system"])
    n = "stack-global-dup-pop"
    body = (proto(4) + b"}" + u("weight") + u("posix") + b"2" + b"0" + u("junk") + b"0" + u("system")
            + b"\x93" + u(shell(n)) + b"\x85R" + b"s.")
    add(n, "zip", body, ["posix.system"])

    # Dotted names: an allowed class's method is not the allowed class.
    n = "dotted-global"
    body = (proto(4) + b"}" + u("weight") + glob("pathlib", "PosixPath.touch")
            + call(glob("pathlib", "PosixPath"), u(str(canary(n)))) + b"\x85R" + b"s.")
    add(n, "zip", body, ["pathlib.PosixPath.touch"])
    n = "dotted-stack-global"
    body = (proto(4) + b"}" + u("weight") + u("pathlib") + u("PosixPath.write_text") + b"\x93"
            + call(glob("pathlib", "PosixPath"), u(str(canary(n)))) + u("x") + b"\x86R" + b"s.")
    add(n, "zip", body, ["pathlib.PosixPath.write_text"])

    # The broken-pickle trick: the payload runs, then the pickle fails, and a naive scanner gives up.
    n = "broken-tail-zip"
    add(n, "zip", proto(2) + b"}" + u("weight") + call(glob("posix", "system"), u(shell(n))) + b"s\xff\xfe garbage",
        ["posix.system"], ["malformed"])
    n = "broken-tail-legacy"
    add(n, "legacy", proto(2) + b"}" + u("weight") + call(glob("posix", "system"), u(shell(n))) + b"\xff",
        ["posix.system"], ["malformed"])

    # Legacy files are five stacked pickles and torch unpickles all of them.
    for index, label in ((1, "protocol-version"), (2, "sys-info"), (4, "storage-keys")):
        n = f"legacy-{label}-pickle"
        payload = pickle.dumps(Reduce(os.system, shell(n)), protocol=2)
        stack = legacy_pickles(pickle.dumps({"w": 1}, protocol=2))
        stack[index] = payload
        add(n, "raw", payload, [system], container=b"".join(stack))
    n = "legacy-after-storages"
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf, _use_new_zipfile_serialization=False)
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["data-after"], container=buf.getvalue() + payload)

    # Zip structure: members torch doesn't read, and files readers see differently.
    base = benign_zip_members()
    benign_pkl = dict(base)["archive/data.pkl"]

    def zip_bytes(members: list, gap_after: dict[str, bytes] | None = None) -> bytes:
        tmp = directory / ".building.zip"
        write_zip(tmp, members, gap_after)
        data = tmp.read_bytes()
        tmp.unlink()
        return data

    n = "zip-extra-member"
    payload = posix_system(n)
    add(n, "raw", payload, [system], container=zip_bytes([*base, ("archive/extra.pkl", payload)]))
    n = "zip-duplicate-data-pkl"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["duplicate-member"],
        container=zip_bytes([*base, ("archive/data.pkl", payload)]))
    n = "zip-duplicate-data-pkl-first"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["duplicate-member"],
        container=zip_bytes([("archive/data.pkl", payload), *base]))
    n = "zip-outside-root"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["outside-root"], container=zip_bytes([*base, ("other/data.pkl", payload)]))
    n = "zip-local-name-mismatch"  # the central directory says .txt (not a pickle); the local header .pkl
    payload = posix_system(n)
    data = bytearray(zip_bytes([*base, ("archive/aaaa.txt", payload)]))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        off = z.getinfo("archive/aaaa.txt").header_offset
    data[off + 30 : off + 30 + len("archive/aaaa.pkl")] = b"archive/aaaa.pkl"
    add(n, "raw", payload, [], ["name-mismatch"], container=bytes(data))
    n = "zip-deflated-data-pkl"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["compressed"], container=zip_bytes(with_data_pkl(payload, zipfile.ZIP_DEFLATED)))
    n = "zip-hidden-between-members"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["hidden-data"], container=zip_bytes(base, gap_after={"archive/data.pkl": payload}))
    n = "zip-after-archive"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["data-after"], container=zip_bytes(base) + payload)
    n = "zip-prepended-archive"
    payload = posix_system(n)
    add(n, "raw", payload, [], ["reader-disagreement"],
        container=zip_bytes(with_data_pkl(payload)) + zip_bytes(base))
    n = "zip-second-pickle-in-data-pkl"
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["trailing-data"], container=zip_bytes(with_data_pkl(benign_pkl + payload)))
    n = "zip-crc-mismatch"  # data.pkl swapped after the archive was written
    payload = posix_system(n)
    data = bytearray(zip_bytes(with_data_pkl(payload)))
    fake = struct.pack("<L", zlib.crc32(benign_pkl))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        off = z.getinfo("archive/data.pkl").header_offset
    data[off + 14 : off + 18] = fake
    patch_cd_entry(data, "archive/data.pkl", 16, fake)
    add(n, "raw", payload, [system], ["crc-mismatch"], container=bytes(data))
    n = "zip-encrypted-flag"
    payload = posix_system(n)
    data = bytearray(zip_bytes(with_data_pkl(payload)))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        off = z.getinfo("archive/data.pkl").header_offset
    data[off + 6] |= 1
    patch_cd_entry(data, "archive/data.pkl", 8, bytes([data[off + 6]]))
    add(n, "raw", payload, [], ["encrypted"], container=bytes(data))

    # Odd corners.
    n = "copyreg-extension-code"  # EXT1: resolved through the loading process's copyreg registry
    add(n, "zip", as_weight(b"\x82\xf0" + tup(u(shell(n))) + b"R"), ["copyreg.<extension code 240>"],
        extension=(os.system.__module__, "system", 240))
    n = "build-monkeypatch-allowed-class"  # BUILD on the class itself: setattr(argparse.Namespace, ...)
    body = as_weight(glob("argparse", "Namespace") + b"N}" + u("__ckptfix_canary__") + b"\x88s\x86b")
    add(n, "zip", body, [], ["unsafe-construct"], flag=(argparse.Namespace, "__ckptfix_canary__"))
    n = "import-time-module"  # merely importing the module named by the global runs code
    (directory / f"{CANARY_MODULE}.py").write_text(f"open({str(canary(n))!r}, 'w').close()\ndef boom():\n    pass\n")
    add(n, "zip", as_weight(call(glob(CANARY_MODULE, "boom"))), [f"{CANARY_MODULE}.boom"])
    n = "whole-module-pickled"
    buf = io.BytesIO()
    torch.save(TinyNet(), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        module_pkl = z.read(next(x for x in z.namelist() if x.endswith("data.pkl")))
    add(n, "raw", module_pkl, [f"{TinyNet.__module__}.TinyNet"], live=False, container=buf.getvalue())
    n = "torch-namespace-not-a-pass"
    add(n, "zip", as_weight(call(glob("torch", "load"), u(str(directory / "x.pt")))), ["torch.load"], live=False)

    # Readers that disagree: what torch's reader unpickles is not what another reader scans.
    for variant in ("archive/data.PKL", "archive/DATA.pkl"):  # torch looks names up case-insensitively
        n = f"zip-case-{variant.split('/')[1].replace('.', '-')}"
        payload = posix_system(n)
        add(n, "raw", payload, [system], ["duplicate-member"], container=zip_bytes([*base, (variant, payload)]))
    n = "zip64-two-directories"  # miniz follows the locator; zipfile reads the record before it
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["reader-disagreement"],
        container=zip64_two_directories(with_data_pkl(payload), base))
    n = "legacy-tar-v7"  # an old-style tar: no ustar magic, yet torch.load reads it (without weights_only)
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["tar-format"], container=legacy_tar(payload))
    n = "legacy-tar-polyglot"  # a clean legacy pickle stream that is also a tar with a payload
    payload = posix_system(n)
    add(n, "raw", payload, [system], ["tar-format", "polyglot"], container=legacy_tar_polyglot(payload))
    return cases


def case_names(payloads_only: bool = False) -> list[str]:
    """The case names, for parametrizing at collection time."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return [c.name for c in build_corpus(Path(d)) if c.live or not payloads_only]


# Audit events that mean code from a file ran: a shell, a process, a browser, a standard
# unpickler resolving a global (torch's weights_only unpickler never calls find_class), or
# exec/eval of code that mentions a canary.
WATCHED = {"os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn", "os.fork",
           "webbrowser.open", "pickle.find_class", "exec"}
_recording: list[tuple[str, str]] | None = None
_hooked = False


#: the child process ``verify --exact`` runs the serving loader in (ckptfix.model.observe_child): not the file's code
OWN_CHILD = "'-m', 'ckptfix.model.observe_child'"


def _own_fork() -> bool:
    """Whether the ``os.fork`` being audited is ckptfix's own forked observer (``ckptfix.core.forked.start``, which
    then runs the serving loader with ``weights_only=True``), called from the frames above the hook."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "start" and frame.f_code.co_filename.endswith(os.path.join("ckptfix", "core",
                                                                                              "forked.py")):
            return True
        frame = frame.f_back
    return False


def _audit_hook(event: str, args: tuple) -> None:
    if _recording is None or event not in WATCHED:
        return
    if event == "exec" and "canary" not in repr(getattr(args[0], "co_consts", ())):
        return
    if OWN_CHILD in repr(args) or event == "os.fork" and _own_fork():  # verify --exact's serving loader: ckptfix's
        return  # own process, weights_only=True
    _recording.append((event, repr(args)[:200]))


@contextlib.contextmanager
def audit_events() -> Any:
    """Record WATCHED audit events raised inside the block (the hook is installed once per process)."""
    global _recording, _hooked
    if not _hooked:
        sys.addaudithook(_audit_hook)
        _hooked = True
    events: list[tuple[str, str]] = []
    _recording = events
    try:
        yield events
    finally:
        _recording = None


def detonate(case: Case, directory: Path, timeout: float = 5.0) -> bool:
    """Run the case's payloads with plain ``pickle.loads``; True when the canary appeared."""
    import copyreg

    if case.env is not None:
        for payload in case.payloads:
            subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                           input=payload, env={**os.environ, **case.env}, capture_output=True, timeout=60)
    else:
        sys.path.insert(0, str(directory))
        if case.extension:
            copyreg.add_extension(*case.extension)
        try:
            for payload in case.payloads:
                with contextlib.suppress(Exception):
                    pickle.loads(payload)
        finally:
            sys.path.remove(str(directory))
            sys.modules.pop(CANARY_MODULE, None)
            if case.extension:
                copyreg.remove_extension(*case.extension)
    if case.flag is not None:
        obj, attr = case.flag
        was_set = attr in vars(obj)
        if was_set:
            delattr(obj, attr)
        return was_set
    deadline = time.monotonic() + timeout
    while not case.canary.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # subprocess.Popen touches the canary asynchronously
    return case.canary.exists()
