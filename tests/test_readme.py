"""Every recipe README.md and docs/*.md show runs, on real files, and ends as documented.

The shell lines of their code blocks (``ckptfix …``, ``$ ckptfix …``, ``make …``), the ``run:`` script
of a CI example, the Python library examples and the ``ckptfix …`` commands their prose shows inline
(real arguments, not a synopsis with PATH or […]) are read from the documents themselves; each runs in
a fresh directory holding the files it names, made from the committed fixtures or generated here (the
table RECIPES in readme_recipes.py: placeholder → how it is made, expected exit code, what else to
check). A command shown in README or docs but missing from the table fails (a recipe nobody executes is
a promise nobody checked), and so does a table entry no document shows any more. A command shown in
several documents runs once. ``ckptfix`` lines run through the CLI in this process (``shlex`` splits
them as the shell would); ``make`` and the CI script run in a real shell. ``text`` blocks (docs/cli.md's
generated ``--help`` output) are output, not commands: never run. docs/cli.md itself must be what
docs/gen_cli.py writes, and every relative link in the documents must lead to a file and heading.
"""

from __future__ import annotations

import importlib.util
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
from tests.lightning_run import sharded_run  # noqa: F401 - the real Lightning sharded directory, a fixture
from tests.readme_recipes import MAKERS, RECIPES, Entry
from tests.remote_servers import s3_server  # noqa: F401 - moto's S3 server, a fixture (readme_recipes' _on_s3)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_MD = DOCS / "cli.md"
SHELLS = ("", "sh", "bash", "shell", "console")


def documents() -> list[Path]:
    """README.md, then every docs/*.md: the documents whose commands must run."""
    return [README, *sorted(DOCS.glob("*.md"))]


# ------------------------------------------------------------------------------------- README parsing


@dataclass(frozen=True)
class Recipe:
    """One command (or Python example) as a document shows it: its key and, for ``$ cmd`` lines, the output shown."""

    key: str  # the command as the shell splits it (comment dropped), or a Python block's first line
    text: str  # as written
    line: int
    kind: str  # "ckptfix", "make", "ci" (a workflow's run: script), "python"
    shown_output: tuple[str, ...] = ()
    doc: str = "README.md"  # the document showing it, relative to the repository root

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def run_as(self) -> tuple[str, ...]:
        """What running it depends on: equal for the same recipe shown twice (README and a docs page)."""
        if self.kind in ("python", "ci"):
            return (self.kind, self.text)
        return (self.kind, self.key, *self.shown_output)


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


def readme_recipes(text: str | None = None, doc: str = "README.md") -> list[Recipe]:
    """The recipes of one document (README.md unless ``text`` is given), in order."""
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
    recipes += _inline_commands(text)
    return [Recipe(r.key, r.text, r.line, r.kind, r.shown_output, doc) for r in recipes]


_PLACEHOLDER = re.compile(r"…|\[|\b[A-Z][A-Z_]{1,}\b")  # a synopsis (PATH, SRC, [--json], …), not a command


def _inline_commands(text: str) -> list[Recipe]:
    """``ckptfix …`` commands shown inline in prose (outside fenced blocks) with real arguments: run too.
    A bare subcommand name (`ckptfix scan`) or a synopsis with placeholders is a name, not a recipe."""
    out: list[Recipe] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in re.finditer(r"`(ckptfix [^`]+)`", line):
            command = m.group(1)
            if len(shlex.split(command)) > 2 and not _PLACEHOLDER.search(command):
                out.append(Recipe(" ".join(shlex.split(command)), command, n, "ckptfix"))
    return out


def all_recipes() -> list[Recipe]:
    """Every recipe README.md and docs/*.md show."""
    return [r for path in documents() for r in readme_recipes(path.read_text(), str(path.relative_to(ROOT)))]


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


RECIPES_IN_DOCS = all_recipes()
_FIRST_SHOWN: dict[tuple[str, ...], Recipe] = {}
for _recipe in RECIPES_IN_DOCS:
    _FIRST_SHOWN.setdefault(_recipe.run_as, _recipe)
RECIPES_TO_RUN = list(_FIRST_SHOWN.values())  # a recipe shown in README and a docs page runs once


