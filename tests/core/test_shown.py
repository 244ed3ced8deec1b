"""How a name from a file is shown (``core.units.shown``, ``few``): every character a terminal acts on escaped as
``repr`` writes it, a long name and a long list cut with what was left out."""

from __future__ import annotations

import pytest

from ckptfix.core.units import SHOWN_CHARS, escaped, few, listed, shown


@pytest.mark.parametrize("raw,text", [
    ("a\x00b\x1bc\x07", "a\\x00b\\x1bc\\x07"),  # C0
    ("x\x7f", "x\\x7f"), ("x\x85\x9b", "x\\x85\\x9b"),  # DEL, C1 (NEL, CSI)
    ("a\u202eb\u2066c\u200fd", "a\\u202eb\\u2066c\\u200fd"),  # bidi overrides, isolates, marks
    ("l\u2028p\u2029", "l\\u2028p\\u2029"), ("t\ttab\nnl", "t\\ttab\\nnl"), ("tag\U000e0041", "tag\\U000e0041"),
    ("layer1.0.bn1.weight", "layer1.0.bn1.weight"), ("é中\\x", "é中\\x"),  # printable text is untouched
])
def test_escaped(raw: str, text: str) -> None:
    assert escaped(raw) == shown(raw) == text


def test_shown_cuts_a_long_name() -> None:
    name = "\x1b" + "C" * 300_000
    assert shown(name) == "\\x1b" + "C" * (SHOWN_CHARS - 1) + f"…(+{300_001 - SHOWN_CHARS:,} chars)"
    assert shown(3) == "3" and shown("x" * SHOWN_CHARS) == "x" * SHOWN_CHARS


def test_few_and_listed_cut_a_long_list() -> None:
    assert few(["a\x1b", "b", "c"], 2) == "a\\x1b, b and 1 more"
    assert few(["a", "b"]) == "a, b" and few([]) == ""
    assert listed([f"k{i}" for i in range(25)], 20, "; ").endswith("k19 and 5 more")
