"""``verify --exact`` observes the serving loader: a differential test of the gate against the plain loader over every
file the suite has, the issue's cases, the payloads that must never reach the loader, and a loader that crashes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.core import forked
from ckptfix.model import observe, observe_child
from ckptfix.model.spec import ModelSource, build_model
from tests import adversarial, hostile_files, malformed_files, observe_cases, quant_files

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"
FIXTURES = sorted(p.name for p in (ROOT / "fixtures").iterdir() if p.suffix in (".pth", ".pt", ".ckpt", ".tar",
                                                                               ".safetensors")
                  or p.is_dir() and p != quant_files.QUANT)


@pytest.fixture(autouse=True)
def forking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential tests observe with a forked child (the CLI's way) whatever threads earlier test modules
    left idle in this process (their servers); :func:`mode` runs a test both ways."""
    monkeypatch.setattr(forked, "can_fork", lambda: True)


@pytest.fixture(params=["fork", "spawn"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the loader's child starts: forked beside the gate (where it is safe), or a fresh interpreter."""
    monkeypatch.setattr(forked, "can_fork", lambda: request.param == "fork")
    return str(request.param)


def _verdict(path: Path, spec: str, **options: Any) -> tuple[int, str]:
    """What ``verify --exact`` exits with (0 ok, 3 a finding — a file refused as unsafe too —, 1 an error) and why."""
    try:
        report = ckptfix.verify(path, spec, exact=True, **options)
    except ckptfix.errors.UnsafeCheckpointError as e:
        return (3 if e.finding else 1), str(e)
    except ckptfix.errors.CkptfixError as e:
        return 1, str(e)
    return (0, "") if report.ok else (3, " | ".join(report.failures))


def _served(path: Path, spec: str, loader: str) -> dict[str, torch.Tensor]:
    """The named loader's own load of ``path``, strict, here in this process: the tensors it returned."""
    model = build_model(spec)
    if loader == "transformers":
        loaded, info = type(model).from_pretrained(path.parent, config=model.config, output_loading_info=True)
        assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
        return {k: v for k, v in loaded.state_dict().items() if k in ckptfix.read(path).state_dict}
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(path)
    else:
        sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd, strict=True)
    return sd


def _must_hold(path: Path, spec: str, loader: str = "torch") -> tuple[int, str]:
    """Exit 0 only where the loader really takes the file strictly, its tensors ckptfix's bit for bit; else 3 (or
    1, the file refused as unreadable or unsafe before any load) with the reason."""
    code, why = _verdict(path, spec, serving_loader=loader)
    if code == 0:
        mine = ckptfix.read(path).state_dict
        for key, t in _served(path, spec, loader).items():
            assert t.dtype == mine[key].dtype and t.shape == mine[key].shape and torch.equal(t, mine[key]), key
    else:
        assert code in (1, 3) and why.strip(), (code, why)
    return code, why


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures_pass_exact_only_where_the_plain_loader_takes_them(name: str) -> None:
    code, why = _must_hold(ROOT / "fixtures" / name, MLP_SPEC)
    passing = ("mlp_single.pth", "mlp_safetensors.safetensors", "mlp_legacy.pth", "mlp_fsdp2_full.pth")
    assert (code == 0) == (name in passing), why


@pytest.mark.parametrize("name", list(observe_cases.CASES))
def test_the_issue_cases_fail_exact_naming_why(name: str, tmp_path: Path) -> None:
    make, model, says = observe_cases.CASES[name]
    spec = MLP_SPEC if model is None else f"{observe_cases.models_file(tmp_path)}:{model}"
    code, why = _must_hold(make(tmp_path), spec)
    assert code == 3 and says in why, why


def test_a_save_pretrained_release_passes_with_the_transformers_loader(tmp_path: Path) -> None:
    path = observe_cases.CASES["save-pretrained-gpt2"][0](tmp_path)
    spec = f"{observe_cases.models_file(tmp_path)}:gpt2"
    assert _must_hold(path, spec, "transformers") == (0, "")
    report = ckptfix.verify(path, spec, exact=True, serving_loader="transformers")
    assert report.observed["ok"] and report.observed["transformers"] and report.observed["torch"] == torch.__version__
    assert report.observed["call"].startswith("type(model).from_pretrained(")


@pytest.mark.parametrize("case", hostile_files.CASES, ids=lambda c: c.name)
def test_hostile_files_never_pass_exact(case: Any, tmp_path: Path) -> None:
    assert _must_hold(case.make(tmp_path), MLP_SPEC)[0] != 0


@pytest.mark.parametrize("name", list(malformed_files.CASES))
def test_malformed_files_never_pass_exact(name: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.pth"
    path.write_bytes(malformed_files.CASES[name][0](tmp_path))
    assert _must_hold(path, MLP_SPEC)[0] != 0


def test_payloads_are_refused_before_any_loader_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The static scan refuses every code-running file (a finding: exit 3); the loader's process never sees one."""
    observed: list[str] = []
    monkeypatch.setattr(observe, "observe", lambda path, *a: observed.append(path))
    cases = adversarial.build_corpus(tmp_path / "corpus")
    for case in cases:
        code, why = _verdict(case.path, MLP_SPEC)
        assert code == 3 and why, (case.name, code)
    assert observed == [] and not [c.canary for c in cases if c.canary.exists()]


def test_an_os_system_in_metadata_never_reaches_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_metadata`` carrying an ``os.system`` reduce (ckptfix's read makes it an inert placeholder): the static scan
    fails the gate (exit 3) naming it, the loader's process never sees the file, the canary is never made."""
    observed: list[str] = []
    monkeypatch.setattr(observe, "observe", lambda path, *a: observed.append(path))
    canary = tmp_path / "canary"

    class Payload:
        def __reduce__(self) -> tuple:
            return os.system, (f"touch {canary}",)

    sd = torch.nn.Linear(2, 2).state_dict()
    sd._metadata[""]["evil"] = Payload()  # type: ignore[attr-defined]
    torch.save(sd, tmp_path / "evil.pth")
    code, why = _verdict(tmp_path / "evil.pth", MLP_SPEC)
    assert code == 3 and "system" in why and "not handed to the serving loader" in why  # posix.system, named
    assert observed == [] and not canary.exists()


CRASHES = {  # what the loader's child does instead of loading: (as a fresh interpreter, as a forked child), the finding
    "abort": ("import os; os.abort()", lambda: os.abort(), "killed by SIGABRT"),
    "exit": ("import os; os._exit(7)", lambda: os._exit(7), "exited with status 7"),
    "hang": ("import time; time.sleep(30)", lambda: time.sleep(30), "ran past its 1 s limit"),
}


@pytest.mark.parametrize("crash", list(CRASHES))
def test_a_loader_that_crashes_is_a_finding_not_a_crash(crash: str, mode: str, fixtures_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    code, call, says = CRASHES[crash]
    monkeypatch.setattr(observe, "child_command", lambda request, out: [sys.executable, "-c", code])
    monkeypatch.setattr(observe_child, "forked_child", lambda *args: call())
    monkeypatch.setattr(observe, "timeout_for", lambda size: 1.0)
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, exact=True, forward=False)
    assert not report.ok and report.observed["stage"] == "process"
    assert any(says in f and f.startswith("exact: the serving loader failed as saved") for f in report.failures)


def test_a_gate_that_stops_early_ends_its_child(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step after the fork raises (here the model's build): the forked child is killed and reaped, not left."""
    monkeypatch.setattr(forked, "can_fork", lambda: True)
    children: list[forked.Child] = []
    real = forked.start
    monkeypatch.setattr(forked, "start", lambda work: children.append(real(lambda: time.sleep(30))) or children[-1])
    monkeypatch.setattr(ModelSource, "structure", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, exact=True)
    assert len(children) == 1 and children[0].done is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(children[0].pid, os.WNOHANG)  # reaped already: no zombie left behind
    assert not os.path.exists(children[0].tmp)


def test_a_reader_that_parts_from_the_loader_is_a_finding(mode: str, fixtures_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real = observe_child.digest
    monkeypatch.setattr(observe_child, "digest", lambda t: [*real(t)[:3], "0" * 64])  # one side hashed wrong
    monkeypatch.setattr(observe_child, "same_bytes", lambda a, b: False)  # a forked child's bytes differ
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, exact=True)
    assert not report.ok and any("6 tensor(s) differ" in f and "ckptfix reader bug" in f for f in report.failures)
    assert report.observed["seconds"] > 0


def test_the_json_records_the_observation(mode: str, cli_runner: Any, fixtures_dir: Path) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--exact", "--json"])
    observed = json.loads(res.stdout)["observed"]
    assert res.exit_code == 0 and observed["ok"] and observed["torch"] == torch.__version__
    assert observed["call"] == "torch.load(PATH, weights_only=True, mmap=True) + load_state_dict(strict=True)"
    assert observed["seconds"] > 0 and set(observed) >= {"transformers", "safetensors", "stage", "error"}


def test_serving_loader_goes_with_exact(cli_runner: Any, fixtures_dir: Path) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC,
                                  "--serving-loader", "transformers"])
    assert res.exit_code == 2 and "--serving-loader goes with --exact" in res.output


def test_the_transformers_loader_without_transformers_is_one_error_line(cli_runner: Any, fixtures_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, "--exact",
                                  "--serving-loader", "transformers", "--quiet"])
    assert res.exit_code == 1 and "transformers is not installed" in res.output
    assert len(res.output.strip().splitlines()) == 1
