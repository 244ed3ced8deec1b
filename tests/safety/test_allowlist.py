"""The allow-list is one table: every allowed global is spelled once, and every rule kind it names has its
guard, its static check and its stand-in."""

from __future__ import annotations

import ast
from pathlib import Path

from ckptfix.safety import guards, numpy_policy, static_checks
from ckptfix.safety.allowlist import NUMPY_DTYPE_CLASS, RULES, Rule

PACKAGE = Path(__file__).resolve().parents[2] / "ckptfix"
TABLE = PACKAGE / "safety" / "allowlist.py"
#: files that may spell an allowed name: the table, and torch's own weights_only list (frozen per torch
#: release, compared with torch by tests/core/test_torch_tables.py), which is torch's fact, not ckptfix's policy
SPELLERS = {TABLE, PACKAGE / "core" / "torch_tables.py"}


def _spelled(path: Path) -> set[str]:
    """The allowed names ``path`` holds as string constants."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in RULES}


def test_no_other_module_spells_an_allowed_name() -> None:
    """A name of the table written anywhere else in ckptfix/ is a second list growing back: import the
    table's constant (``allowlist.ORDERED_DICT``) or read :data:`RULES` instead."""
    assert _spelled(TABLE) == set(RULES)  # the scan sees the names where they are
    elsewhere = {f"{path.relative_to(PACKAGE.parent)}: {sorted(names)}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path not in SPELLERS and (names := _spelled(path))}
    assert not elsewhere, "\n".join(sorted(elsewhere))


def _rules() -> list[Rule]:
    return [*RULES.values(), NUMPY_DTYPE_CLASS]


def test_every_call_kind_has_a_guard_and_every_guard_a_rule() -> None:
    assert {r.call for r in _rules() if r.call} == set(guards._guards())


def test_every_static_check_is_of_a_kind_the_table_names() -> None:
    kinds = {r.call or r.stand_in for r in _rules()}
    assert set(static_checks._CALLS) <= kinds
    assert set(numpy_policy.STATIC_BUILDS) <= {r.build for r in _rules()}


def test_every_stand_in_kind_has_its_maker() -> None:
    assert {r.stand_in for r in _rules() if r.stand_in} == set(guards._STAND_INS)


def test_build_kinds_and_refused_rules_are_consistent() -> None:
    assert {r.build for r in _rules() if r.build} == {*guards._BUILDS, *numpy_policy.BUILDS}
    for name, r in RULES.items():
        assert not r.refused or (r.origin == "torch" and r == Rule("torch", refused=True)), name
        assert r.new is None or r.build is not None or r.call is not None, name
