"""``convert`` checks each copied record's CRC-32 as it copies (issue 20): a torch zip whose tensor bytes no
longer match the CRC-32 its zip records (the file was damaged after it was written) is refused, one
``Error:`` line naming the file and the record, exit 1, nothing written. Every streamed copy is covered:
the torch-free writers and the streamed ones (``CKPTFIX_TORCH_FREE=0``), to a torch zip, to safetensors,
sharded, and with a dtype cast; and every read of a sharded .bin directory or a DeepSpeed checkpoint,
torch.load's included. torch.load itself reads the damaged bytes without a word, which is how
the damage was laundered into a file that passed ``verify --exact``.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH


def _data_start(path: Path, member: str) -> int:
    """Where ``member``'s bytes start in the zip ``path`` (after its local header)."""
    with zipfile.ZipFile(path) as z:
        header = z.getinfo(member).header_offset
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[header + 26 : header + 30])
    return header + 30 + name_len + extra_len


def damaged_checkpoint(tmp_path: Path, wrap: bool = True) -> Path:
    """A real torch.save file (a DataParallel-style ``module.`` prefix under ``model`` when ``wrap``) with
    one byte of ``net.0.weight``'s record flipped: torch.load still reads it, its CRC-32 no longer matches."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    sd = {f"module.{k}": v for k, v in net.state_dict().items()} if wrap else net.state_dict()
    good = tmp_path / "good.pth"
    torch.save({"model": sd} if wrap else sd, good)
    bad = tmp_path / "bad.pth"
    raw = bytearray(good.read_bytes())
    raw[_data_start(good, "good/data/0") + 5] ^= 0xFF
    bad.write_bytes(bytes(raw))
    loaded = torch.load(bad, weights_only=True)  # torch reads it: the damage goes unnoticed
    first = (loaded["model"] if wrap else loaded)[next(iter(sd))]
    assert not torch.equal(first, next(iter(sd.values())))
    return bad


OUTPUTS = [("out.pth", []), ("out.safetensors", []), ("shards", ["--max-shard-size", "200"]),
           ("shards", ["--max-shard-size", "200", "--format", "safetensors"]), ("out.pth", ["--dtype", "fp16"]),
           ("out.safetensors", ["--dtype", "bf16"])]


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
@pytest.mark.parametrize(("name", "flags"), OUTPUTS, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_convert_refuses_a_record_whose_crc_does_not_match(tmp_path: Path, name: str, flags: list[str],
                                                          torch_free: bool, cli_runner: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    bad = damaged_checkpoint(tmp_path)
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    line = _refused_in_one_line(cli_runner, bad, tmp_path / "out", name, flags)
    assert str(bad) in line and "data/0" in line and "CRC-32" in line, line


def _refused_in_one_line(cli_runner: Any, src: Path, out_dir: Path, name: str, flags: list[str]) -> str:
    """``convert src out_dir/name`` exits 1 with one Error line, and nothing is written (no temp file left)."""
    out_dir.mkdir()
    res = cli_runner.invoke(cli, ["convert", str(src), str(out_dir / name), "-q", *flags])
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert list(out_dir.iterdir()) == []
    return lines[0]


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
@pytest.mark.parametrize("name", ["out.pth", "out.safetensors"])
def test_an_intact_file_still_converts(tmp_path: Path, name: str, torch_free: bool, cli_runner: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The check passes every record of an intact file (nbytes of the tensor == the record, and a record
    longer than its tensor: torch.save of a slice's storage)."""
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    base = torch.arange(40, dtype=torch.float32)
    src = tmp_path / "src.pth"
    torch.save({"module.a": base[:10], "module.b": torch.ones(3, 3)}, src)
    res = cli_runner.invoke(cli, ["convert", str(src), str(tmp_path / name), "-q"])
    assert res.exit_code == 0, res.output
    if name.endswith(".pth"):
        out = torch.load(tmp_path / name, weights_only=True)
        with zipfile.ZipFile(tmp_path / name) as z:
            assert z.testzip() is None
    else:
        from safetensors.torch import load_file
        out = load_file(tmp_path / name)
    assert torch.equal(out["a"], base[:10]) and torch.equal(out["b"], torch.ones(3, 3))


