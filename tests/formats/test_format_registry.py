"""The format registry (``ckptfix.parse.format_registry``) says what each format can do; these check it is so.

- sniffing names only registered formats;
- each family module has the verbs its formats' abilities promise;
- each format's scanner is one of the scanner table's, and each of the table's scans is used;
- each writable format round-trips a small state dict, bit for bit;
- each describable format is described without importing torch (a subprocess probe);
- a read parses a torch zip's central directory once (convert and inspect of a small .pth).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix import formats
from ckptfix.core.devices import DevicePlan
from ckptfix.core.torch_free import ENV_SWITCH, NeedsTorch
from ckptfix.parse import format_registry as registry, zipdir
from ckptfix.safety import scanner
from ckptfix.safety.file_scanners import PICKLE
from tests import quant_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> dict[str, Path]:
    """One checkpoint of every format ckptfix writes or the fixtures hold: format name → path."""
    out = tmp_path_factory.mktemp("made")
    src = fixtures_dir / "mlp_single.pth"
    ckptfix.convert(src, out / "m.safetensors")
    ckptfix.convert(src, out / "st_shards", max_shard_size="1KB")
    ckptfix.convert(src, out / "pth_shards", max_shard_size="1KB", format="pth")
    found = {formats.sniff(str(p)): p for p in sorted(fixtures_dir.iterdir()) if p.suffix != ".py"
             and p.name != "manifest.json" and p != quant_files.QUANT}
    found.update({formats.sniff(str(p)): p for p in (out / "m.safetensors", out / "st_shards", out / "pth_shards")})
    found[registry.TORCH_ZIP] = src
    return found


def test_sniff_names_only_registered_formats(made: dict[str, Path]) -> None:
    assert set(made) <= set(registry.FORMATS)
    assert set(made) >= {f.name for f in registry.FORMATS.values() if f.describe}  # a fixture for each


def test_each_family_has_the_verbs_its_formats_promise() -> None:
    for spec in registry.FORMATS.values():
        module = importlib.import_module(f"ckptfix.formats.{spec.family}")
        verbs = ["read", "recorded_members"] + ["describe"] * spec.describe + ["plan_write"] * spec.write_without_torch
        verbs += ["write"] * bool(spec.write_names) + ["dir_output"] * (spec.directory_output or bool(spec.index_name))
        verbs += ["write_shards"] * bool(spec.index_name)
        missing = [v for v in verbs if not callable(getattr(module, v, None))]
        assert not missing, f"{spec.name}: ckptfix.formats.{spec.family} lacks {missing}"
    for spec in registry.FORMATS.values():  # the names each ability refers to are registered
        for name in (spec.shards_as, spec.shard_format):
            assert name is None or name in registry.FORMATS
    assert registry.WRITE_NAMES == ("pth", "safetensors", "dcp")


def test_each_scanner_name_resolves_and_each_scan_is_used() -> None:
    named = {spec.scanner for spec in registry.FORMATS.values()}
    assert named <= set(scanner.SCANNERS), f"no scan for {named - set(scanner.SCANNERS)}"
    assert set(scanner.SCANNERS) == named | scanner.NOT_FORMATS, "a scan no format names"  # (nor a non-format)
    assert PICKLE in scanner.NOT_FORMATS and not named & scanner.NOT_FORMATS
    assert all(callable(scan) for scan in scanner.SCANNERS.values())


@pytest.mark.parametrize("name", [n for f in registry.FORMATS.values() for n in f.write_names])
def test_each_write_name_round_trips(name: str, tmp_path: Path, fixtures_dir: Path) -> None:
    src = fixtures_dir / "mlp_single.pth"
    dst = tmp_path / "out"
    report = ckptfix.convert(src, dst, format=name)
    spec = registry.by_write_name(name)
    assert spec is not None and report.format_out == spec.name == formats.sniff(str(dst))
    want = torch.load(src, weights_only=True)
    got = ckptfix.read(dst).state_dict
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("spec", [f for f in registry.FORMATS.values() if f.write_without_torch], ids=lambda f: f.name)
def test_each_torch_free_writer_round_trips(spec: registry.Format, tmp_path: Path, fixtures_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan written without torch reads back as torch's own writer writes it."""
    src = str(fixtures_dir / "mlp_single.pth")
    raw = formats.describe(src, formats.sniff(src))
    plan = formats.plan_write(raw.obj, spec.name, archive="out")
    plan.write(str(tmp_path / "out"))
    want = torch.load(src, weights_only=True)
    got = formats.read(str(tmp_path / "out"), spec.name, DevicePlan("cpu"), False).obj
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


PROBE = """
import sys
from ckptfix import formats
path = sys.argv[1]
fmt = formats.sniff(path)
raw = formats.describe(path, fmt)
print(fmt, len(raw.tags), "torch" in sys.modules)
"""


def test_each_describable_format_is_described_without_torch(made: dict[str, Path]) -> None:
    described = [f.name for f in registry.FORMATS.values() if f.describe]
    for name in described:
        out = subprocess.run([sys.executable, "-c", PROBE, str(made[name])], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr
        fmt, tags, torch_imported = out.stdout.split()
        assert (fmt, torch_imported) == (name, "False") and int(tags) > 0, out.stdout


def test_formats_not_describable_need_torch(made: dict[str, Path]) -> None:
    for spec in registry.FORMATS.values():
        if not spec.describe and spec.name in made:
            with pytest.raises(NeedsTorch):
                formats.describe(str(made[spec.name]), spec.name)


def _count_directory_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every module's name for ``zipdir.read_directory`` replaced by a counting one."""
    calls: list[int] = []
    real = zipdir.read_directory

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("ckptfix") and getattr(module, "read_directory", None) is real:
            monkeypatch.setattr(module, "read_directory", counted)
    return calls


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
def test_convert_and_inspect_parse_the_zip_directory_once(torch_free: bool, tmp_path: Path, fixtures_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "small.pth"
    src.write_bytes((fixtures_dir / "mlp_single.pth").read_bytes())  # a file no earlier test has cached
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    importlib.import_module("ckptfix.formats.torchsave")  # every module that reads a directory is imported
    calls = _count_directory_reads(monkeypatch)
    ckptfix.convert(src, tmp_path / "out.safetensors")
    assert len(calls) == 1
    (src2 := tmp_path / "small2.pth").write_bytes(src.read_bytes())
    calls.clear()
    info = ckptfix.describe(src2) if torch_free else ckptfix.inspect(src2)
    assert len(calls) == 1 and json.dumps(info.to_dict())
