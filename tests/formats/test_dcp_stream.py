"""DCP → .pth / .safetensors without the scratch file: FSDP2's dim-0 chunks copied straight into place.

The checkpoints are real 2-process gloo runs of ``fully_shard`` + ``dcp.save`` (tests/fsdp2_dirs.py);
every output is compared bit for bit with torch's own ``dcp_to_torch_save``.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptfix
from ckptfix.formats.dcp import chunks
from ckptfix.safety import digests
from tests import fsdp2_dirs
from tests.dcp_spy import ScratchSpy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """variant → (its DCP directory, torch's consolidation of it: dcp_to_torch_save + torch.load)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path_factory.mktemp("fsdp2")
    out = {}
    for variant, path in fsdp2_dirs.make(root).items():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_to_torch_save(str(path), str(root / f"{variant}.pth"))
        out[variant] = (path, torch.load(root / f"{variant}.pth", weights_only=True))
    return out


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k


def read_output(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        assert digests.failures(str(path), "safetensors") == []  # each digest, of chunks copied one after another
        return load_file(path)
    assert zipfile.ZipFile(path).testzip() is None  # every member's CRC-32 matches its bytes
    return torch.load(path, weights_only=True)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in flatten(v, f"{prefix}{k}/").items()}
    if isinstance(obj, list):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in flatten(v, f"{prefix}{i}/").items()}
    return {prefix: obj}


@pytest.mark.parametrize("variant", ["rows", "rows_bf16", "cols"])
@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
@pytest.mark.parametrize("prefix", [None, "module."], ids=["keys", "add-prefix"])
def test_streamed_convert_is_dcp_to_torch_save_bit_for_bit(fsdp2: dict, variant: str, ext: str, prefix: str | None,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dim-0 shards (rows*) are copied with no scratch mapping at all; Shard(1) weights (cols) still go
    through one, sized for that tensor alone, and the answer is the same."""
    src, ref = fsdp2[variant]
    spy = ScratchSpy(monkeypatch, refuse=variant != "cols")
    out = tmp_path / f"out{ext}"
    report = ckptfix.convert(src, out, add_prefix=prefix)
    assert report.streamed
    got = read_output(out)
    same_bits(got, {(prefix or "") + k: v for k, v in ref["model"].items()})
    if variant == "cols":  # the two Shard(1) weights, each in its own scratch mapping
        assert sorted(spy.made) == sorted(t.numel() * t.element_size() for k, t in ref["model"].items()
                                          if k in ("body.4.weight", "head.weight"))
    model = fsdp2_dirs.net().to(ref["model"]["body.0.weight"].dtype)
    model.load_state_dict({k.removeprefix(prefix or ""): v for k, v in got.items()}, strict=True)


@pytest.mark.parametrize("variant", ["rows", "cols"])
def test_whole_training_checkpoint_is_dcp_to_torch_saves(fsdp2: dict, variant: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--keep-extra: model and optimizer state (Adam's moments sharded like their parameters, its 0-d
    steps whole) in one .pth, equal to torch's consolidation entry by entry."""
    src, ref = fsdp2[variant]
    ScratchSpy(monkeypatch, refuse=variant == "rows")
    out = tmp_path / "whole.pth"
    assert ckptfix.convert(src, out, keep_extra=True).streamed
    got, want = flatten(read_output(out)), flatten(ref)
    assert sorted(got) == sorted(want)  # (ckptfix keeps the saved state dict's order, torch the ranks')
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            same_bits({k: got[k]}, {k: w})
        else:
            assert got[k] == w, k


def test_no_scratch_file_in_tmpdir(fsdp2: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR pointed at a directory that isn't there: the streamed convert never needs it, while a
    full load (which assembles sharded tensors in a scratch file there) does."""
    import tempfile

    src, ref = fsdp2["rows"]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # mkstemp fails there
    ckptfix.convert(src, tmp_path / "out.safetensors")
    same_bits(load_file(tmp_path / "out.safetensors"), ref["model"])
    with pytest.raises(ckptfix.errors.ConversionError, match="scratch space"):
        ckptfix.load(src)


def test_chunks_that_are_not_plain_bytes_are_assembled(fsdp2: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk record whose bytes aren't the chunk's elements row-major (a strided or larger storage)
    sends its tensor through the scratch path: pretend none is plain and the answer doesn't change."""
    src, ref = fsdp2["rows"]
    monkeypatch.setattr(chunks.Chunks, "_span", lambda *_args: None)
    spy = ScratchSpy(monkeypatch, refuse=False)
    for ext in (".pth", ".safetensors"):
        ckptfix.convert(src, tmp_path / f"out{ext}")
        same_bits(read_output(tmp_path / f"out{ext}"), ref["model"])
    assert len(spy.made) == 2 * 12  # model's 12 parameters are sharded, each assembled once per output


@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
def test_dtype_cast_from_dcp_goes_tensor_by_tensor(fsdp2: dict, ext: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cast still assembles each sharded tensor in a scratch mapping, but one tensor at a time
    (never the whole checkpoint's worth of TMPDIR), and casts it as a full load would."""
    src, ref = fsdp2["rows"]
    spy = ScratchSpy(monkeypatch, refuse=False)
    report = ckptfix.convert(src, tmp_path / f"bf16{ext}", dtype="bf16")
    assert report.streamed
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref["model"].items()}
    same_bits(read_output(tmp_path / f"bf16{ext}"), want)
    assert spy.made and max(spy.made) == max(t.numel() * t.element_size() for t in ref["model"].values())