def test_every_readme_recipe_is_in_the_table_and_back() -> None:
    keys = [r.key for r in RECIPES_IN_DOCS]
    missing = [f"{r.where}: {r.key}" for r in RECIPES_IN_DOCS if r.key not in RECIPES]
    assert missing == [], ("recipes README/docs show that no test runs (add them to tests/readme_recipes.py "
                           "RECIPES):\n" + "\n".join(missing))
    assert [k for k in RECIPES if k not in keys] == [], "RECIPES entries neither README nor docs show any more"
    assert {r.kind for r in RECIPES_IN_DOCS} == {"ckptfix", "make", "ci", "python"}
    assert {r.doc for r in RECIPES_IN_DOCS} >= {"README.md", "docs/convert.md", "docs/verify.md", "docs/formats.md",
                                                "docs/library.md", "docs/security.md"}
    assert [r.key for r in RECIPES_TO_RUN if r.kind == "python"] == list(dict.fromkeys(
        r.key for r in RECIPES_IN_DOCS if r.kind == "python")), "two different Python examples share a first line"


def test_cli_md_is_generated_from_help() -> None:
    """docs/cli.md is docs/gen_cli.py's output for the CLI as it is now, its help in ``text`` blocks."""
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    want = gen_cli.render()
    assert CLI_MD.is_file() and CLI_MD.read_text() == want, "docs/cli.md is stale: run .venv/bin/python docs/gen_cli.py"
    blocks = _blocks(want)
    assert {lang for lang, _, _ in blocks} == {"text"} and len(blocks) == len(cli.commands) + 1
    for name in cli.commands:
        assert f"## ckptfix {name}\n" in want and f"Usage: ckptfix {name} [OPTIONS]" in want, name
    assert readme_recipes(want, "docs/cli.md") == []  # help output is never run as a command


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_documents_resolve() -> None:
    """Every relative link in README.md and docs/*.md names a file that exists and, with #anchor, a heading in it."""
    broken = []
    for path in documents():
        text = path.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = [_slug(h.lstrip("#")) for h in dest.read_text().splitlines() if re.match(r"#{1,6} ", h)]
                if anchor not in headings:
                    broken.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    assert broken == [], "\n".join(broken)


def test_readme_stays_short_and_points_to_every_doc() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) <= 170, "README.md is the short entry point: details belong in docs/"
    for path in sorted(DOCS.glob("*.md")):
        assert f"](docs/{path.name})" in readme, f"README.md does not link docs/{path.name}"


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


@pytest.mark.parametrize("recipe", RECIPES_TO_RUN, ids=[f"{r.doc.removeprefix('docs/')}:{r.line}:{r.key[:60]}"
                                                      for r in RECIPES_TO_RUN])
def test_readme_recipe_runs(recipe: Recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            request: pytest.FixtureRequest) -> None:
    entry = RECIPES.get(recipe.key)
    assert entry is not None, f"{recipe.where}: {recipe.key!r} is run by no test: add it to RECIPES"
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
        exec(compile(recipe.text, recipe.where, "exec"), namespace)
        result = namespace
    elif recipe.kind == "ckptfix":
        from click.testing import CliRunner

        result = CliRunner().invoke(cli, shlex.split(recipe.text, comments=True)[1:], prog_name="ckptfix")
        assert result.exit_code == _expected_code(entry), result.output
        if result.exit_code not in (0, 3):  # an error is one line, no traceback (3 is a finding, reported on stdout)
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
            assert re.search(r"^\S*python -m pytest -n auto --dist loadfile$", result.stdout, re.M), result.stdout
    else:  # a CI workflow's run: script, as GitHub runs it (bash -e)
        if shutil.which("jq") is None:
            pytest.skip("the workflow's script uses jq, which is not installed here")
        result = subprocess.run(["bash", "-e", "-c", recipe.text], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env=_shell_env(tmp_path, entry))
        assert result.returncode == _expected_code(entry), result.stdout + result.stderr
    if entry.check is not None:
        assert entry.check(tmp_path, result), f"{recipe.where}: the recipe ran, but its result is not what the docs say it is"
