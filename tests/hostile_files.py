"""The hostile corpus: files that run no code but attack the reader (memory unsafety, uninitialised memory,
resource bombs, out-of-bounds views, metadata that contradicts the file), each with what loading raises, what its
one line says and what ``scan`` finds; and the pickle assembly they are built with.

tests/safety/test_hostile.py refuses each one; the differential tests (torch-free path, readers against torch)
run them too.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckptfix.errors import LimitError, UnsafeCheckpointError
from tests.adversarial import LEGACY_MAGIC, call, glob, proto, tup, u, write_zip


# -- pickle assembly ------------------------------------------------------------------------------------

def num(n: int) -> bytes:
    """The opcodes pickle writes for the int ``n``."""
    return pickle.dumps(n, protocol=2)[2:-1]


def pid(key: str, numel: int, storage: str = "FloatStorage", legacy: bool = False) -> bytes:
    """A torch storage persistent id: ('storage', torch.<storage>, key, 'cpu', numel) (a legacy file's
    has a sixth item, the view: None), BINPERSID."""
    return tup(u("storage"), glob("torch", storage), u(key), u("cpu"), num(numel), *([b"N"] if legacy else [])) + b"Q"


def rebuild(key: str, numel: int, offset: int, size: tuple, stride: tuple, storage: str = "FloatStorage",
            legacy: bool = False) -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""
    return call(glob("torch._utils", "_rebuild_tensor_v2"), pid(key, numel, storage, legacy), num(offset),
                tup(*map(num, size)), tup(*map(num, stride)), b"\x89", call(glob("collections", "OrderedDict")))


def latin1(raw: bytes) -> bytes:
    """Bytes as protocol 2 writes them: ``_codecs.encode(str, 'latin1')``."""
    return call(glob("_codecs", "encode"), u(raw.decode("latin1")), u("latin1"))


def state(**entries: bytes) -> bytes:
    """A protocol-2 pickle of ``{name: value}`` from each value's opcodes."""
    body = b"".join(u(k) + v + b"s" for k, v in entries.items())
    return proto(2) + b"}" + body + b"."


def torch_zip(path: Path, data_pkl: bytes, records: dict[str, bytes], method: int = 0) -> Path:
    """A torch zip at ``path``: ``data_pkl`` and the records (stored, or with ``method``), byteorder, version."""
    members: list = [("archive/data.pkl", data_pkl, method), ("archive/byteorder", b"little")]
    members += [(f"archive/data/{k}", v) for k, v in records.items()] + [("archive/version", b"3\n")]
    write_zip(path, members)
    return path


