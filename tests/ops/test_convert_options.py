"""Convert's options are declared once (ckptfix.ops.convert_options.ConvertOptions): ``ckptfix.convert``'s keywords,
``ckptfix convert``'s flags and what the command passes to the library all come from it."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import click
import pytest
import torch

import ckptfix
import ckptfix.ops.api
import ckptfix.text
from ckptfix.cli import cli
from ckptfix.core.devices import parse_cli_map_location
from ckptfix.ops.convert_options import ConvertOptions, flag_of

ROOT = Path(__file__).resolve().parents[2]
KEYWORDS = list(inspect.signature(ckptfix.convert).parameters)[2:]  # after src, dst
#: flags of ``ckptfix convert`` that are no keyword themselves: they build the model ``by_order`` takes
MODEL_FLAGS = {"--model", "--arg"}


def _command_options() -> list[click.Option]:
    return [p for p in cli.commands["convert"].params if isinstance(p, click.Option) and "--help" not in p.opts]


def test_each_keyword_has_one_flag_and_each_flag_one_keyword() -> None:
    assert KEYWORDS == [f.name for f in fields(ConvertOptions)]
    options = _command_options()
    claimed: dict[str, list[str]] = {}
    for f in fields(ConvertOptions):
        flag = flag_of(f)
        matching = [o for o in options if set(flag.decls) == set(o.opts) | set(o.secondary_opts)]
        assert len(matching) == 1, f"{f.name}: {flag.decls} is {len(matching)} options of `ckptfix convert`"
        claimed.setdefault(matching[0].opts[0], []).append(f.name)
    for option in options:
        if MODEL_FLAGS & set(option.opts):
            continue
        assert len(claimed.get(option.opts[0], [])) == 1, f"{option.opts}: keywords {claimed.get(option.opts[0])}"
    in_order = [o.opts[0] for o in options if not MODEL_FLAGS & set(o.opts)]
    assert in_order == [flag_of(f).decls[0] for f in fields(ConvertOptions)], "--help lists them in declaration order"
    assert {o.opts[0] for o in options if MODEL_FLAGS & set(o.opts)} == MODEL_FLAGS


class _Report:
    def to_dict(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keywords each ``ckptfix convert`` passes to the library (which does nothing)."""
    seen: list[dict[str, Any]] = []

    def fake_convert(src: Any, dst: Any, **kwargs: Any) -> _Report:
        seen.append(kwargs)
        return _Report()

    monkeypatch.setattr(ckptfix.ops.api, "convert", fake_convert)
    monkeypatch.setattr(ckptfix.text, "convert_text", lambda report: "converted")
    return seen


def test_the_command_passes_every_option(calls: list[dict[str, Any]], cli_runner: Any, fixtures_dir: Path) -> None:
    argv = ["convert", "a.pth", "b.pth", "--to", "ddp", "--map-location", "cuda:1=cpu", "--select", "ema",
            "--keep-extra", "--strip-prefix", "s", "--add-prefix", "p", "--format", "pth", "--max-shard-size", "5GB",
            "--rename", "a=b", "--rename", "c=d", "--by-order", "--model", f"{fixtures_dir / 'train.py'}:mlp",
            "--untie", "--dtype", "bf16", "--allow-overflow", "--dequantize", "--cast-unknown-quantized", "--hash",
            "--force", "-q", "--trust",
            "--allow", "myproj.Config", "--allow", "myproj.Mode", "--json", "--sign", "key.pem"]
    res = cli_runner.invoke(cli, argv)
    assert res.exit_code == 0, res.output
    (kwargs,) = calls
    assert isinstance(kwargs.pop("by_order"), torch.nn.Module)
    assert kwargs == dict(to="ddp", map_location=parse_cli_map_location(("cuda:1=cpu",)), select="ema", keep_extra=True,
                          strip_prefix="s", add_prefix="p", format="pth", max_shard_size="5GB", rename=("a=b", "c=d"),
                          untie=True, compact_ties=False, dtype="bf16", allow_overflow=True, dequantize=True,
                          cast_unknown_quantized=True, hash=True, force=True, progress=False, trust=True,
                          allow=("myproj.Config", "myproj.Mode"), checksums=True, sign="key.pem")
    assert sorted(kwargs) == sorted(set(KEYWORDS) - {"by_order"})


