"""DCP's ``.metadata`` without torch: the inert read against the torch read (record ranges and refusals),
and ``ckptfix scan`` of a DCP directory without torch. (The frozen name tables against the installed torch:
tests/core/test_torch_tables.py.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as tdcp

from ckptfix.safety import dcp_policy
from ckptfix.safety.dcp_policy import METADATA
from tests import fsdp2_dirs


# -- the inert read against the torch read ------------------------------------------------------------

def _torch_ranges(path: Path) -> Any:
    return dcp_policy._ranges(str(path), dcp_policy.load_metadata(str(path), trust=False))


def _outcome(f: Any) -> Any:
    try:
        return "ok", f()
    except Exception as e:  # compared: the same class and message from both reads
        return type(e).__name__, str(e)


@pytest.fixture(scope="module")
def single_process_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dcp.save`` without a process group: bfloat16, a 0-d tensor, and bytes entries (non-tensor values)."""
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    sd = {"model": {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "step": torch.tensor(3)},
          "extra": {"epoch": 4, "name": "run", "betas": (0.9, 0.99)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tdcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def fsdp2_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fsdp2_dirs.make(tmp_path_factory.mktemp("fsdp2"))


def test_inert_ranges_equal_torch_ranges(fixtures_dir: Path, single_process_dir: Path,
                                         fsdp2_variants: dict[str, Path]) -> None:
    for path in [fixtures_dir / "mlp_fsdp2", single_process_dir, *fsdp2_variants.values()]:
        inert = dcp_policy.inert_record_ranges(str(path))
        assert inert is not None, path
        assert inert == _torch_ranges(path), path


def _mutations() -> list[tuple[str, bytes, bytes]]:
    return [
        ("unknown class", b"MetadataIndex", b"MetadataIndeX"),
        ("unsafe global", b"\x8c\x05torch\x94\x8c\x04Size", b"\x8c\x05posix\x94\x8c\x04Size"),
        ("record past its file", b"\x8c\x06length\x94M\xa9\x07", b"\x8c\x06length\x94M\xff\xff"),
        ("chunk file outside the directory", b"__0_0.distcp", b"/etc/passwd0"),
        ("truncated", b"", b""),
    ]


@pytest.mark.parametrize("name,old,new", _mutations(), ids=[m[0] for m in _mutations()])
def test_mutated_metadata_same_outcome_both_reads(fixtures_dir: Path, tmp_path: Path, name: str, old: bytes,
                                                   new: bytes) -> None:
    path = Path(shutil.copytree(fixtures_dir / "mlp_fsdp2", tmp_path / "ckpt"))
    meta = path / METADATA
    data = meta.read_bytes()
    if name == "truncated":
        changed = data[: len(data) // 2]
    else:
        assert old in data, name
        changed = data.replace(old, new, 1)
    meta.write_bytes(changed)
    got = _outcome(lambda: dcp_policy.record_ranges(str(path)))
    want = _outcome(lambda: _torch_ranges(path))
    assert got == want
    assert got[0] != "ok", got  # each mutation is refused


def test_scan_of_a_dcp_directory_imports_no_torch(fixtures_dir: Path) -> None:
    code = ("import sys, ckptfix; r = ckptfix.scan(sys.argv[1]); "
            "assert r.ok and r.findings == [], r; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(fixtures_dir / "mlp_fsdp2")], capture_output=True,
                         text=True, env={**os.environ, "CKPTFIX_TORCH_FREE": "1"}, check=True)
    assert out.stdout.strip() == "False"