def legacy_file(path: Path, main: bytes, keys: list[str], storages: dict[str, bytes],
                sys_info: bytes | None = None) -> Path:
    """A legacy (non-zip) torch file: magic, protocol, sys_info, ``main``, the storage keys, then for
    each listed key its int64 element count and bytes (float32 elements)."""
    sys_info = sys_info or pickle.dumps({"protocol_version": 1001, "little_endian": True,
                                         "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    out = pickle.dumps(LEGACY_MAGIC, protocol=2) + pickle.dumps(1001, protocol=2) + sys_info + main
    out += pickle.dumps(keys, protocol=2)
    for key in keys:
        out += struct.pack("<q", len(storages[key]) // 4) + storages[key]
    path.write_bytes(out)
    return path


FOUR = struct.pack("<4f", 1, 2, 3, 4)
SECRET = b"SECRET-SECRET-16"


# -- the cases ------------------------------------------------------------------------------------------

@dataclass
class Hostile:
    """One hostile file: its maker, what loading raises and says, and what ``scan`` finds."""
    name: str
    make: Callable[[Path], Path]
    error: type  # what loading raises
    says: str  # in the one-line message
    scan: str | None  # the scan finding kind, or None when scan has nothing to say (exit 0)


def _object_field_dtype() -> bytes:
    """The opcodes of numpy's pickle of ``dtype([('a', 'O')])`` with its flags (27: holds objects) set
    to 0: numpy's ``__setstate__`` takes them as given."""
    opcodes = pickle.dumps(np.dtype([("a", "O")]), protocol=2)[2:-1]
    at = opcodes.rindex(b"K\x1bt")
    return opcodes[:at] + b"K\x00t" + opcodes[at + 3 :]


def _numpy_object_dtype(tmp: Path) -> Path:
    """numpy's dtype state declares an object field while its flags claim no objects; the array's
    raw bytes (0x4141…) then become a PyObject pointer: a segfault under numpy's own __setstate__."""
    structured = _object_field_dtype()
    array = (call(glob("numpy._core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), tup(b"K\x00"), latin1(b"b"))
             + tup(b"K\x01", tup(b"K\x01"), structured, b"\x89", latin1(b"A" * 8)) + b"b")
    return torch_zip(tmp / "numpy.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), history=array), {"0": FOUR})


def _numpy_scalar_object(tmp: Path) -> Path:
    structured = _object_field_dtype()
    scalar = call(glob("numpy._core.multiarray", "scalar"), structured, latin1(b"A" * 8))
    return torch_zip(tmp / "scalar.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), step=scalar), {"0": FOUR})


def _uninitialised(constructor: bytes, args: bytes, op: bytes = b"R") -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        value = constructor + args + op
        return torch_zip(tmp / "uninit.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), leak=value), {"0": FOUR})

    return make


def view(offset: int, size: tuple, stride: tuple) -> Callable[[Path], Path]:
    """A maker of a zip whose one tensor is the view (offset, size, stride) of a 4-float storage."""
    def make(tmp: Path) -> Path:
        return torch_zip(tmp / "view.pth", state(w=rebuild("0", 4, offset, size, stride)), {"0": FOUR, "1": SECRET})

    return make


def _legacy_unfilled(tmp: Path) -> Path:
    main = state(w=rebuild("0", 4, 0, (4,), (1,), legacy=True), v=rebuild("1", 4, 0, (4,), (1,), legacy=True))
    return legacy_file(tmp / "unfilled.pth", main, ["0"], {"0": FOUR})


def _bytearray_bomb(tmp: Path) -> Path:
    return torch_zip(tmp / "bomb.pth", state(w=rebuild("0", 4, 0, (4,), (1,)),
                                             x=call(glob("builtins", "bytearray"), num(2_500_000_000))), {"0": FOUR})


def _sys_info_bomb(tmp: Path) -> Path:
    bomb = proto(2) + call(glob("builtins", "bytearray"), num(2_500_000_000)) + b"."
    return legacy_file(tmp / "sysinfo.pth", state(w=rebuild("0", 4, 0, (4,), (1,), legacy=True)), ["0"], {"0": FOUR},
                       bomb)


def _amplified_set(tmp: Path) -> Path:
    """A 300 KB pickle asking for 20,000 sets of one memoized 10,000-element list: 2·10^8 elements."""
    items = b"]q\x00(" + b"K\x01" * 10_000 + b"e"
    sets = b"](" + (glob("builtins", "set") + b"h\x00\x85R") * 20_000 + b"e"
    return torch_zip(tmp / "amplified.pth", proto(2) + b"}" + u("w") + rebuild("0", 4, 0, (4,), (1,)) + b"s"
                     + u("items") + items + b"s" + u("sets") + sets + b"s.", {"0": FOUR})


def deflate_bomb(tmp: Path) -> Path:
    """data.pkl deflated: 200 KB of file inflating to 256 MiB (torch never compresses a member)."""
    path = tmp / "deflated.pth"
    torch_zip(path, state(w=rebuild("0", 4, 0, (4,), (1,))), {"0": FOUR})
    raw = bytearray(path.read_bytes())
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = bomb.compress(b"\x00" * (256 << 20)) + bomb.flush()
    write_zip(path, [("archive/data.pkl", payload, 0), ("archive/byteorder", b"little"), ("archive/data/0", FOUR),
                     ("archive/version", b"3\n")])
    raw = bytearray(path.read_bytes())
    for sig, method_at, size_at in ((b"PK\x03\x04", 8, 22), (b"PK\x01\x02", 10, 24)):  # mark it deflated
        at = raw.find(sig + (b"\x14\x00" if sig == b"PK\x03\x04" else b""))
        raw[at + method_at : at + method_at + 2] = b"\x08\x00"
        raw[at + size_at : at + size_at + 4] = struct.pack("<I", 256 << 20)
    path.write_bytes(bytes(raw))
    return path


def deep(kind: str) -> Callable[[Path], Path]:
    """A million nested containers: tuples, or a tuple as a dict key (hashing it recurses in C)."""

    def make(tmp: Path) -> Path:
        deep = b"N" + b"\x85" * 1_000_000
        value = deep if kind == "tuples" else b"}" + deep + b"Ns"
        return torch_zip(tmp / "deep.pth", state(w=rebuild("0", 4, 0, (4,), (1,)), deep=value), {"0": FOUR})

    return make


def stride0_expansion(tmp: Path) -> Path:
    """A stride-0 view of one float as 2**27 elements: loadable, and never expanded."""
    return torch_zip(tmp / "expand.pth", state(w=rebuild("0", 1, 0, (1 << 27,), (0,))), {"0": FOUR[:4]})


CASES = [
    Hostile("numpy-object-dtype-array", _numpy_object_dtype, UnsafeCheckpointError, "plain numeric", "unsafe-construct"),
    Hostile("numpy-object-dtype-scalar", _numpy_scalar_object, UnsafeCheckpointError, "plain numeric", "unsafe-construct"),
    Hostile("byte-tensor-uninitialised", _uninitialised(glob("torch", "ByteTensor"), tup(num(4096))),
            UnsafeCheckpointError, "uninitialised memory", "unsafe-construct"),
    Hostile("untyped-storage-uninitialised", _uninitialised(glob("torch.storage", "UntypedStorage"), tup(num(4096))),
            UnsafeCheckpointError, "uninitialised memory", "unsafe-construct"),
    Hostile("tensor-class-newobj", _uninitialised(glob("torch", "FloatTensor"), tup(num(1024)), b"\x81"),
            UnsafeCheckpointError, "FloatTensor", "unsafe-construct"),
    Hostile("view-past-storage", view(0, (8,), (1,)), UnsafeCheckpointError, "out of bounds", "unsafe-construct"),
    Hostile("view-offset-past-storage", view(6, (2,), (1,)), UnsafeCheckpointError, "out of bounds", "unsafe-construct"),
    Hostile("view-negative-stride", view(3, (4,), (-1,)), UnsafeCheckpointError, "negative", "unsafe-construct"),
    Hostile("legacy-declared-never-filled", _legacy_unfilled, UnsafeCheckpointError, "uninitialised", "uninitialised"),
    Hostile("bytearray-bomb", _bytearray_bomb, UnsafeCheckpointError, "max_alloc_bytes", "unsafe-construct"),
    Hostile("legacy-sys-info-bomb", _sys_info_bomb, UnsafeCheckpointError, "max_alloc_bytes", "unsafe-construct"),
    Hostile("memoized-set-amplification", _amplified_set, LimitError, "max_alloc_bytes", None),
    Hostile("deflate-bomb", deflate_bomb, UnsafeCheckpointError, "compressed", "resource-limit"),
    Hostile("million-nested-tuples", deep("tuples"), UnsafeCheckpointError, "max_depth", "unsafe-construct"),
    Hostile("million-nested-dict-key", deep("key"), UnsafeCheckpointError, "max_depth", "unsafe-construct"),
]
BY_NAME = {c.name: c for c in CASES}
