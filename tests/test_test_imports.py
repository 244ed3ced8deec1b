"""The tests import as the package does: shared pieces come from helper modules by their package path.

Parsed with ``ast``, nothing imported: every import in every module under tests/ (at module level and inside
functions). A test module (``test_*.py``) or conftest.py is never imported by another module: what two modules
share lives in a helper module (no ``test_`` prefix), imported as ``tests.<helper>``, never by a bare name that
only works with a test folder on ``sys.path``. The package's private-name rule
(tests/test_layers.py ``test_no_private_names_imported_across_modules``) holds here too, for ckptfix's names and
the helpers' alike.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _dotted(path: Path) -> str:
    """``tests/ops/test_remote.py`` → ``tests.ops.test_remote``; a package's ``__init__.py`` → the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_dotted(p): p for p in sorted(TESTS.rglob("*.py"))}
#: every module name a bare ``import X`` could reach with a test folder on sys.path
BARE = {name.rsplit(".", 1)[-1] for name in MODULES} - {"tests"}


def _imports(text: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names imported from it) for every import statement in ``text``, the source of ``path``."""
    here = _dotted(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, module, [alias.name for alias in node.names]))
    return out


def _is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


Sources = dict[Path, str]


def _test_modules_imported(sources: Sources) -> list[str]:
    found = []
    for path, text in sources.items():
        for line, module, names in _imports(text, path):
            targets = [module] + [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            found += [f"{path.relative_to(ROOT)}:{line} imports {t}" for t in targets
                      if _is_test_module(t) and (t in MODULES or t in BARE)]
    return found


def _bare_imports(sources: Sources) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}" for path, text in sources.items()
            for line, module, _names in _imports(text, path) if module.split(".")[0] in BARE]


def _private_imports(sources: Sources) -> list[str]:
    """Leading-underscore names imported from ckptfix or the tests (a third-party module's are its business)."""
    return [f"{path.relative_to(ROOT)}:{line} imports {module}.{n}" for path, text in sources.items()
            for line, module, names in _imports(text, path) if module.split(".")[0] in ("tests", "ckptfix")
            for n in names if n.startswith("_") and not n.startswith("__")]


SOURCES = {path: path.read_text(encoding="utf-8") for path in MODULES.values()}


def test_no_module_imports_a_test_module() -> None:
    found = _test_modules_imported(SOURCES)
    assert not found, "test modules imported by other modules (move what they share to a helper):\n  " + "\n  ".join(found)


def test_helpers_are_imported_by_their_package_path() -> None:
    bare = _bare_imports(SOURCES)
    assert not bare, "imports by bare name (import them as tests.<module>):\n  " + "\n  ".join(bare)


def test_no_private_names_imported_across_modules() -> None:
    found = _private_imports(SOURCES)
    assert not found, "private names imported across modules:\n  " + "\n  ".join(found)


def test_no_test_folder_is_on_sys_path() -> None:
    """Only the repository root (where pytest finds the tests package) is: a test folder there would let any
    module import a test module by its bare name."""
    on_path = [p for p in sys.path if p and Path(p).resolve().is_relative_to(TESTS)]
    assert not on_path, on_path


def test_the_checks_find_what_they_refuse() -> None:
    """Each check finds its kind of import, at module level and inside a function, absolute and relative."""
    probe = TESTS / "ops" / "probe.py"
    text = ("from tests.ops.test_remote import KINDS\nimport test_hostile\nfrom tests.ops import test_remote\n"
            "from . import test_convert\nimport adversarial\nfrom ckptfix.errors import _private\n"
            "def f():\n    from ..remote_sources import _helper, file_bytes\n    from tests import conftest\n")
    where = "tests/ops/probe.py"
    assert _test_modules_imported({probe: text}) == [
        f"{where}:1 imports tests.ops.test_remote", f"{where}:2 imports test_hostile",
        f"{where}:3 imports tests.ops.test_remote", f"{where}:4 imports tests.ops.test_convert",
        f"{where}:9 imports tests.conftest"]
    assert _bare_imports({probe: text}) == [f"{where}:2 imports test_hostile", f"{where}:5 imports adversarial"]
    assert _private_imports({probe: text}) == [f"{where}:6 imports ckptfix.errors._private",
                                               f"{where}:8 imports tests.remote_sources._helper"]
    clean = "from tests import adversarial\nfrom tests.remote_sources import file_bytes\nfrom torch import _C\n"
    assert not (_test_modules_imported({probe: clean}) or _bare_imports({probe: clean}) or _private_imports({probe: clean}))