@pytest.mark.parametrize("flags", [["--format", "dcp"], ["--trust"]], ids=["dcp", "trust"])
def test_the_loaded_path_checks_too(tmp_path: Path, flags: list[str], cli_runner: Any) -> None:
    """Read through torch.load (a DCP output, ``--trust``): the records' CRC-32s are checked meanwhile."""
    bad = damaged_checkpoint(tmp_path)
    out = tmp_path / "out" / ("dcp" if "dcp" in flags else "out.pth")
    out.parent.mkdir()
    res = cli_runner.invoke(cli, ["convert", str(bad), str(out), "-q", *flags])
    assert res.exit_code == 1 and res.output.startswith(f"Error: {bad}: record data/0 "), res.output
    assert list((tmp_path / "out").iterdir()) == []


def _flip(path: Path, member_suffix: str = "data/0") -> None:
    """One byte of ``path``'s record ``…/member_suffix`` flipped: torch.load still reads the file."""
    with zipfile.ZipFile(path) as z:
        member = next(n for n in z.namelist() if n.endswith(f"/{member_suffix}"))
    raw = bytearray(path.read_bytes())
    raw[_data_start(path, member) + 1] ^= 0xFF
    path.write_bytes(bytes(raw))


def sharded_pth(tmp_path: Path) -> Path:
    """A Hugging Face sharded .bin directory as transformers writes it (torch.save per shard + the index),
    its second shard's first record damaged."""
    torch.manual_seed(0)
    sd = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).state_dict()
    keys = list(sd)
    shards = {"pytorch_model-00001-of-00002.bin": keys[:2], "pytorch_model-00002-of-00002.bin": keys[2:]}
    directory = tmp_path / "hf"
    directory.mkdir()
    for name, part in shards.items():
        torch.save({k: sd[k] for k in part}, directory / name)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": {k: name for name, part in shards.items() for k in part}}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    _flip(directory / "pytorch_model-00002-of-00002.bin")
    return directory


SHARDED_FLAGS = [("out.pth", []), ("out.safetensors", []), ("out.pth", ["--trust"]), ("dcp", ["--format", "dcp"]),
                 ("out.pth", ["--map-location", "cpu=cpu", "--dtype", "fp16"])]


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "streamed"])
@pytest.mark.parametrize(("name", "flags"), SHARDED_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_a_damaged_shard_is_refused(tmp_path: Path, name: str, flags: list[str], torch_free: bool, cli_runner: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded .pth source on every read (torch-free, streamed, torch.load's for --trust and DCP output)."""
    src = sharded_pth(tmp_path)
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    line = _refused_in_one_line(cli_runner, src, tmp_path / "out", name, flags)
    assert "pytorch_model-00002-of-00002.bin" in line and "data/0" in line and "CRC-32" in line, line


@pytest.mark.parametrize("damaged", ["model_states", "optim_states"])
@pytest.mark.parametrize("flags", [[], ["--trust"], ["--select", "module"]], ids=["fp32", "trust", "module"])
def test_a_damaged_deepspeed_file_is_refused(tmp_path: Path, damaged: str, flags: list[str], train: Any,
                                             cli_runner: Any) -> None:
    """A DeepSpeed ZeRO-2 checkpoint (fixtures/deepspeed_layouts.py) with a record of one file it reads damaged."""
    train._layouts()._deepspeed_layouts().save_deepspeed(train, "zeronet", tmp_path / "ds", 2, "fp32")
    target = sorted((tmp_path / "ds" / "global_step5").glob(f"*{damaged}.pt"))[-1]
    _flip(target)
    out = tmp_path / "out"
    out.mkdir()
    res = cli_runner.invoke(cli, ["convert", str(tmp_path / "ds"), str(out / "o.pth"), "-q", *flags])
    if damaged == "optim_states" and "module" in flags:  # --select module reads the model_states file alone
        assert res.exit_code == 0 and (out / "o.pth").is_file(), res.output  # the damaged file was never read
        return
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.strip() and "[real_accelerator.py" not in line]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert target.name in lines[0] and "data/0" in lines[0] and "CRC-32" in lines[0], lines[0]
    assert list(out.iterdir()) == []
