"""Differential tests: ckptfix's safetensors header reader accepts exactly the files safetensors' own reader
(``safetensors.safe_open``, framework ``pt``) reads, and sees in them the same keys, dtypes, shapes and bytes.

- Named cases, each a real ``safetensors.torch.save_file`` output with its header edited: safetensors refuses
  them, so every ckptfix command refuses them with one ``Error:`` line naming the file and the key (exit 1,
  nothing written), and ``ckptfix.load`` / ``load_into`` raise ckptfix's FormatError.
- Generated headers (hypothesis): for each, either both readers read the file and agree on every tensor,
  or both refuse it. ckptfix is stricter in one way only: a key given twice in the JSON is refused (its
  value depends on the reader; safetensors keeps one of them silently), so the generator writes unique keys.
And where safetensors' own reshape gives an empty tensor whose shape ``torch.empty`` refuses (strides past
int64), ckptfix refuses the file, as torch would.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import ckptfix
from ckptfix import formats
from ckptfix.cli import cli
from ckptfix.core.devices import DevicePlan
from ckptfix.core.tensorinfo import TensorInfo
from ckptfix.errors import FormatError
from ckptfix.parse.format_registry import SAFETENSORS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def split(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and data."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def assemble_file(path: Path, text: str, data: bytes) -> Path:
    """A safetensors file from a header's JSON text (lone surrogates written as JSON escapes) and its data."""
    raw = text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def theirs(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """Key → (dtype, shape, bytes) as safetensors' own reader gives every tensor; None if it refuses."""
    try:
        with safe_open(str(path), "pt") as f:
            out = {}
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
            return out
    except Exception:  # safetensors raises SafetensorError, torch's errors, OverflowError …: all a refusal
        return None


def ours(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """The same view from ckptfix, torch-free (describe) and through torch (read), which must agree; None if
    ckptfix refuses (always with a FormatError)."""
    try:
        described = formats.describe(str(path), SAFETENSORS).obj
        loaded = formats.read(str(path), SAFETENSORS, DevicePlan("cpu"), trust=False).obj
    except FormatError:
        return None
    raw = path.read_bytes()
    out = {}
    for k, info in described.items():
        assert isinstance(info, TensorInfo)
        start, end = info.byte_range or (0, 0)
        t = loaded[k]
        assert (str(t.dtype).removeprefix("torch."), tuple(t.shape)) == (info.dtype, info.shape), k
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data == raw[start:end], f"{k}: describe and read disagree on its bytes"
        out[k] = (info.dtype, info.shape, data)
    return out


def torch_empty_refuses(dtype: str, shape: tuple[int, ...]) -> bool:
    """torch's own check of a shape (sizes, storage bytes, strides in int64), as ``torch.empty`` applies it."""
    try:
        torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    except RuntimeError:
        return True
    return False


def assert_agree(path: Path) -> None:
    want, got = theirs(path), ours(path)
    if want is not None and got is None and any(torch_empty_refuses(d, s) for d, s, _ in want.values()):
        return  # an empty tensor torch can't make (safetensors' reshape of 0 bytes takes some): ckptfix refuses
    assert (want is None) == (got is None), f"safetensors {'refuses' if want is None else 'reads'} it, ckptfix " \
        f"{'refuses' if got is None else 'reads'} it: {path.read_bytes()[:400]!r}"
    assert want == got


# -- named cases: real files, one edit each ----------------------------------------------------------------

def _base(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """weight [2, 3] and bias [2] (an nn.Linear(3, 2)'s state dict) and an empty tensor, written by safetensors."""
    path = tmp_path / "base.safetensors"
    save_file(tensors or {"weight": torch.randn(2, 3), "bias": torch.randn(2), "empty": torch.empty(0, 3)}, str(path))
    return path


def _true_in_shape(tmp_path: Path) -> tuple[str, bytes, str]:
    header, data = split(_base(tmp_path))
    header["bias"]["shape"] = [True, 2]
    return json.dumps(header), data, "bias"


def _true_as_offset(tmp_path: Path) -> tuple[str, bytes, str]:
    """``true`` for 1: a one-byte tensor at [0, true]."""
    header, data = split(_base(tmp_path, {"flag": torch.ones(1, dtype=torch.uint8)}))
    assert header["flag"]["data_offsets"] == [0, 1]
    return json.dumps(header).replace("[0, 1]", "[0, true]"), data, "flag"


def _huge_dimension(tmp_path: Path) -> tuple[str, bytes, str]:
    header, data = split(_base(tmp_path))
    header["empty"]["shape"] = [0, 2**70]
    return json.dumps(header), data, "empty"


def _gap_before_first(tmp_path: Path) -> tuple[str, bytes, str]:
    header, data = split(_base(tmp_path))
    for entry in header.values():
        entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]
    first = min(header, key=lambda k: header[k]["data_offsets"])
    return json.dumps(header), b"\0" * 4 + data, first


def _lone_surrogate_key(tmp_path: Path) -> tuple[str, bytes, str]:
    header, data = split(_base(tmp_path))
    header["weight\ud800"] = header.pop("weight")
    return json.dumps(header), data, "weight"


NAMED = {
    "true in a shape": _true_in_shape,
    "true as an offset": _true_as_offset,
    "a dimension of 2**70": _huge_dimension,
    "a gap before the first tensor": _gap_before_first,
    "a lone surrogate in a key": _lone_surrogate_key,
}


@pytest.fixture(params=sorted(NAMED))
def malformed(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    text, data, key = NAMED[request.param](tmp_path)
    return assemble_file(tmp_path / "bad.safetensors", text, data), key


def test_named_cases_are_refused_by_both(malformed: tuple[Path, str]) -> None:
    path, key = malformed
    assert theirs(path) is None
    with pytest.raises(FormatError, match=key):
        ckptfix.describe(path)
    for call in (lambda: ckptfix.load(path), lambda: ckptfix.load_into(torch.nn.Linear(3, 2), path)):
        with pytest.raises(FormatError) as e:
            call()
        assert str(path) in str(e.value) and key in str(e.value)


@pytest.mark.parametrize("command", ["inspect", "scan", "convert", "diff", "verify"])
def test_every_command_refuses_named_cases(command: str, malformed: tuple[Path, str], cli_runner: Any,
                                           tmp_path: Path) -> None:
    path, key = malformed
    out = tmp_path / "out.pth"
    argv = {"inspect": ["inspect", str(path)], "scan": ["scan", str(path)], "convert": ["convert", str(path), str(out)],
            "diff": ["diff", str(path), str(tmp_path / "base.safetensors")],
            "verify": ["verify", str(path), "--model", "torch.nn:Linear", "--arg", "in_features=3", "--arg",
                       "out_features=2"]}[command]
    res = cli_runner.invoke(cli, argv)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert str(path) in res.stderr and key in res.stderr and "a bug in ckptfix" not in res.stderr, res.stderr
    assert not out.exists()


def test_the_base_file_is_read(tmp_path: Path) -> None:
    """The named cases' source file itself is read alike by both (each case is one edit away)."""
    assert_agree(_base(tmp_path))


def test_trailing_bytes_are_refused(tmp_path: Path) -> None:
    header, data = split(_base(tmp_path))
    path = assemble_file(tmp_path / "bad.safetensors", json.dumps(header), data + b"\0" * 4)
    assert theirs(path) is None
    with pytest.raises(FormatError, match="past the last tensor"):
        ckptfix.describe(path)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    """The one place ckptfix is stricter than safetensors (which silently keeps one of the two)."""
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    path = assemble_file(tmp_path / "twice.safetensors", f'{{"a": {entry}, "a": {entry}}}', b"\1")
    assert theirs(path) is not None
    with pytest.raises(FormatError, match="'a'"):
        ckptfix.describe(path)


# -- generated headers -------------------------------------------------------------------------------------

#: safetensors' dtypes (its Rust ``Dtype``) and their bits, for the generator to make byte ranges that fit
ST_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
           "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
           "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}

def _mostly(usual: Any, *rare: Any, weight: int = 12) -> st.SearchStrategy:
    """``usual``, or now and then one of ``rare``."""
    return st.sampled_from([usual] * weight + list(rare))


_dims = st.one_of(*[st.integers(0, 4)] * 24,
                  st.sampled_from([True, False, -1, 1.0, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70]))
_keys = st.one_of(st.text(max_size=3), st.sampled_from(["a", "b", "w.x", "", "é", "__metadata__x"] * 4 + ["w\ud800", "\udc00"]))


@st.composite
def headers(draw: Any) -> tuple[str, bytes]:
    """A header's JSON text and the data after it: mostly well-formed, each part sometimes bent."""
    keys = draw(st.lists(_keys, max_size=4, unique=True))
    entries: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for k in keys:
        dtype = draw(st.sampled_from([*ST_BITS] * 3 + ["f32", "C128", 1]))
        shape = draw(st.lists(_dims, max_size=3))
        try:
            numel = 1
            for d in shape:
                numel *= int(d)
            bits = numel * ST_BITS[dtype]
            sizes[k] = min(bits // 8, 1024) + draw(_mostly(0, 1, -1))
        except (KeyError, TypeError):
            sizes[k] = draw(st.integers(0, 8))
        entries[k] = {"dtype": dtype, "shape": shape}
    order = draw(st.permutations(list(entries)))
    pos = draw(_mostly(0, 1))  # a gap before the first tensor
    for k in order:
        size = max(sizes[k], 0)
        entries[k]["data_offsets"] = [pos, pos + size]
        pos += size + draw(_mostly(0, 1, -1))  # a gap, an overlap
    for k in entries:
        bend = draw(_mostly("none", "swap", "bool", "huge", "three", "seq", "dtype map", "extra", "deep", "missing",
                            "null", weight=30))
        e = entries[k]
        if bend == "swap":
            e["data_offsets"].reverse()
        elif bend == "bool":
            e["data_offsets"][0] = bool(e["data_offsets"][0]) if e["data_offsets"][0] in (0, 1) else True
        elif bend == "huge":
            e["data_offsets"][1] += 2**64
        elif bend == "three":
            e["data_offsets"].append(0)
        elif bend == "seq":  # serde reads a struct from a sequence of its fields too
            entries[k] = [e["dtype"], e["shape"], e["data_offsets"]]
        elif bend == "dtype map":  # … and a unit enum variant from a one-entry map
            e["dtype"] = {e["dtype"]: draw(st.sampled_from([None, None, [], 0]))}
        elif bend == "extra":
            e[draw(st.sampled_from(["extra", "offsets"]))] = draw(st.sampled_from(
                [1, -0.0, 1e300, "x", None, {"a": [1]}, [[[]]], "\ud800", float("nan"), float("inf"), 10**400]))
        elif bend == "deep":
            depth = draw(st.sampled_from([120, 125, 126, 127, 300, 3000]))
            e["deep"] = "DEEP" * depth
        elif bend == "missing":
            del e[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
        elif bend == "null":
            entries[k] = None
    meta = draw(_mostly("absent", None, {}, {"format": "pt"}, {"k": 1}, [], "x", {"k": "\ud800"}, {"k": None},
                        {"\ud800": "v"}, weight=30))
    if meta != "absent":
        items = list(entries.items())
        items.insert(draw(st.integers(0, len(items))), ("__metadata__", meta))
        entries = dict(items)
    text = json.dumps(entries, allow_nan=True)
    for nest in (120, 125, 126, 127, 300, 3000):  # a value nested `nest` levels deep (within the header's 2)
        text = text.replace(json.dumps("DEEP" * nest), "[" * nest + "]" * nest)
    trailing = draw(_mostly(0, 1))
    data = draw(st.binary(min_size=pos + trailing, max_size=pos + trailing)) if pos + trailing >= 0 else b""
    return text, data


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=headers())
def test_generated_headers_read_alike(case: tuple[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> None:
    text, data = case
    assert_agree(assemble_file(tmp_path_factory.mktemp("gen") / "g.safetensors", text, data))


@pytest.mark.parametrize("text, data", [
    ('{"a": ["F32", [1], [0, 4]]}', b"\0" * 4),
    ('{"a": {"dtype": {"F32": null}, "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
    ('{"a": {"dtype": "U8", "shape": [0, 9223372036854775807, 9223372036854775807], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "U8", "shape": [9223372036854775808, 0], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "U8", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": -0}}', b"\0" * 4),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1e400}}', b"\0" * 4),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}', b"\0" * 4),
    ('{"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}', b"\0" * 3),
    ('{"a": {"dtype": "F4", "shape": [3, 0], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "F4", "shape": [], "data_offsets": [0, 0]}}', b""),
    ('{"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}', b"\0" * 3),
    ('{"__metadata__": null}', b""),
    ('{"__metadata__": {"a": "b"}, "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0"),
    ('{"a": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]}, "b": {"dtype": "U8", "shape": [1], '
     '"data_offsets": [0, 1]}}', b"\0"),
    ('\ufeff{}', b""),
    (' \n{}\t', b""),
    ('{"a\\ud83d\\ude00": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0"),
    ('{"a\\"%s": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}' % ("[" * 200), b"\0"),
    ('{"__metadata__": {"k": "{{%s"}}' % ("{" * 200), b""),
])
def test_edge_cases_read_alike(text: str, data: bytes, tmp_path: Path) -> None:
    """Corners found while reading safetensors' Rust parser (serde_json into usize, u64 arithmetic)."""
    assert_agree(assemble_file(tmp_path / "e.safetensors", text, data))
