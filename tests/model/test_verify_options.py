"""Verify's options are declared once (ckptfix.model.verify_options.VerifyOptions): ``ckptfix.verify``'s keywords,
``ckptfix verify``'s flags, what the command passes to the library, and the rules of what the options must be."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import click
import pytest

import ckptfix
import ckptfix.model.verify
from ckptfix.cli import cli
from ckptfix.cli.options import verify_kwargs, verify_options
from ckptfix.core.devices import parse_cli_map_location
from ckptfix.model import verify_options as declared
from ckptfix.model.verify_options import INPUT_SEED, VerifyOptions
from ckptfix.ops.convert_options import Flag, flag_of, option

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"

#: ``ckptfix.verify``'s signature before its options were declared once: users' calls keep working as they were
#: (issue 28: ``model`` may be left out, the model-free gate; ``original`` added at the end; issue 30: the Sigstore
#: signer's three after it)
SIGNATURE = (
    "(path: 'Any', model: 'Any' = None, reference: 'Any' = None, exact: 'bool' = False, forward: 'bool' = True, "
    "atol: 'float | None' = None, rtol: 'float | None' = None, input_shape: 'tuple[int, ...] | None' = None, "
    "model_args: 'dict[str, Any] | None' = None, map_location: 'Any' = 'cpu', select: 'str' = 'auto', "
    "trust: 'bool' = False, seed: 'int' = 1234, checksum: 'bool' = True, dtype: 'Any' = None, "
    "input_dtype: 'str | None' = None, input_range: 'tuple[float, float] | None' = None, inputs: 'Any' = None, "
    "golden: 'Any' = None, record_golden: 'bool' = False, serving_device: 'str | None' = None, "
    "progress: 'bool' = False, structure_only: 'bool' = False, serving_loader: 'str' = 'torch', "
    "signature: 'Any' = None, public_key: 'Any' = None, certificate_chain: 'tuple[Any, ...]' = (), original: 'Any' = None, "
    "sigstore_identity: 'str | None' = None, sigstore_issuer: 'str | None' = None, trust_config: 'Any' = None) "
    "-> 'VerifyReport'")
#: keywords the command line has no flag for
LIBRARY_ONLY = {"seed"}


def _command_options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and "--help" not in p.opts]


def test_the_signature_is_the_one_users_call() -> None:
    assert str(inspect.signature(ckptfix.verify)) == SIGNATURE
    assert list(inspect.signature(ckptfix.verify).parameters)[2:] == [f.name for f in fields(VerifyOptions)]


def test_a_positional_call_binds_as_before(fixtures_dir: Path) -> None:
    """reference, exact, forward: the third to fifth parameters, by position."""
    report = ckptfix.verify(fixtures_dir / "mlp_ddp.pth", MLP_SPEC, None, False, False)
    assert report.ok and report.forward is None and report.notes[-1].startswith("no forward check (--no-forward)")
    with pytest.raises(TypeError):
        ckptfix.verify(fixtures_dir / "mlp_ddp.pth", MLP_SPEC, None, exact=False, reference=None)


def test_each_flag_is_one_field_in_help_order() -> None:
    options = _command_options(cli.commands["verify"])
    flagged = list(declared.flagged())
    assert {f.name for f in fields(VerifyOptions)} - {f.name for f in flagged} == LIBRARY_ONLY
    assert [o.opts[0] for o in options] == ["--model"] + [flag_of(f).decls[0] for f in flagged]
    assert [o.name for o in options[1:]] == [flag_of(f).dest or f.name for f in flagged]
    assert [f.name for f in flagged] == list(declared.HELP_ORDER), "every flag has its place in --help"


def test_a_field_added_is_a_flag_and_a_keyword(monkeypatch: pytest.MonkeyPatch, cli_runner: Any) -> None:
    @dataclass(frozen=True)
    class Wider(VerifyOptions):
        strict_names: bool = option(False, Flag(("--strict-names",), is_flag=True, help="Fail on any renamed key."))

    monkeypatch.setattr(declared, "VerifyOptions", Wider)
    seen: list[dict[str, Any]] = []

    @click.command()
    @click.argument("path")
    @verify_options
    def command(path: str, model_spec: str, **values: Any) -> None:
        seen.append(verify_kwargs(values))

    assert "--strict-names" in cli_runner.invoke(command, ["--help"]).output
    res = cli_runner.invoke(command, ["x.pth", "--model", "m:f", "--strict-names"])
    assert res.exit_code == 0, res.output
    assert seen[0]["strict_names"] is True and Wider(**seen[0]).strict_names


class _Report:
    ok = True

    def to_dict(self) -> dict[str, Any]:
        return {}

    def format_text(self) -> str:
        return "verified"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any, dict[str, Any]]]:
    """What each ``ckptfix verify`` passes to the library (which does nothing)."""
    seen: list[tuple[Any, Any, dict[str, Any]]] = []

    def fake_verify(path: Any, model: Any, **kwargs: Any) -> _Report:
        seen.append((path, model, kwargs))
        return _Report()

    monkeypatch.setattr(ckptfix.model.verify, "verify", fake_verify)
    return seen


def test_the_command_passes_every_option(calls: list[Any], cli_runner: Any, tmp_path: Path) -> None:
    argv = ["verify", "a.pth", "--model", "m:f", "--arg", "n=3", "--arg", "name=x", "--exact", "--serving-device", "cpu",
            "--reference", "r.pth", "--input-shape", "2x13", "--input-dtype", "long", "--input-range", "-1,1",
            "--golden", "g.safetensors", "--record-golden", "--dtype", "bf16", "--atol", "0.5",
            "--rtol", "0.25", "--no-forward", "--map-location", "cuda:1=cpu", "--select", "ema", "--trust", "--json",
            "--structure-only", "--quiet", "--signature", "s.sig", "--public-key", "p.pem", "--original", "o.safetensors"]
    res = cli_runner.invoke(cli, argv)
    assert res.exit_code == 0, res.output
    ((path, model, kwargs),) = calls
    assert (path, model) == ("a.pth", "m:f")
    assert kwargs == dict(model_args={"n": 3, "name": "x"}, exact=True, serving_device="cpu", reference="r.pth",
                          input_shape=(2, 13), input_dtype="long", input_range=(-1.0, 1.0), inputs=None,
                          golden="g.safetensors", record_golden=True, dtype="bf16", atol=0.5, rtol=0.25, forward=False,
                          map_location=parse_cli_map_location(("cuda:1=cpu",)), select="ema", trust=True, checksum=True,
                          progress=False, structure_only=True, serving_loader="torch", signature="s.sig",
                          public_key="p.pem", certificate_chain=(), original="o.safetensors",
                          sigstore_identity=None, sigstore_issuer=None, trust_config=None)
    # --input alone (it gives the tensors that --input-shape, --input-dtype and --input-range would describe)
    assert cli_runner.invoke(cli, ["verify", "a.pth", "--model", "m:f", "--input", "i.pt"]).exit_code == 0
    assert calls[1][2]["inputs"] == "i.pt"


def test_the_command_defaults_are_the_library_defaults(calls: list[Any], cli_runner: Any) -> None:
    """Except model_args (the parsed --arg list: empty), progress (the command draws it) and checksum (--json)."""
    assert cli_runner.invoke(cli, ["verify", "a.pth", "--model", "m:f"]).exit_code == 0
    defaults = {f.name: f.default for f in fields(VerifyOptions) if f.name != "seed"}
    assert calls[0][2] == {**defaults, "model_args": {}, "progress": True, "checksum": False}
    assert VerifyOptions().seed == INPUT_SEED


@pytest.mark.parametrize("keywords, argv, error, message, usage", [
    (dict(record_golden=True), ["--record-golden"], ckptfix.errors.GoldenError,
     "record_golden needs golden=PATH (--golden PATH): where to write the outputs", "--record-golden needs --golden FILE"),
    (dict(serving_device="cpu"), ["--serving-device", "cpu"], ckptfix.errors.DeviceError,
     "serving_device='cpu' (--serving-device) is what --exact's plain load is checked against: pass exact=True "
     "(--exact) too", "--serving-device goes with --exact (the plain load it checks)"),
    *[(dict(exact=True, serving_device=dev), ["--exact", "--serving-device", dev], ckptfix.errors.DeviceError,
       f"serving device {dev!r} (--serving-device) is not a device the serving code loads on: use cpu, cuda or cuda:N",
       f"--serving-device {dev!r} is not a device the serving code loads on: use cpu, cuda or cuda:N")
      for dev in ("gpu0", "meta")],
    (dict(inputs=str(ROOT / "fixtures" / "mlp_single.pth"), input_dtype="long"),
     ["--input", str(ROOT / "fixtures" / "mlp_single.pth"), "--input-dtype", "long"], ckptfix.errors.InputError,
     "--input gives the tensors themselves; drop --input-shape, --input-dtype and --input-range",
     "--input gives the tensors themselves; drop --input-shape, --input-dtype and --input-range"),
], ids=["record-golden", "serving-device", "serving-device-gpu0", "serving-device-meta", "input-and-recipe"])
def test_option_errors_come_before_any_read(keywords: dict[str, Any], argv: list[str], error: type, message: str, usage: str,
                                  cli_runner: Any, fixtures_dir: Path) -> None:
    """One rule each (alone or together), checked when the options are made: the library's error, the command line's
    usage line (exit 2), before any value is parsed or any file read (the checkpoint is missing)."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        VerifyOptions(**keywords)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ckptfix.verify(fixtures_dir / "missing.pth", MLP_SPEC, **keywords)
    base = ["verify", str(fixtures_dir / "missing.pth"), "--model", MLP_SPEC, "--input-shape", "not-a-shape", *argv]
    res = cli_runner.invoke(cli, base)
    assert res.exit_code == 2 and res.output.endswith(f"Error: {usage}\n"), res.output
    res = cli_runner.invoke(cli, [*base, "--json"])
    assert res.exit_code == 2 and json.loads(res.stdout) == {"error": usage, "error_type": "UsageError", "exit_code": 2}


@pytest.mark.parametrize("spec, why", [("no_such_module_ckptfix:build", "can't import 'no_such_module_ckptfix'"),
                                       ("fixtures/no_such_file.py:build", "no such file"),
                                       (f"{ROOT / 'fixtures' / 'train.py'}:no_such_builder", "has no attribute"),
                                       ("no-colon", "expected torchvision:NAME")])
def test_a_model_spec_naming_nothing_fails_before_any_read(spec: str, why: str, cli_runner: Any,
                                                           fixtures_dir: Path) -> None:
    """The builder is found (not called) before the checkpoint is read: its error, not the missing file's."""
    with pytest.raises(ckptfix.errors.ModelSpecError, match=f"^model spec {re.escape(repr(spec))}: .*{re.escape(why)}"):
        ckptfix.verify(fixtures_dir / "missing.pth", spec, exact=True)
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "missing.pth"), "--model", spec, "--exact"])
    assert res.exit_code == 1 and res.stderr == f"Error: {res.stderr[7:]}" and res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"Error: model spec {spec!r}: "), res.stderr
