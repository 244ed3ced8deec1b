"""The package's layers import one way only: each module imports from its own layer or the ones below.

Parsed with ``ast``, nothing imported: every ``import ckptfix…`` / ``from . import …`` at module level and
inside functions. A module-level import of a higher layer, or a cycle of module-level imports, is what
used to force ~150 imports into function bodies; a function-level import of a higher layer is the same
dependency hidden. ``import torch`` (and what imports it) stays deferred by design and is not internal.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ckptfix"

#: bottom to top, by folder: a module may import from its own layer and every layer before it. A subpackage is
#: one layer (its ``__init__`` docstring says what it may import); the few top-level modules are placed by name.
LAYERS: list[tuple[str, str]] = [
    ("core", "primitives: limits, devices, atomic writes, interrupts, byte copying, progress, units, TensorInfo"),
    ("parse", "bytes to structure, nothing executed: sniffing, zip directory, safetensors header, pickle opcodes"),
    ("safety", "policy: the allow-list, guards, stand-ins, DCP/DeepSpeed pickle policies, the scanners"),
    ("statedict", "key strings, not files: wrappers, where the state dict sits, transforms, ties, repair"),
    ("formats", "one package or module per format family, behind the registry in formats/__init__"),
    ("ops", "the library's operations: read, load, load_into, convert, diff; their reports and text"),
    ("model", "verification against a model: spec, inputs, forward, golden, serving, verify"),
    ("cli", "click commands; and the package itself, whose lazy __getattr__ reaches every layer"),
]

#: top-level modules (no folder of their own) and the layer each belongs to
TOP_LEVEL = {"errors": "core", "reports": "ops", "text": "ops", "__main__": "cli", "": "cli"}

#: (importer, imported) -> why it may point up; keep this short, and empty where possible
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

#: ops' packages, one per verb -> the other verbs' packages it may import: none. What two verbs share is an ``ops``
#: module (``reading``, every verb's first step; ``sources``, ``convert_options``); ``api`` and ``diff`` sit above.
OPS_VERBS: dict[str, set[str]] = {"convert": set(), "load_into": set()}

#: modules that may still import ckptfix modules inside functions, and why (everything else imports at the top)
DEFERRED: dict[str, str] = {
    "cli.commands": "`ckptfix --help` stays instant: the library (and through it torch) is imported by the command run",
    "cli.options": "the same: --map-location's parser (core.devices) is imported when a command parses it",
    "cli.exits": "the same: the signal handling (core.interrupts) is imported when a command runs",
    "model.verify_options": "plain data that `ckptfix --help` reads: the device names a --serving-device is checked "
                            "against (core.devices) are imported when options are made",
}


def _modules() -> dict[str, Path]:
    """Dotted name below ``ckptfix`` ('' for the package, 'formats.dcp') → file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    names = [name for name, _why in LAYERS]
    folder = module.split(".")[0]
    if module in TOP_LEVEL:
        return names.index(TOP_LEVEL[module])
    if "." in module or MODULES[module].name == "__init__.py":
        if folder in names:
            return names.index(folder)
    raise AssertionError(f"ckptfix.{module} has no layer: put it in a layer's folder, or name it in TOP_LEVEL in {__file__}")


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The ckptfix modules an import statement runs (the named module, and the parent packages it imports)."""
    is_package = MODULES[module].name == "__init__.py"
    found: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name == "ckptfix" or a.name.startswith("ckptfix.")]
        found = [n.removeprefix("ckptfix").lstrip(".") for n in names]
    else:
        if node.level == 0:
            if not (node.module == "ckptfix" or (node.module or "").startswith("ckptfix.")):
                return []
            base = (node.module or "").removeprefix("ckptfix").lstrip(".")
        else:
            here = module.split(".") if module else []
            if not is_package:
                here = here[:-1]
            here = here[: len(here) - (node.level - 1)]
            base = ".".join(here + ([node.module] if node.module else []))
        for alias in node.names:  # `from . import safety` imports the submodule safety
            sub = f"{base}.{alias.name}".lstrip(".")
            found.append(sub if sub in MODULES else base)
    out = []
    for name in found:
        parts = name.split(".") if name else []
        out += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # importing a.b runs a first
    # the packages a module sits in are imported before it runs: not edges (a package may import its children)
    parts = module.split(".") if module else []
    ancestors = {".".join(parts[:i]) for i in range(len(parts))}
    return [n for n in dict.fromkeys(out) if n != module and n not in ancestors]


def _imports() -> list[tuple[str, str, bool, int]]:
    """(importer, imported, at module level, line) for every internal import in the package."""
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

        def visit(node: ast.AST, in_function: bool, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges.extend((module, t, not in_function, child.lineno) for t in _targets(module, child))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return edges


EDGES = _imports()


def _name(module: str) -> str:
    return f"ckptfix.{module}".rstrip(".")


def _edge(importer: str, imported: str, line: int, top: bool) -> str:
    where = "module level" if top else "inside a function"
    return (f"{_name(importer)} ({LAYERS[_layer(importer)][0]}) imports {_name(imported)} "
            f"({LAYERS[_layer(imported)][0]}) at {MODULES[importer].relative_to(PACKAGE.parent)}:{line}, {where}")


def test_every_module_has_a_layer() -> None:
    for m in MODULES:
        _layer(m)  # names the module missing from a layer
    assert set(TOP_LEVEL) <= set(MODULES), f"TOP_LEVEL names modules that don't exist: {sorted(set(TOP_LEVEL) - set(MODULES))}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {name for name, _why in LAYERS} - {"cli"} | {"cli"}, sorted(folders)


def test_each_layer_says_what_it_may_import() -> None:
    """Every subpackage opens with a docstring that names what it is for and what it may import."""
    for name, _why in LAYERS:
        init = PACKAGE / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"{init}: its docstring should say what the layer may import"


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = [_edge(a, b, line, top) for a, b, top, line in EDGES
              if _layer(b) > _layer(a) and (a, b) not in ALLOWED_UPWARD]
    assert not upward, "imports pointing up a layer (move the shared piece down instead):\n  " + "\n  ".join(upward)


def test_allowed_upward_edges_still_exist() -> None:
    present = {(a, b) for a, b, _top, _line in EDGES}
    stale = [f"{_name(a)} -> {_name(b)}" for a, b in ALLOWED_UPWARD if (a, b) not in present]
    assert not stale, f"remove from ALLOWED_UPWARD, no longer imported: {stale}"


def test_module_level_imports_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, top, _line in EDGES:
        if top:
            graph[a].add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("module-level import cycle: " + " -> ".join(map(_name, cycle)))


def test_internal_imports_sit_at_module_top() -> None:
    """Outside DEFERRED, a ckptfix module imports its siblings at the top, where the layering is visible."""
    deferred = sorted({f"{_name(a)}:{line} imports {_name(b)}" for a, b, top, line in EDGES
                       if not top and a not in DEFERRED})
    assert not deferred, "move these imports to the module top (or say why in DEFERRED):\n  " + "\n  ".join(deferred)


def test_cli_imports_no_library_at_module_level() -> None:
    """``ckptfix --help`` stays instant: at import time the CLI reaches the lazy package, errors, units and plain
    tables (the option declarations, the format registry, the wrapper targets, the cast dtypes), no library."""
    top = {b for a, b, at_top, _line in EDGES if a.split(".")[0] == "cli" and at_top}
    light = {"", "errors", "core", "core.units", "ops", "ops.convert_options", "parse", "parse.format_registry", "model",
             "model.verify_options"}
    assert top <= light | {m for m in MODULES if m.split(".")[0] == "cli"}, sorted(map(_name, top))
    tables = {"parse.format_registry": set(), "statedict.wrappers": {"errors"},
              "statedict.transforms": {"errors", "core", "core.units", "statedict", "statedict.wrappers"},
              "ops.convert_options": {"parse", "parse.format_registry", "statedict", "statedict.transforms",
                                      "statedict.wrappers"},
              "model.verify_options": {"errors", "ops", "ops.convert_options"}}
    for data, may in tables.items():
        imported = {b for a, b, top_level, _line in EDGES if a == data and top_level} - may
        assert not imported, f"ckptfix.{data} should stay plain data, but imports {sorted(imported)}"


def test_no_private_names_imported_across_modules() -> None:
    """A name with a leading underscore stays in its module: what another module needs is public, with a good name."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and _targets(module, node):
                found += [f"{_name(module)}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not found, "private names imported across modules:\n  " + "\n  ".join(found)


def test_no_format_tests_outside_the_registry() -> None:
    """What a format can do is asked of the registry (``registry.get(fmt).stream`` …), never decided by comparing
    format names, above the layers that define formats (parse, safety's per-format scanners, formats)."""
    from ckptfix.parse.format_registry import FORMATS

    #: module -> why it may name one format: a rule of the product, not a capability of the format
    exempt = {"model.golden": "golden outputs are a safetensors file by definition (docs/verify.md)"}
    names = set(FORMATS) | {name.upper().replace("-", "_") for name in FORMATS} | {"SHARDED"}
    found = []
    for module, path in MODULES.items():
        if module.split(".")[0] in ("parse", "safety", "formats") or module in exempt:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    named = side.attr if isinstance(side, ast.Attribute) else getattr(side, "id", None)
                    literal = side.value if isinstance(side, ast.Constant) else None
                    if named in names or literal in names:
                        found.append(f"{_name(module)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "format names compared outside the registry (add an ability to it instead):\n  " + "\n  ".join(found)


def test_each_verbs_package_imports_no_other_verbs() -> None:
    """ops/ holds one package per verb; none imports another (but ``read``, which every verb starts from), at module
    level or inside a function, and an ops-level module every verb shares imports none of them."""
    packages = {p.name for p in (PACKAGE / "ops").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(OPS_VERBS), f"ops/ packages {sorted(packages)}: name each in OPS_VERBS"

    def verb(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == "ops" and len(parts) > 1 and parts[1] in OPS_VERBS else None

    above = {"ops", "ops.api", "ops.diff"}  # the public verbs, over every package
    crossing = [_edge(a, b, line, top) for a, b, top, line in EDGES
                if (vb := verb(b)) is not None and verb(a) != vb and a.split(".")[0] == "ops" and a not in above
                and vb not in OPS_VERBS.get(verb(a) or "", set())]
    assert not crossing, "a verb's package imports another's (move what they share to an ops module):\n  " + \
        "\n  ".join(crossing)
