"""Whatever ``convert`` writes loads with its format's plain loader, with the values ckptfix reported (issue 26, item 4).

Every checkpoint the suite has that ckptfix reads — the committed fixtures, the issue-26 cases the plain loader
refuses as saved (tests/observe_cases.py), and the objects the weights-only loader refuses beside the weights or in
``_metadata`` — converted to every output format: ``.pth`` (``torch.load(weights_only=True)``), ``.safetensors``
(``safetensors.torch.load_file``), HF shards of both (each shard by its loader, the union), DCP (DCP's own
``dcp_to_torch_save``). Each output's tensors are compared bit for bit with ``ckptfix.read`` of the source (keys kept
as saved: ``to="keep"``). A conversion may be refused, in one line (a CkptfixError); never anything else.
(tests/hostile_files.py, malformed_files.py, adversarial.py and bypasses.py hold files ckptfix refuses to read:
their own tests prove that; there is nothing to convert.)
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptfix
from tests import observe_cases, public_dcp_corpus, public_safetensors_corpus, public_torch_corpus
from tests.describe_both import fixture_paths

#: output name → how its plain loader reads it (a path → {key: value})
OUTPUTS = ("out.pth", "out.safetensors", "shards_st", "shards_pth", "dcp")
TOO_BIG = 16 << 20  # a source whose tensors need more is left out (a stride-0 view written out in full)


class _Evil:
    def __reduce__(self) -> tuple:
        return os.system, ("true",)  # never run: ckptfix reads it as an inert placeholder


def _tied(tmp: Path) -> Path:
    emb = torch.randn(6, 3)
    torch.save({"emb.weight": emb, "head.weight": emb, "head.bias": torch.zeros(6)}, tmp / "tied.pth")
    return tmp / "tied.pth"


def _in_metadata(value: object, name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        sd = torch.nn.Linear(3, 2).state_dict()
        sd._metadata[""]["extra"] = value  # type: ignore[attr-defined]
        torch.save(sd, tmp / name)
        return tmp / name
    return make


def _beside(value: object, name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        torch.save({"state_dict": torch.nn.Linear(3, 2).state_dict(), "extra": value}, tmp / name)
        return tmp / name
    return make


MADE: dict[str, Callable[[Path], Path]] = {
    "tied": _tied,
    "metadata-namespace": _in_metadata(argparse.Namespace(lr=0.1), "meta_ns.pth"),
    "metadata-os-system": _in_metadata(_Evil(), "meta_evil.pth"),
    "beside-namespace": _beside(argparse.Namespace(lr=0.1), "ns_beside.pth"),
    "beside-os-system": _beside(_Evil(), "evil_beside.pth"),
    **{f"observe-{name}": maker for name, (maker, _spec, _says) in observe_cases.CASES.items()},
}
#: tests/public_torch_corpus.py: the files torch's own test_serialization.py makes that ckptfix reads (one dtype's
#: byteorder variants stand for the rest; the others are read in tests/parse/test_readers_agree.py)
MADE.update({f"public-torch-{name}": make for name, make in public_torch_corpus.CASES.items()
             if name in public_torch_corpus.CONVERTS})
#: tests/public_safetensors_corpus.py: the files safetensors' own tests make that it (and ckptfix) reads, but the big ones
MADE.update({f"public-safetensors-{name}": make for name, make in public_safetensors_corpus.CASES.items()
             if name not in public_safetensors_corpus.REFUSED | public_safetensors_corpus.BIG})
#: tests/public_dcp_corpus.py: the DCP directories torch's own DCP tests write whose state dict is dense tensors ckptfix reads
MADE.update({f"public-dcp-{name}": make for name, make in public_dcp_corpus.CASES.items()
             if name in public_dcp_corpus.CONVERTS})


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("plain_loadable")
    paths = {}
    for name, make in MADE.items():
        if "gpt2" in name and not _has("transformers"):
            continue
        (out / name).mkdir()
        paths[name] = make(out / name)
    return paths


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _plain(path: Path) -> dict[str, Any]:
    """What the output's own loader returns: one file, each shard of an index (the union), or DCP's own reading."""
    if path.is_dir() and (path / ".metadata").exists():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path.with_suffix(".dcp.pth"))
        return torch.load(path.with_suffix(".dcp.pth"), weights_only=True)  # type: ignore[no-any-return]
    if path.is_dir() and not list(path.glob("*.index.json")):  # one shard: save_pretrained's one file, no index
        (only,) = [p for p in path.iterdir() if p.name in ("model.safetensors", "pytorch_model.bin")]
        return _plain(only)
    if path.is_dir():
        (index,) = path.glob("*.index.json")
        union: dict[str, Any] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            part = _plain(path / shard)
            assert not set(part) & set(union), shard
            union.update(part)
        return union
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def _convert(src: Path, out: Path) -> Any:
    kwargs: dict[str, Any] = {"to": "keep", "progress": False}
    if out.name.startswith("shards"):
        kwargs.update(max_shard_size="1KB", format="pth" if out.name.endswith("pth") else "safetensors")
    elif out.name == "dcp":
        kwargs["format"] = "dcp"
    return ckptfix.convert(src, out, **kwargs)


def _same(got: Any, want: Any) -> bool:
    """Bit for bit: dtype, shape and bytes (NaN payloads, -0.0 and all)."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return bool(got == want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    a, b = got.detach().contiguous().cpu(), want.detach().contiguous().cpu()
    return a.numel() == 0 or bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))  # (0-dim too)


def _check(src: Path, tmp: Path) -> dict[str, Any]:
    """Each output format: converted or refused in one line, and what was written loaded plainly, as read; the
    reports of what was written, by output."""
    try:
        want = ckptfix.read(src)
    except ckptfix.errors.CkptfixError:
        return {}  # not a file ckptfix reads
    if want.stats.nbytes > TOO_BIG:
        return {}
    written = {}
    for name in OUTPUTS:
        out = tmp / name
        try:
            report = _convert(src, out)
        except ckptfix.errors.CkptfixError as e:  # refused, in one line (a bug would be another exception)
            assert "a bug in ckptfix" not in str(e) and "\n" not in str(e), (src, name, str(e))
            continue
        got = _plain(out)
        tensors = {k: v for k, v in want.state_dict.items() if isinstance(v, torch.Tensor)}
        assert set(got) >= set(tensors), (src, name, sorted(set(tensors) - set(got)))
        bad = [k for k, v in tensors.items() if not _same(got[k], v)]
        assert not bad, (src, name, bad)
        written[name] = report
    return written


@pytest.mark.parametrize("path", fixture_paths(), ids=lambda p: p.name)
def test_every_fixture_converts_to_what_its_plain_loader_takes(path: Path, tmp_path: Path) -> None:
    _check(path, tmp_path)


@pytest.mark.parametrize("name", list(MADE))
def test_every_issue_26_case_converts_to_what_its_plain_loader_takes(name: str, made: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    if name not in made:
        pytest.skip("transformers is not installed")
    written = _check(made[name], tmp_path)
    assert {"out.pth", "out.safetensors"} <= set(written), written  # the weights always convert
    # what the weights-only loader refuses in _metadata: dropped, with a note naming it (safetensors' __metadata__ isn't it)
    if "metadata" in name and not name.startswith("public-safetensors-"):
        assert any(n.startswith("_metadata[''][") and n.endswith("; dropped") for n in written["out.pth"].notes)
