"""The adversarial corpus through every command: refused, nothing run, nothing written, input untouched.

Each malicious file (``adversarial.py``, ≥ 30 of them) goes through ``load`` (library) and
``convert``, ``inspect``, ``verify``, ``diff`` and ``scan`` (CLI). A canary file the payload would
create and an audit hook prove nothing ran; exit codes are 1 (one ``Error:`` line naming the
unsafe globals) and 3 for ``scan``; the input is byte-identical afterwards and no output or temp
file is left. ``test_corpus_is_live`` shows every payload does run under plain ``pickle.loads``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import UnsafeCheckpointError
from tests import adversarial


NAMES = adversarial.case_names()
COMMANDS = ["load", "convert", "inspect", "verify", "diff", "scan"]


@dataclass
class Corpus:
    directory: Path
    cases: dict[str, adversarial.Case]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    directory = tmp_path_factory.mktemp("corpus")
    return Corpus(directory, {c.name: c for c in adversarial.build_corpus(directory)})


def test_corpus_is_large_enough() -> None:
    assert len(NAMES) >= 30 and len(set(NAMES)) == len(NAMES)


def _argv(command: str, path: Path, out: Path, benign: Path) -> list[str]:
    return {
        "convert": ["convert", str(path), str(out / "converted.safetensors")],
        "inspect": ["inspect", str(path)],
        "verify": ["verify", str(path), "--model", "torch.nn:Linear", "--arg", "in_features=4", "--arg", "out_features=2"],
        "diff": ["diff", str(path), str(benign)],
        "scan": ["scan", str(path)],
    }[command]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", NAMES)
def test_refused_and_nothing_runs(name: str, command: str, corpus: Corpus, cli_runner, tmp_path: Path,
                                  fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = corpus.cases[name]
    monkeypatch.syspath_prepend(str(corpus.directory))  # so importing the canary module *would* work
    before = case.path.read_bytes()
    listing = sorted(os.listdir(corpus.directory))
    out = tmp_path / "out"
    out.mkdir()
    with adversarial.audit_events() as events:
        if command == "load":
            with pytest.raises(UnsafeCheckpointError) as info:
                ckptfix.load(case.path)
            assert set(case.unsafe) <= set(info.value.globals)
            message = str(info.value)
        else:
            res = cli_runner.invoke(cli, _argv(command, case.path, out, fixtures_dir / "mlp_single.pth"))
            if command == "scan":
                assert res.exit_code == 3, res.output
                assert "UNSAFE" in res.stdout and not res.stderr
                message = res.stdout
            else:  # verify judges the file: refusing it is a finding, exit 3 (the other verbs: an error, exit 1)
                assert res.exit_code == (3 if command == "verify" else 1), res.output
                assert res.stdout == "" and res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1
                assert "Traceback" not in res.stderr
                message = res.stderr
    for global_name in case.unsafe:
        assert global_name in message
    if command != "scan":
        assert "refused" in message and "--trust" in message
    assert events == [], f"code ran: {events}"
    assert not case.canary.exists()
    assert adversarial.CANARY_MODULE not in sys.modules
    assert case.path.read_bytes() == before
    assert sorted(os.listdir(corpus.directory)) == listing and list(out.iterdir()) == []


def test_refusal_names_every_unsafe_global_sorted(corpus: Corpus) -> None:
    case = corpus.cases["importlib"]
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptfix.read(case.path)
    assert info.value.globals == ["builtins.getattr", "importlib.import_module"]
    assert "builtins.getattr, importlib.import_module" in str(info.value)


@pytest.mark.parametrize("name", adversarial.case_names(payloads_only=True))
def test_corpus_is_live(name: str, tmp_path: Path) -> None:
    """Plain pickle.loads of each payload really runs it: the refusals above are not luck.

    (Two cases are unsafe but inert, a whole pickled nn.Module and a ``torch.load`` global.)
    """
    case = next(c for c in adversarial.build_corpus(tmp_path) if c.name == name)
    assert not case.canary.exists()
    assert adversarial.detonate(case, tmp_path)
