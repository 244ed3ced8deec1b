"""convert's transforms: dtype casts, regex renames, by-order mapping, hashed names, resuming training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import ConversionError, KeyCollisionError
from tests.compare import assert_close_to_recorded
from tests.training import train_steps


@pytest.mark.parametrize("dtype, torch_dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_dtype_casts_floats_only(dtype: str, torch_dtype: torch.dtype, fmt: str, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    src = tmp_path / "bn.pth"
    torch.save({k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()}, src)
    report = ckptfix.convert(src, tmp_path / f"out.{fmt}", dtype=dtype)
    out = ckptfix.load(tmp_path / f"out.{fmt}")
    assert out["1.num_batches_tracked"].dtype == torch.int64
    assert all(v.dtype == torch_dtype for k, v in out.items() if k != "1.num_batches_tracked")
    assert report.dtype_cast == {f"float64->{str(torch_dtype)[6:]}": 6}
    model.load_state_dict(out)  # load_state_dict casts back into the model's fp32


def test_fp16_overflow_refused_unless_allowed(tmp_path: Path) -> None:
    src = tmp_path / "big.pth"
    torch.save({"w": torch.tensor([1.0, 1e6, -7e4]), "ok": torch.tensor([2.0])}, src)
    with pytest.raises(ConversionError, match="overflow to inf in .*w.*--allow-overflow"):
        ckptfix.convert(src, tmp_path / "o.pth", dtype="fp16")
    assert not (tmp_path / "o.pth").exists()
    report = ckptfix.convert(src, tmp_path / "o.pth", dtype="fp16", allow_overflow=True)
    assert any("2 value(s) became inf in w" in n for n in report.notes)
    assert ckptfix.convert(src, tmp_path / "b.pth", dtype="bf16").dtype_cast == {"float32->bfloat16": 2}


def test_cast_keeps_tied_weights_tied(tmp_path: Path) -> None:
    w = torch.randn(3, 3)
    torch.save({"a": w, "b": w}, tmp_path / "tied.pth")
    out = ckptfix.load(tmp_path / "tied.pth", dtype="fp16")
    assert out["a"].data_ptr() == out["b"].data_ptr()


def test_rename_full_match_in_order_with_metadata(tmp_path: Path, fixtures_dir: Path) -> None:
    dst = tmp_path / "r.pth"
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, rename=[r"(\d)\.(weight|bias)=fc\1.\2", r"fc4\.(.*)=head.\1"])
    out = torch.load(dst, weights_only=True)
    assert list(out) == ["fc0.weight", "fc0.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
    assert "head" in out._metadata and "fc0" in out._metadata and "4" not in out._metadata
    # '.' is the user's own regex: an unescaped pattern that also matches '0xweight' is theirs to write
    with pytest.raises(KeyCollisionError, match="would both become 'same'"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "c.pth", rename=[r".*weight=same"])
    with pytest.raises(ConversionError, match="expected REGEX=REPLACEMENT"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "c.pth", rename=["nope"])


class Renamed(nn.Module):
    """The MLP's layers under other names: loading needs --by-order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 16)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def test_by_order_maps_renamed_model(tmp_path: Path, fixtures_dir: Path, manifest: dict, train: Any) -> None:
    report = ckptfix.convert(fixtures_dir / "mlp_compile_ddp.pth", tmp_path / "o.pth", by_order=Renamed())
    assert any("0.weight -> inp.weight" in n for n in report.notes)
    model = Renamed()
    model.load_state_dict(torch.load(tmp_path / "o.pth", weights_only=True), strict=True)
    model.eval()
    with torch.no_grad():
        assert_close_to_recorded(model(train.fixed_input("mlp")), manifest["mlp_compile_ddp.pth"]["output"])


def test_by_order_refuses_shape_disagreement(tmp_path: Path, fixtures_dir: Path) -> None:
    wrong = nn.Sequential(nn.Linear(13, 32), nn.Linear(32, 16), nn.Linear(16, 1))
    with pytest.raises(ConversionError,
                       match="tensor #0 '0.weight' has shape \\[16, 13\\] but the model's #0 '0.weight' has \\[32, 13\\]"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth", by_order=wrong)
    with pytest.raises(ConversionError, match="same number of tensors: checkpoint has 6, model has 4"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth",
                        by_order=nn.Sequential(nn.Linear(13, 16), nn.Linear(16, 1)))
    assert not (tmp_path / "o.pth").exists()


def test_hash_names_the_file_after_its_sha256(tmp_path: Path, fixtures_dir: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(tmp_path / "mlp.pth"), "--hash", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    out = Path(report["dst"])
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert out.name == f"mlp-{digest[:8]}.pth" and report["sha256_out"] == digest
    assert report["sha256_in"] == hashlib.sha256((fixtures_dir / "mlp_ddp.pth").read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    # torch.hub's check_hash convention: the name's hash prefix matches the file
    from torch.hub import HASH_REGEX

    assert digest.startswith(HASH_REGEX.search(out.name).group(1))


def _resume(path: Path, train: Any) -> list[float]:
    model = train.mlp()
    ckptfix.load_into(model, path, select="model_state_dict")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(torch.load(path, weights_only=True)["optimizer_state_dict"])
    return train_steps(model, opt, 5)


@pytest.mark.parametrize("to, dtype", [("ddp", None), ("single", None), ("compile", "fp32")])
def test_resume_from_converted_training_checkpoint(to: str, dtype: str | None, tmp_path: Path, fixtures_dir: Path,
                                                   train: Any) -> None:
    src = fixtures_dir / "mlp_train_ckpt.pth"
    ckptfix.convert(src, tmp_path / "resume.pth", to=to, keep_extra=True, dtype=dtype)
    assert _resume(tmp_path / "resume.pth", train) == _resume(src, train)
