"""verify's SHA-256 is computed on a thread while the file is read (no pass of its own), and is the file's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.safety import integrity

SPEC_PY = "import torch\n\ndef lin():\n    return torch.nn.Linear(3, 2)\n"


def test_verify_hashes_while_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save(torch.nn.Linear(3, 2).state_dict(), tmp_path / "m.pth")
    (tmp_path / "spec.py").write_text(SPEC_PY)
    threads: list[str] = []
    real = integrity.HashAlongside.__init__

    def spy(self: integrity.HashAlongside, path: str) -> None:
        threads.append(path)
        real(self, path)

    monkeypatch.setattr(integrity.HashAlongside, "__init__", spy)
    monkeypatch.setattr(integrity, "file_sha256", lambda *a: pytest.fail("a separate hashing pass"))
    report = ckptfix.verify(tmp_path / "m.pth", f"{tmp_path / 'spec.py'}:lin", forward=False, checksum=True)
    assert threads == [str(tmp_path / "m.pth")]
    assert report.sha256 == hashlib.sha256((tmp_path / "m.pth").read_bytes()).hexdigest()


def test_a_directory_has_no_digest_and_a_file_its_own(tmp_path: Path) -> None:
    assert integrity.HashAlongside(str(tmp_path)).result() is None
    (tmp_path / "f").write_bytes(b"x")
    pending = integrity.HashAlongside(str(tmp_path / "f"))
    assert pending.result() == hashlib.sha256(b"x").hexdigest()
