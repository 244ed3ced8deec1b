"""Every recipe README.md shows runs, on real files, and ends as documented.

The shell lines of README's code blocks (``ckptfix …``, ``$ ckptfix …``, ``make …``), the ``run:``
script of its CI example and its Python library examples are read from the README itself; each runs in
a fresh directory holding the files it names, made from the committed fixtures or generated here (the
table RECIPES in readme_recipes.py: README placeholder → how it is made, expected exit code, what else
to check). A README command missing from the table fails (a recipe nobody executes is a promise nobody
checked), and so does a table entry the README no longer shows. ``ckptfix`` lines run through the CLI in this process
(``shlex`` splits them as the shell would); ``make`` and the CI script run in a real shell.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix.cli import cli
from readme_recipes import MAKERS, RECIPES, Entry
from test_lightning_dirs import sharded_run  # noqa: F401 - the real Lightning sharded directory, a fixture

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SHELLS = ("", "sh", "bash", "shell", "console")


# ------------------------------------------------------------------------------------- README parsing


@dataclass(frozen=True)
class Recipe:
    """One command (or Python example) as README shows it: its key and, for ``$ cmd`` lines, the output shown."""

    key: str  # the command as the shell splits it (comment dropped), or a Python block's first line
    text: str  # as written
    line: int
    kind: str  # "ckptfix", "make", "ci" (a workflow's run: script), "python"
    shown_output: tuple[str, ...] = ()


def _blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """Fenced code blocks: (language, first line number, lines)."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), n + 1, []
            else:
                out.append((lang, start, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def readme_recipes(text: str | None = None) -> list[Recipe]:
    text = README.read_text() if text is None else text
    recipes: list[Recipe] = []
    for lang, start, body in _blocks(text):
        if lang == "python":
            first = next(line for line in body if line.strip() and not line.startswith("import "))
            recipes.append(Recipe(first.split("#")[0].strip(), "\n".join(body), start, "python"))
        elif lang == "yaml":
            recipes += _ci_scripts(body, start)
        elif lang in SHELLS:
            recipes += _shell_lines(body, start)
    return recipes


def _shell_lines(body: list[str], start: int) -> list[Recipe]:
    out: list[Recipe] = []
    i = 0
    while i < len(body):
        line, n = body[i], start + i
        while line.endswith("\\") and i + 1 < len(body):  # continuation lines
            i += 1
            line = line[:-1] + " " + body[i].strip()
        i += 1
        prompt = line.startswith("$ ")
        command = line[2:] if prompt else line
        if not command.startswith(("ckptfix ", "make ")):
            continue
        shown: list[str] = []
        while prompt and i < len(body) and body[i].strip() and not body[i].startswith("$ "):
            shown.append(body[i])
            i += 1
        key = " ".join(shlex.split(command, comments=True))
        out.append(Recipe(key, command, n, key.split()[0], tuple(shown)))
    return out


def _ci_scripts(body: list[str], start: int) -> list[Recipe]:
    """Each ``run: |`` script of a workflow example."""
    out = []
    for i, line in enumerate(body):
        if line.strip() == "run: |":
            indent = len(line) - len(line.lstrip())
            script = []
            for more in body[i + 1:]:
                if more.strip() and len(more) - len(more.lstrip()) <= indent:
                    break
                script.append(more)
            script_text = textwrap.dedent("\n".join(script)).strip("\n")
            joined = script_text.replace("\\\n", " ")  # continuation lines
            key = next(s for s in joined.splitlines() if s.lstrip().startswith("ckptfix "))
            out.append(Recipe(" ".join(shlex.split(key, comments=True)), script_text, start + i, "ci"))
    return out


# ------------------------------------------------------------------------------------- the tests


RECIPES_IN_README = readme_recipes()


def test_every_readme_recipe_is_in_the_table_and_back() -> None:
    keys = [r.key for r in RECIPES_IN_README]
    missing = [f"README.md:{r.line}: {r.key}" for r in RECIPES_IN_README if r.key not in RECIPES]
    assert missing == [], "README recipes no test runs (add them to tests/test_readme.py RECIPES):\n" + "\n".join(missing)
    assert [k for k in RECIPES if k not in keys] == [], "RECIPES entries the README no longer shows"
    assert {r.kind for r in RECIPES_IN_README} == {"ckptfix", "make", "ci", "python"}


def test_parsing_finds_prompts_outputs_continuations_and_ci_scripts() -> None:
    text = textwrap.dedent("""\
        ```
        ckptfix convert a.pth 'b c.pth' --rename 'x\\.(.*)=y.\\1'   # a comment
        make demo    # trains
        not a command
        $ ckptfix inspect m.pth
        Error: m.pth: refused
        ```

        ```python
        import ckptfix

        sd = ckptfix.load("x.pth")    # a comment
        ```

        ```yaml
        - name: gate
          run: |
            ckptfix verify a.pth --model m:b \\
                --json > v.json
            echo done
        ```
        """)
    got = [(r.kind, r.key, r.line, r.shown_output) for r in readme_recipes(text)]
    assert got == [("ckptfix", r"ckptfix convert a.pth b c.pth --rename x\.(.*)=y.\1", 2, ()),
                   ("make", "make demo", 3, ()),
                   ("ckptfix", "ckptfix inspect m.pth", 5, ("Error: m.pth: refused",)),
                   ("python", 'sd = ckptfix.load("x.pth")', 10, ()),
                   ("ci", "ckptfix verify a.pth --model m:b --json > v.json", 17, ())]


def _make_files(tmp: Path, files: dict[str, str], request: pytest.FixtureRequest) -> None:
    for placeholder, how in files.items():  # in order: parent directories first
        MAKERS[how](tmp / placeholder.rstrip("/"), request)


def _expected_code(entry: Entry) -> int:
    return entry.code() if callable(entry.code) else entry.code


def _shell_env(tmp: Path, entry: Entry) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if entry.env_path:
        env["PYTHONPATH"] = os.pathsep.join([str(tmp), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@pytest.mark.parametrize("recipe", RECIPES_IN_README, ids=[f"L{r.line}:{r.key[:60]}" for r in RECIPES_IN_README])
def test_readme_recipe_runs(recipe: Recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            request: pytest.FixtureRequest) -> None:
    entry = RECIPES.get(recipe.key)
    assert entry is not None, f"README.md:{recipe.line}: {recipe.key!r} is run by no test: add it to RECIPES"
    _make_files(tmp_path, entry.files, request)
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, name)  # each run imports its own directory's mypkg
    if entry.env_path:
        monkeypatch.syspath_prepend(str(tmp_path))
    result: Any
    if recipe.kind == "python":
        # the blocks read as one session: `import ckptfix` is in the first; `model` is the user's network
        namespace = {"ckptfix": ckptfix, "model": request.getfixturevalue("train").mlp()}
        exec(compile(recipe.text, f"README.md:{recipe.line}", "exec"), namespace)
        result = namespace
    elif recipe.kind == "ckptfix":
        from click.testing import CliRunner

        result = CliRunner().invoke(cli, shlex.split(recipe.text, comments=True)[1:], prog_name="ckptfix")
        assert result.exit_code == _expected_code(entry), result.output
        if result.exit_code != 0:  # an error is one line, no traceback
            assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("Error: "), result.stderr
        if recipe.shown_output:
            assert result.output.strip().splitlines() == list(recipe.shown_output)
    elif recipe.kind == "make":
        command = [*shlex.split(recipe.text, comments=True), *entry.make_args, f"DEMO_DIR={tmp_path / 'demo-out'}"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                env=_shell_env(tmp_path, entry))
        assert result.returncode == _expected_code(entry), result.stdout[-3000:] + result.stderr[-3000:]
        assert "pip install" not in result.stdout  # the venv was there: nothing was downloaded
        if "-n" in entry.make_args:
            assert re.search(r"^\S*python -m pytest$", result.stdout, re.M), result.stdout
    else:  # a CI workflow's run: script, as GitHub runs it (bash -e)
        if shutil.which("jq") is None:
            pytest.skip("the workflow's script uses jq, which is not installed here")
        result = subprocess.run(["bash", "-e", "-c", recipe.text], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env=_shell_env(tmp_path, entry))
        assert result.returncode == _expected_code(entry), result.stdout + result.stderr
    if entry.check is not None:
        assert entry.check(tmp_path, result), "the recipe ran, but its result is not what README says it is"
