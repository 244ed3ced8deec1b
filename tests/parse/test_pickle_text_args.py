"""The text arguments of the protocol-0 opcodes (INT, LONG, FLOAT, STRING, UNICODE, GET/PUT): the static
walker and ckptfix's restricted unpickler read exactly what CPython's C unpickler (``pickle.loads``, which
``torch.load`` uses) reads, value or refusal, whatever numeral form the argument takes (issue 20, item 1)."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import UnsafeCheckpointError
from ckptfix.parse import pickle_walk, unpickler
from tests import adversarial


_NO_GLOBALS = unpickler.Policy({}, {}, set(), {}, (list,), (dict,), persistent=False)

# Each template holds the argument line (ARG) of one opcode; the rest is a plain protocol-0 pickle.
TEMPLATES = {
    "INT": b"IARG\n.",
    "LONG": b"LARG\n.",
    "FLOAT": b"FARG\n.",
    "STRING": b"SARG\n.",
    "UNICODE": b"VARG\n.",
    "PUT+GET": b"I7\npARG\n0gARG\n.",
    "PUT+GET 3": b"I7\npARG\n0g3\n.",
}

FORMS = [
    b"0", b"1", b"00", b"01", b"000", b"001", b"-0", b"+1", b" 1", b"\t0", b"1 ", b"0\x00", b"1\x00x", b"\x00",
    b"\x00\x00", b"\x00x", b"10", b"0x10", b"0X1f", b"-0x10", b"+0x10", b" 0x10", b"0x", b"0xg", b"0o17",
    b"0O17", b"017", b"08", b"-017", b"0b11", b"0B11", b"-0b11", b"0b", b"0b2", b"1_000", b"1__0", b"_1",
    b"1_", b"0x_10", b"0_0", b"0_1", b"1L", b"0x10L", b"0o17L", b"L", b"LL", b"1LL", b"9223372036854775807",
    b"9223372036854775808", b"-9223372036854775808", b"-9223372036854775809", b"0x8000000000000000",
    b"01777777777777777777777", b"02000000000000000000000", b"0777777777777777777777777", b"1" * 30,
    b"1.5", b"1e5", b"1.e5", b".5", b"5.", b".", b"1e", b"1e+", b"-1.5e-3", b"1e999", b"-1e999", b"1e-999",
    b"inf", b"-inf", b"Infinity", b"infinit", b"nan", b"-NaN", b"1_0.5", b" 1.5", b"1.5 ", b"1.5\x00z",
    b"0x1p3", b"'ab'", b'"ab"', b"'ab", b"'", b"''", b"'a\\x41'", b"'a\\'", b"'\\xc3\\xa9'", b"'\xc3\xa9'",
    b"'\xff'", b"abc", b"\\u0041", b"\xc3\xa9", b"\xff", b"", b"+", b"-", b" ", b"\x0b1", b"\x0c1", b"\r1",
    b"\xa01", b"\x851", b"2_147_483_648", b"+ 1", b"--1", b"0x1_0", b"1\r",
]


def _outcome(fn: Any) -> tuple:
    try:
        value = fn()
    except MemoryError:  # pragma: no cover - C allocates a memo as large as the PUT index
        return (MemoryError,)
    except Exception:  # noqa: BLE001 - every refusal is the same outcome here
        return ("refused",)
    if isinstance(value, float) and math.isnan(value):
        return ("nan", math.copysign(1, value))
    return (type(value), value)


def _readers(data: bytes) -> dict[str, tuple]:
    def walked() -> Any:
        w = pickle_walk.walk(data)
        if w.error:
            raise ValueError(w.error)
        return w.value

    return {
        "pickle": _outcome(lambda: pickle.loads(data, encoding="utf-8")),  # what torch.load's unpickler reads
        "walker": _outcome(walked),
        "unpickler": _outcome(lambda: unpickler.loads(data, _NO_GLOBALS)),
    }


def _assert_agree(template: bytes, arg: bytes) -> None:
    data = template.replace(b"ARG", arg)
    seen = _readers(data)
    if seen["pickle"][0] is MemoryError:  # pragma: no cover - a huge memo index: C runs out of memory
        return
    assert seen["walker"] == seen["pickle"] == seen["unpickler"], (data, seen)


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("arg", FORMS, ids=repr)
def test_text_arguments_read_as_cpython_reads_them(template: str, arg: bytes) -> None:
    _assert_agree(TEMPLATES[template], arg)


_ALPHABET = list(b"0123456789abcdefxobXOBLlinfIN_+-. \t\x00\x0b'\"\\e") + [0xA0, 0xC3, 0xFF]


@settings(max_examples=300, deadline=None)
@given(template=st.sampled_from(list(TEMPLATES)), arg=st.lists(st.sampled_from(_ALPHABET), max_size=12).map(bytes))
def test_text_arguments_agree_on_random_forms(template: str, arg: bytes) -> None:
    _assert_agree(TEMPLATES[template], arg)


@pytest.mark.parametrize("form", [b"I0x10\n", b"L0o17L\n", b"I0b11\n", b"I1_000\n", b"I -017\n", b"F1.5\x00\n",
                                  b"I\x00\n", b"I01\n"])
def test_odd_numeral_before_a_payload_is_a_finding(form: bytes, tmp_path: Path, cli_runner) -> None:
    """A torch zip whose data.pkl reaches os.system after an odd numeral: torch.load runs the payload,
    so scan reports it (exit 3) and inspect / convert refuse it as unsafe; nothing is written."""
    system = adversarial.glob("posix", "system") + adversarial.tup(adversarial.u("true")) + b"R"
    data_pkl = adversarial.proto(2) + b"}" + adversarial.u("weight") + form + b"0" + system + b"s."
    assert pickle.loads(data_pkl.replace(b"posix\nsystem", b"builtins\nlen").replace(b"true", b"abcd")) == {"weight": 4}
    path = tmp_path / "odd.pth"
    adversarial.write_zip(path, adversarial.with_data_pkl(data_pkl))
    report = ckptfix.scan(path)
    assert "posix.system" in report.unsafe_globals
    res = cli_runner.invoke(cli, ["scan", str(path)])
    assert res.exit_code == 3 and "posix.system" in res.stdout, res.output
    for argv in (["inspect", str(path)], ["convert", str(path), str(tmp_path / "out.safetensors")]):
        res = cli_runner.invoke(cli, argv)
        assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "refused" in res.stderr, res.output
    with pytest.raises(UnsafeCheckpointError):
        ckptfix.load(path)
    assert not (tmp_path / "out.safetensors").exists()
