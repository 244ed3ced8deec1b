"""The public bypasses of 2025–26 (``tests/bypasses.py``) through ``scan``, ``load``, ``convert`` and ``verify``.

Each file is refused (by the globals it names, or as what it is: ambiguous, compressed, no checkpoint) or read
with its payload as inert data; nothing runs (a canary and an audit hook), nothing crashes ("a bug in
ckptfix"), and ckptfix is never weaker than ``torch.load(weights_only=True)``. ``test_control_is_live``
shows each payload does run under plain ``pickle.loads`` or ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.core import limits
from ckptfix.errors import FormatError, UnsafeCheckpointError
from tests import adversarial, bypasses

NAMES = bypasses.case_names()
VERIFY = ["--model", "torch.nn:Linear", "--arg", "in_features=4", "--arg", "out_features=2"]


@dataclass
class Corpus:
    directory: Path
    cases: dict[str, bypasses.Bypass]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    directory = tmp_path_factory.mktemp("bypasses")
    return Corpus(directory, {c.name: c for c in bypasses.build_bypasses(directory)})


def _torch_weights_only(path: Path) -> object:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal of torch's is the answer
        return e


@pytest.mark.parametrize("name", NAMES)
def test_scan_names_what_runs(name: str, corpus: Corpus, cli_runner) -> None:
    case = corpus.cases[name]
    report = ckptfix.scan(case.path)
    assert set(case.unsafe) <= set(report.unsafe_globals), report.to_dict()
    assert {"unsafe-global", *case.kinds} <= {f.kind for f in report.findings} if case.unsafe else True
    res = cli_runner.invoke(cli, ["scan", str(case.path)])
    assert res.exit_code == (3 if not report.ok else 0), res.output
    assert not case.canary.exists()


@pytest.mark.parametrize("verb", ["load", "convert", "verify", "verify-exact"])
@pytest.mark.parametrize("name", NAMES)
def test_refused_or_inert(name: str, verb: str, corpus: Corpus, cli_runner, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    case = corpus.cases[name]
    monkeypatch.syspath_prepend(str(corpus.directory))  # so importing the payload's module *would* work
    before = case.path.read_bytes()
    with adversarial.audit_events() as events:
        if verb == "load":
            try:
                ckptfix.load(case.path)
                message, code = "", 0
            except (UnsafeCheckpointError, FormatError) as e:
                message, code = str(e), 1
        else:
            argv = (["convert", str(case.path), str(tmp_path / "out.safetensors")] if verb == "convert"
                    else ["verify", str(case.path), *VERIFY, *(["--exact"] if verb == "verify-exact" else [])])
            res = cli_runner.invoke(cli, argv)
            code, message = res.exit_code, res.stderr
            assert code in (0, 1, 3), res.output
            if code == 1:
                assert res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "a bug in ckptfix" not in message and "Traceback" not in message
    if case.refusal is not None:
        assert code == 1 and case.refusal in message, message
    elif case.live and code == 1:
        assert "refused" in message, message  # by the globals it names, or by what it does with an allowed one
        assert all(g in message for g in case.unsafe) or "BUILD of a argparse.Namespace" in message, message
    assert events == [], f"code ran: {events}"
    assert not case.canary.exists()
    assert bypasses.BOOM_MODULE not in sys.modules
    assert case.path.read_bytes() == before


@pytest.mark.parametrize("name", NAMES)
def test_never_weaker_than_torch_weights_only(name: str, corpus: Corpus) -> None:
    """What torch's weights-only loader refuses, ckptfix refuses or reads without the payload (its state dict
    holds tensors only); what it loads, ckptfix loads to the same tensors or refuses with a finding."""
    case = corpus.cases[name]
    theirs = _torch_weights_only(case.path)
    try:
        ours = ckptfix.load(case.path)
    except (UnsafeCheckpointError, FormatError):
        assert not isinstance(theirs, Exception) or case.live
        if not isinstance(theirs, Exception):
            assert not ckptfix.scan(case.path).ok  # refused only for a reason scan reports
        return
    assert all(isinstance(v, torch.Tensor) for v in ours.values())
    if not isinstance(theirs, Exception):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not case.canary.exists()


@pytest.mark.parametrize("name", [c for c in NAMES if not c.endswith("-benign")])
def test_control_is_live(name: str, tmp_path: Path) -> None:
    """The payload runs under plain pickle.loads / torch.load(weights_only=False), in a throwaway process."""
    case = next(c for c in bypasses.build_bypasses(tmp_path) if c.name == name)
    assert case.live and not case.canary.exists()
    assert bypasses.detonate(case, tmp_path)


def test_polyglot_is_safetensors_too(corpus: Corpus) -> None:
    """The polyglot is a real one: safetensors' own loader reads it."""
    from safetensors.torch import load_file

    case = corpus.cases["safetensors-pickle-polyglot"]
    assert torch.equal(load_file(case.path)["weight"], torch.arange(4.0))


@pytest.mark.parametrize("compress", [gzip.compress, lzma.compress, bz2.compress])
def test_compressed_scan_is_bounded(compress: Callable[[bytes], bytes], tmp_path: Path) -> None:
    """A compressed file that inflates past max_pickle_bytes is a finding, not read whole."""
    path = tmp_path / "bomb.pt.gz"
    path.write_bytes(compress(b"\x80\x02" + bytes(4 << 20)))
    with limits.override(max_pickle_bytes=1 << 20):
        report = ckptfix.scan(path)
    assert [f.kind for f in report.findings] == ["resource-limit"]
    assert "max_pickle_bytes" in report.findings[0].message
