"""What convert's report says: device remaps by saved device, keys a --strip-prefix left alone, and
``_metadata`` only where a loader without it would load the file differently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.torch_free import ENV_SWITCH


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
@pytest.mark.parametrize("name", ["mlp_cuda1.pth", "mlp_model_parallel.pth", "mlp_cuda0.pth"])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_report_names_device_remaps(name: str, fmt: str, torch_free: bool, fixtures_dir: Path, manifest: dict,
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors saved on cuda:N and written for the CPU: one note, how many from which device."""
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    report = ckptfix.convert(fixtures_dir / name, tmp_path / f"out.{fmt}")
    saved = manifest[name]["devices"]
    notes = [n for n in report.notes if n.startswith("moved to cpu")]
    assert notes == ["moved to cpu: " + ", ".join(f"{n} tensor(s) saved on {tag}" for tag, n in sorted(saved.items()))]


def test_report_says_nothing_of_devices_for_a_cpu_file(fixtures_dir: Path, tmp_path: Path) -> None:
    report = ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "out.pth")
    assert not [n for n in report.notes if "moved" in n or "cuda" in n]


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
def test_report_names_keys_strip_prefix_left_alone(torch_free: bool, tmp_path: Path, cli_runner,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--strip-prefix model. on a file where some keys lack it: those are named (a few, with the count)."""
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    sd = {"model.backbone.weight": torch.randn(2, 2), "model.head.weight": torch.randn(1, 2)}
    sd.update({f"loss_fn.w{i}": torch.randn(1) for i in range(7)})
    torch.save({"state_dict": sd, "epoch": 1}, tmp_path / "mixed.ckpt")
    res = cli_runner.invoke(cli, ["convert", str(tmp_path / "mixed.ckpt"), str(tmp_path / "out.pth"),
                                  "--strip-prefix", "model."])
    assert res.exit_code == 0, res.output
    note = [line for line in res.output.splitlines() if "--strip-prefix" in line]
    assert note == ["  note: --strip-prefix model. left 7 key(s) without that prefix unchanged: loss_fn.w0, loss_fn.w1, "
                    "loss_fn.w2, loss_fn.w3, loss_fn.w4 and 2 more"]
    out = torch.load(tmp_path / "out.pth", weights_only=True)
    assert list(out) == ["backbone.weight", "head.weight", *[f"loss_fn.w{i}" for i in range(7)]]
    assert all(torch.equal(out[k.removeprefix("model.")], v) for k, v in sd.items())


def test_strip_prefix_on_every_key_adds_no_note(tmp_path: Path) -> None:
    torch.save({"model.a": torch.ones(2), "model.b": torch.ones(3)}, tmp_path / "all.pth")
    report = ckptfix.convert(tmp_path / "all.pth", tmp_path / "out.pth", strip_prefix="model.")
    assert not [n for n in report.notes if "--strip-prefix" in n]


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("torch_free", [True, False], ids=["torch-free", "torch"])
def test_metadata_note_only_where_a_loader_needs_it(torch_free: bool, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A state dict as torch saves it: _metadata is kept (ckptfix restores it) without a note, since
    load_state_dict loads the same tensors without it. With BatchNorm's num_batches_tracked removed,
    _metadata (BatchNorm version 2) decides whether a strict load fails: the note names that module."""
    monkeypatch.setenv(ENV_SWITCH, "1" if torch_free else "0")
    sd = _bn_net().state_dict()
    torch.save(sd, tmp_path / "plain.pth")
    report = ckptfix.convert(tmp_path / "plain.pth", tmp_path / "plain.safetensors")
    assert not [n for n in report.notes if "_metadata" in n]
    assert ckptfix.load(tmp_path / "plain.safetensors")._metadata == sd._metadata  # still kept

    del sd["1.num_batches_tracked"]  # an old or hand-edited state dict: BatchNorm at version 2 without it
    torch.save(sd, tmp_path / "no_nbt.pth")
    report = ckptfix.convert(tmp_path / "no_nbt.pth", tmp_path / "no_nbt.safetensors")
    notes = [n for n in report.notes if "_metadata" in n]
    assert len(notes) == 1 and "'1' (version 2)" in notes[0] and "safetensors.torch.load_file" in notes[0], notes
    # what the note says is so: with _metadata (ckptfix) the strict load misses the buffer, without it loads
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        _bn_net().load_state_dict(ckptfix.load(tmp_path / "no_nbt.safetensors"))
    _bn_net().load_state_dict(load_file(tmp_path / "no_nbt.safetensors"))
