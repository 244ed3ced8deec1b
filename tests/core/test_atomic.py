"""The atomic writer's basic guarantees (fault injection lives with the safety tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptfix
from ckptfix.errors import DestinationError


def test_existing_dst_needs_force(tmp_path: Path, fixtures_dir: Path) -> None:
    dst = tmp_path / "out.pth"
    dst.write_bytes(b"precious")
    with pytest.raises(DestinationError, match="already exists"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst)
    assert dst.read_bytes() == b"precious"
    ckptfix.convert(fixtures_dir / "mlp_ddp.pth", dst, force=True)
    assert dst.read_bytes() != b"precious" and sorted(p.name for p in tmp_path.iterdir()) == ["out.pth"]


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_dst_that_is_src_through_links(link: str, tmp_path: Path, fixtures_dir: Path) -> None:
    src = tmp_path / "src.pth"
    src.write_bytes((fixtures_dir / "mlp_ddp.pth").read_bytes())
    dst = tmp_path / "dst.pth"
    (os.symlink if link == "symlink" else os.link)(src, dst)
    before = src.read_bytes()
    with pytest.raises(DestinationError, match="is the source file itself"):
        ckptfix.convert(src, dst, force=True)
    assert src.read_bytes() == before


def test_output_permissions_follow_umask(tmp_path: Path, fixtures_dir: Path) -> None:
    old = os.umask(0o022)
    try:
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth")
    finally:
        os.umask(old)
    assert (tmp_path / "o.pth").stat().st_mode & 0o777 == 0o644


def test_failure_mid_write_leaves_nothing(tmp_path: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfix.formats as formats
    from ckptfix.formats import base

    def boom(_obj_or_plan, path, *args, **kwargs):  # formats.write(obj, path, …) and WritePlan.write(plan, path)
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(formats, "write", boom)
    monkeypatch.setattr(base.WritePlan, "write", boom)
    with pytest.raises(DestinationError, match="No space left on device"):
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth")
    assert list(tmp_path.iterdir()) == []
