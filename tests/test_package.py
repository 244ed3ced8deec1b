"""The package's public face: the lazy names of ``ckptfix/__init__.py`` and their ``TYPE_CHECKING`` twin agree,
every public name resolves without importing torch, and the tree keeps the shape ARCHITECTURE.md describes."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import ckptfix

PACKAGE = Path(ckptfix.__file__).resolve().parent


def _type_checking_names() -> dict[str, str]:
    """public name -> "module:attribute" / "module", as the ``if TYPE_CHECKING:`` block imports it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    out = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}".lstrip(".")
            where = PACKAGE / sub.replace(".", "/")
            is_module = where.with_suffix(".py").exists() or where.is_dir()
            out[alias.asname or alias.name] = sub if is_module else f"{base}:{alias.name}"
    return out


def test_type_checking_twin_names_the_lazy_table() -> None:
    assert _type_checking_names() == ckptfix._LAZY


def test_all_is_the_lazy_table_and_the_eager_names() -> None:
    assert sorted(ckptfix.__all__) == sorted(["CkptfixError", "errors", "__version__", *ckptfix._LAZY])


def test_every_public_name_resolves_without_torch() -> None:
    code = ("import sys, types, ckptfix\n"
            "for name, target in ckptfix._LAZY.items():\n"
            "    assert isinstance(getattr(ckptfix, name), types.ModuleType) == (':' not in target), name\n"
            "assert callable(ckptfix.limits.override) and callable(ckptfix.safety.scan)\n"
            "assert ckptfix.verify.__name__ == 'verify' and ckptfix.diff.__name__ == 'diff'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert not {'boto3', 'huggingface_hub'} & set(sys.modules), 'a remote client imported'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        ckptfix.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("ckptfix.no_such_thing resolved")


def test_the_tree_keeps_its_shape() -> None:
    """At most ~10 modules directly in ckptfix/, none over 500 lines, no two modules with one file name."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    files = [p for p in PACKAGE.rglob("*.py")]
    long = {str(p.relative_to(PACKAGE)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert not long, long
    twins = {name: n for name, n in Counter(p.name for p in files if p.name != "__init__.py").items() if n > 1}
    assert not twins, twins


def test_no_function_runs_over_sixty_lines() -> None:
    """A function says one thing: none in ckptfix/ is over 60 lines (its decorators and docstring included)."""
    import ast

    long = [f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


def test_architecture_names_what_exists() -> None:
    """ARCHITECTURE.md stays short and true: every module, folder and attribute it names in backticks exists."""
    import importlib
    import re

    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    checked = 0
    for ref in re.findall(r"`([a-z_]+/[A-Za-z_./]*)`", text):
        parts = ref.removesuffix("/").replace(".py", "").split("/")
        if parts[0] not in layers:
            continue
        *folders, last = parts  # (a module in a layer's package too: ops/convert/steps.validate)
        where = PACKAGE.joinpath(*folders, last.split(".")[0])
        assert where.is_dir() or where.with_suffix(".py").exists(), f"ARCHITECTURE.md names {ref}, which doesn't exist"
        if len(parts) >= 2 and "." in last and not ref.endswith(".py"):
            module, _, attr = ref.replace("/", ".").rpartition(".")
            assert hasattr(importlib.import_module(f"ckptfix.{module}"), attr), f"ARCHITECTURE.md names {ref}"
        checked += 1
    assert checked > 30, checked  # the pattern still finds the references


def test_one_conftest() -> None:
    """Fixtures shared across folders live in tests/conftest.py, other shared pieces in helper modules
    (tests/__init__.py): a conftest.py in a test folder would be a second place to look for a fixture."""
    tests = Path(__file__).resolve().parent
    assert sorted(tests.rglob("conftest.py")) == [tests / "conftest.py"]


def test_the_gpu_script_runs_every_gpu_test() -> None:
    """tools/gpu_check.sh (one run on a lent GPU, the only place ``gpu`` tests run) names every module that marks one:
    a new one left out would never run anywhere."""
    tests = Path(__file__).resolve().parent
    script = (tests.parent / "tools" / "gpu_check.sh").read_text(encoding="utf-8")
    marked = {p.relative_to(tests.parent).as_posix() for p in tests.rglob("test_*.py")
              if p != Path(__file__).resolve() and "pytest.mark.gpu" in p.read_text(encoding="utf-8")}
    assert len(marked) >= 5 and not [m for m in sorted(marked) if m not in script], sorted(marked)
