"""Each format recognises its own bytes (:mod:`ckptfix.parse.recognise`), and sniffing asks the recognisers the
registry names, in the registry's order:

- every format names a recogniser, sits in exactly one order, and every recogniser is some format's;
- sniff asks them in the order the registry's tuples say (a file: every one; a directory: until one claims it),
  and reports the first damage in that order;
- each real checkpoint is claimed by its own recogniser alone; bytes two recognisers claim (a crafted
  safetensors/tar polyglot, or a second recogniser claiming a torch zip) are refused, naming both formats;
- a claim wins over another recogniser's damage diagnosis; a URL's tar needs a local copy.
"""

from __future__ import annotations

import inspect
import io
import struct
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.core import locations
from ckptfix.errors import FormatError, NeedsLocalCopy
from ckptfix.parse import format_registry as registry, recognise
from ckptfix.parse.recognise import Head
from ckptfix.parse.sniff import sniff

BY_BYTES, BY_LISTING = registry.RECOGNISED_BY_BYTES, registry.RECOGNISED_BY_LISTING


def _head(path: Path | str, remote: bool = False) -> Head:
    head, size = locations.read_head(str(path), 4096)
    return Head(str(path), remote, head, size)


def _claims(h: Head) -> list[str]:
    """The formats whose recognisers claim ``h``, each asked directly."""
    return [fmt for fmt in BY_BYTES if getattr(recognise, registry.get(fmt).recogniser)(h)]


def test_every_format_names_a_recogniser_in_one_order() -> None:
    assert sorted(BY_BYTES + BY_LISTING) == sorted(registry.FORMATS)  # each format in one order, once
    named = {spec.recogniser for spec in registry.FORMATS.values()}
    public = {name for name, f in vars(recognise).items()
              if inspect.isfunction(f) and f.__module__ == recognise.__name__ and not name.startswith("_")}
    assert named == public  # each names a function of recognise, and each of its functions is a recogniser
    assert len(named) == len(registry.FORMATS)


def _recording(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[str]:
    """Every recogniser replaced by one that records its format's name and gives ``answer(name)``."""
    asked: list[str] = []

    def make(name: str) -> Any:
        def recogniser(probe: Any) -> bool:
            asked.append(name)
            return bool(answer(name))
        return recogniser

    for spec in registry.FORMATS.values():
        monkeypatch.setattr(recognise, spec.recogniser, make(spec.name))
    return asked


@pytest.mark.parametrize("order", ["registry", "reversed"])
def test_sniff_asks_the_recognisers_in_the_registry_order(order: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if order == "reversed":  # the order is the registry's tuples', not one sniff spells itself
        monkeypatch.setattr(registry, "RECOGNISED_BY_BYTES", BY_BYTES[::-1])
        monkeypatch.setattr(registry, "RECOGNISED_BY_LISTING", BY_LISTING[::-1])
    file_order, dir_order = list(registry.RECOGNISED_BY_BYTES), list(registry.RECOGNISED_BY_LISTING)
    (path := tmp_path / "f.bin").write_bytes(b"neither one")
    asked = _recording(monkeypatch, lambda name: False)
    with pytest.raises(FormatError, match="unknown format"):
        sniff(str(path))
    assert asked == file_order  # a file: every recogniser of bytes, in order
    asked.clear()
    with pytest.raises(FormatError, match="is a directory but neither"):
        sniff(str(tmp_path))
    assert asked == dir_order
    asked = _recording(monkeypatch, lambda name: name in dir_order[1:])
    assert sniff(str(tmp_path)) == dir_order[1] and asked == dir_order[:2]  # a directory: the first claim names it

    def damaged(probe: Any, name: str) -> bool:
        raise FormatError(f"damaged as {name}")

    for fmt in file_order:
        monkeypatch.setattr(recognise, registry.get(fmt).recogniser, lambda probe, fmt=fmt: damaged(probe, fmt))
    with pytest.raises(FormatError, match=f"^damaged as {file_order[0]}$"):  # the first damage in the order
        sniff(str(path))


@pytest.mark.parametrize("name", ["mlp_single.pth", "mlp_legacy.pth", "mlp_torchscript.pt",
                                  "mlp_safetensors.safetensors", "mlp_lightning.ckpt"])
def test_each_real_checkpoint_is_claimed_by_its_own_recogniser_alone(name: str, fixtures_dir: Path) -> None:
    path = fixtures_dir / name
    assert _claims(_head(path)) == [sniff(str(path))]


def _safetensors_tar(path: Path) -> Path:
    """A tar holding ``storages`` (a torch < 0.4 checkpoint to torch.load) whose bytes are a safetensors file's
    too: its first member is named ``@`` (header length 64), and byte 8, past the name's NUL, is ``{``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for member in ("@", "storages"):
            tar.addfile(tarfile.TarInfo(member), io.BytesIO(b""))
    data = bytearray(buf.getvalue())
    data[8] = ord("{")
    data[148:156] = b" " * 8  # the header's checksum, recomputed as tarfile checks it
    data[148:155] = b"%06o\0" % sum(data[:512])
    path.write_bytes(bytes(data))
    return path


def test_bytes_two_recognisers_claim_are_refused_as_ambiguous(tmp_path: Path) -> None:
    path = _safetensors_tar(tmp_path / "polyglot.pt")
    with tarfile.open(path) as tar:
        assert "storages" in tar.getnames()  # a real tar to tarfile (and to torch.load)
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] == 64  # a header length inside the file
    assert sorted(_claims(_head(path))) == sorted([registry.SAFETENSORS, registry.TORCH_LEGACY])
    with pytest.raises(FormatError, match="is ambiguous") as info:
        sniff(str(path))
    assert registry.SAFETENSORS in str(info.value) and registry.TORCH_LEGACY in str(info.value)


def test_a_second_recogniser_claiming_a_torch_zip_is_refused(fixtures_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(fixtures_dir / "mlp_single.pth")
    assert sniff(path) == registry.TORCH_ZIP
    monkeypatch.setattr(recognise, registry.get(registry.SAFETENSORS).recogniser, lambda probe: True)
    with pytest.raises(FormatError, match=f"read as {registry.TORCH_ZIP} and as {registry.SAFETENSORS} "):
        sniff(path)


def test_a_claim_wins_over_another_recognisers_damage(tmp_path: Path) -> None:
    """A torch zip whose 9th byte (its first record's compression method) is ``{``: safetensors' recogniser
    finds a header length past the end, the zip's claims it; torch.load takes any zip as a zip."""
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    data = bytearray((tmp_path / "m.pt").read_bytes())
    data[8] = ord("{")
    (path := tmp_path / "brace.pt").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="looks like safetensors"):
        recognise.safetensors(_head(path))
    assert sniff(str(path)) == registry.TORCH_ZIP


def test_a_url_tar_needs_a_local_copy(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo("storages"), io.BytesIO(b""))
    url = "https://example.com/old.tar"
    with pytest.raises(NeedsLocalCopy) as info:
        recognise.torch_legacy(Head(url, True, buf.getvalue()[:4096], len(buf.getvalue())))
    assert str(info.value) == f"{url}: reading a tar archive needs a local copy; download it first"
