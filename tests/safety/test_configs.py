"""OmegaConf configs (every Hydra project's, Lightning's hyper-parameters) read as plain data, omegaconf never imported.

The files are real: tests/real_configs.py runs in a child process with omegaconf and Lightning (a torch.save of
a dict holding DictConfigs, and a ``Trainer.fit`` of one step whose module saved a DictConfig with
``save_hyperparameters``), and records each config as ``OmegaConf.to_container(resolve=False)`` gives it.
The reading process here is another child, which asserts that ``omegaconf`` was never imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FILES = ("dictconfig.pt", "lightning.ckpt")

#: the reading child: every file read, its extra entries and notes as JSON; omegaconf must never be imported
READER = """
import json, sys
import ckptfix
out = {}
for path in sys.argv[1:]:
    ckpt = ckptfix.read(path)
    out[path] = {"extra": ckpt.extra, "notes": ckpt.notes, "keys": list(ckpt.state_dict)}
print(json.dumps(out, default=repr))
sys.exit(3 if "omegaconf" in sys.modules else 0)
"""


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("omegaconf")
    res = subprocess.run([sys.executable, str(TESTS / "real_configs.py"), "omegaconf", str(out)], cwd=out,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def expected(configs: Path) -> dict[str, Any]:
    return json.loads((configs / "expected.json").read_text())


@pytest.fixture(scope="module")
def read_in_child(configs: Path) -> dict[str, Any]:
    """What a fresh process reads (without omegaconf ever imported: exit 3 if it was)."""
    paths = [str(configs / name) for name in FILES]
    res = subprocess.run([sys.executable, "-c", READER, *paths], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, (res.returncode, res.stderr[-4000:])
    out = json.loads(res.stdout)
    return {Path(p).name: v for p, v in out.items()}


def test_dictconfig_reads_as_its_keys_and_values(read_in_child: dict[str, Any], expected: dict[str, Any]) -> None:
    got = read_in_child["dictconfig.pt"]
    assert got["extra"]["cfg"] == expected["cfg"]  # '???' and '${optim.lr}' as written, {} and [] kept
    assert got["extra"]["more"] == [expected["typed"], {"plain": 1}]
    assert any(n.startswith("cfg: an OmegaConf DictConfig and ListConfig read as plain data") for n in got["notes"])


def test_lightning_hyper_parameters_read_as_plain_data(read_in_child: dict[str, Any], expected: dict[str, Any]) -> None:
    got = read_in_child["lightning.ckpt"]
    assert got["extra"]["hyper_parameters"] == expected["lightning"]
    assert got["keys"] == ["net.0.weight", "net.0.bias"]
    assert any(n.startswith("hyper_parameters: an OmegaConf DictConfig") for n in got["notes"])


@pytest.mark.parametrize("name", FILES)
def test_weights_come_out_bit_exact(name: str, configs: Path, tmp_path: Path, cli_runner: Any) -> None:
    want = torch.load(configs / "weights.pt", weights_only=True)["dictconfig" if name == "dictconfig.pt" else "lightning"]
    got = ckptfix.load(configs / name)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    out = tmp_path / "w.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(configs / name), str(out)])
    assert res.exit_code == 0, res.output
    from safetensors.torch import load_file

    written = load_file(str(out))
    assert all(torch.equal(written[k], want[k]) for k in want) and set(written) == set(want)


@pytest.mark.parametrize("name", FILES)
def test_scan_calls_them_inert_data_not_unsafe(name: str, configs: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["scan", str(configs / name), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and not report["unsafe_globals"] and not report["extractable"]
    assert {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
            "omegaconf.nodes.AnyNode"} <= set(report["inert_globals"])
    assert {g["class"] for g in report["globals"] if g["name"].startswith("omegaconf.")} == {"inert"}
    text = cli_runner.invoke(cli, ["scan", str(configs / name)])
    assert text.exit_code == 0 and "clean" in text.stdout
    assert "read as inert data (keys and values; never imported): omegaconf." in text.stdout


@pytest.mark.parametrize("name", FILES)
def test_inspect_names_the_config_and_both_readers_agree(name: str, configs: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["inspect", str(configs / name)])
    assert res.exit_code == 0, res.output
    assert "read as plain data (keys and values; omegaconf not imported" in res.stdout
    torch_free, with_torch = ckptfix.describe(configs / name).to_dict(), ckptfix.inspect(configs / name).to_dict()
    assert torch_free == with_torch


def test_keep_extra_writes_the_config_as_plain_data(configs: Path, tmp_path: Path, cli_runner: Any,
                                                    expected: dict[str, Any]) -> None:
    out = tmp_path / "kept.pth"
    res = cli_runner.invoke(cli, ["convert", str(configs / "dictconfig.pt"), str(out), "--keep-extra"])
    assert res.exit_code == 0, res.output
    kept = torch.load(out, weights_only=True)  # plain data: torch's own safe loader takes it
    assert kept["cfg"] == expected["cfg"] and kept["more"] == [expected["typed"], {"plain": 1}]