def test_the_command_defaults_are_the_library_defaults(calls: list[dict[str, Any]], cli_runner: Any) -> None:
    """Except progress (the command draws it unless -q) and checksums (on with --json)."""
    assert cli_runner.invoke(cli, ["convert", "a.pth", "b.pth"]).exit_code == 0
    defaults = {f.name: f.default for f in fields(ConvertOptions)}
    assert calls == [{**defaults, "progress": True}]


def test_json_reports_both_files_sha256(cli_runner: Any, fixtures_dir: Path, tmp_path: Path) -> None:
    """The one rule: convert's --json is also its checksums option (declared so, and said in --help)."""
    checksums = next(f for f in fields(ConvertOptions) if f.name == "checksums")
    assert flag_of(checksums).decls == ("--json",) and "SHA-256" in flag_of(checksums).help
    src, dst = fixtures_dir / "mlp_ddp.pth", tmp_path / "o.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(src), str(dst), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["sha256_in"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert report["sha256_out"] == hashlib.sha256(dst.read_bytes()).hexdigest()
    plain = ckptfix.convert(src, tmp_path / "p.safetensors").to_dict()
    assert plain["sha256_in"] is None and plain["sha256_out"] is None


def test_unknown_keyword_is_a_type_error(tmp_path: Path, fixtures_dir: Path) -> None:
    with pytest.raises(TypeError, match="hashed"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth", hashed=True)
    assert not (tmp_path / "o.pth").exists()


def test_library_md_shows_convert_s_signature() -> None:
    params = list(inspect.signature(ckptfix.convert).parameters.values())[2:]
    shown = ", ".join(f"{p.name}={p.default!r}" for p in params).replace("'", '"')
    line = next(line for line in (ROOT / "docs" / "library.md").read_text().splitlines() if line.startswith("- `convert("))
    assert re.fullmatch(r"- `convert\(src, dst, \*, (.*)\) -> ConvertReport`", line).group(1) == shown  # type: ignore[union-attr]


@pytest.mark.parametrize("options, dst, why", [
    ({}, "out.safetensors", None),
    ({"trust": True}, "out.safetensors", "--trust"),
    ({"dtype": "bf16"}, "out.pth", "--dtype bf16 (the cast)"),
    ({"by_order": torch.nn.Linear(2, 2, bias=False)}, "out.safetensors", "--by-order"),
    ({"format": "dcp"}, "out", "dcp output"),
    ({"torch_free": "0"}, "out.safetensors", "CKPTFIX_TORCH_FREE=0"),
])
def test_one_answer_says_why_a_conversion_needs_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      options: dict[str, Any], dst: str, why: str | None) -> None:
    """The planner takes the torch-free path exactly where the answer the URL refusal gives is None; it names an
    option by the flag ConvertOptions declares."""
    from safetensors.torch import save_file

    from ckptfix.core.torch_free import ENV_SWITCH
    from ckptfix.ops.convert import remote_convert, steps

    options = dict(options)
    if "torch_free" in options:
        monkeypatch.setenv(ENV_SWITCH, options.pop("torch_free"))
    save_file({"weight": torch.ones(2, 2)}, str(tmp_path / "m.safetensors"))
    req = steps.validate(str(tmp_path / "m.safetensors"), str(tmp_path / dst), ConvertOptions(**options))
    assert remote_convert.needs_torch(req) == why
    _ckpt, mode = steps.plan_read(req)
    assert (mode == steps.TORCH_FREE) == (why is None), mode
