"""A tar is a torch < 0.4 checkpoint only with its ``storages`` member, the one torch.load extracts first;
any other tar is a FormatError, not an unsafe checkpoint (issue 20, item 5)."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import pytest
import torch

from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.parse.format_registry import TORCH_LEGACY
from ckptfix.parse.sniff import sniff
from tests import adversarial



def _plain_tar(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "weights.bin").write_bytes(bytes(1000))
    path = tmp_path / "files.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(tmp_path / "notes.txt", "notes.txt")
        tar.add(tmp_path / "weights.bin", "weights.bin")
    return path


@pytest.mark.parametrize("command", ["scan", "inspect", "convert", "load"])
def test_plain_tar_is_not_a_checkpoint(command: str, tmp_path: Path, refused_as_damage) -> None:
    path = _plain_tar(tmp_path)
    with pytest.raises(KeyError, match="storages"):  # torch's own reader fails on it too
        torch.load(path, weights_only=False)
    says = f"Error: {path}: is a tar archive but not a torch checkpoint (no 'storages' member)"
    if command == "load":
        with pytest.raises(FormatError) as info:
            sniff(str(path))
        assert f"Error: {info.value}".startswith(says)
        return
    assert refused_as_damage(command, path).startswith(says)


def test_legacy_checkpoint_tar_keeps_its_handling(tmp_path: Path, cli_runner) -> None:
    path = tmp_path / "old.tar"
    path.write_bytes(adversarial.legacy_tar(pickle.dumps({"step": 3}, protocol=2)))
    assert sniff(str(path)) == TORCH_LEGACY
    res = cli_runner.invoke(cli, ["scan", str(path)])
    assert res.exit_code == 3 and "torch < 0.4 tar checkpoint" in res.stdout, res.output
