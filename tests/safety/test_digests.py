"""Per-tensor digests and lineage in every output ``convert`` writes (docs/digests.md): present, named, taken
unchanged by the plain loaders, checked by ``verify`` (exit 3 naming the tensor; a URL's on the bytes it
fetched), ``load`` and ``load_into`` (refused, the model unchanged: by default where the check rides on a pass
the load makes anyway, everywhere with ``check_digests=True``; ``check_digests=False`` skips it); lineage
deterministic, shown by ``inspect`` (of a URL too, from its header or records alone)."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptfix
from ckptfix.cli.commands import cli
from ckptfix.core.torch_free import ENV_SWITCH
from ckptfix.formats import sniff
from ckptfix.ops.convert import steps
from ckptfix.safety import digests
from tests.file_server import FileServer
from tests.remote_servers import http_server
from tests.remote_sources import file_bytes

SERVERS = (http_server,)  # the fixture, registered by being in this module's namespace
LINEAR = ["--model", "torch.nn:Linear", "--arg", "in_features=3", "--arg", "out_features=4", "--no-forward"]

#: every output kind convert writes: (name, destination, convert options, torch-free switch)
KINDS = [
    ("pth torch-free", "out.pth", {}, "1"),
    ("pth streamed", "out.pth", {}, "0"),
    ("pth torch.save", "out.pth", {"trust": True}, "1"),
    ("pth cast", "out.pth", {"dtype": "fp16"}, "1"),
    ("safetensors torch-free", "out.safetensors", {}, "1"),
    ("safetensors torch", "out.safetensors", {}, "0"),
    ("safetensors cast", "out.safetensors", {"dtype": "bf16"}, "1"),
    ("sharded safetensors", "shards", {"max_shard_size": 40}, "1"),
    ("sharded pth", "shards", {"max_shard_size": 40, "format": "pth"}, "0"),
    ("dcp", "dcp", {"format": "dcp"}, "1"),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.save'd nn.Linear(3, 4) state dict plus a tied alias, and a buffer (``module.`` wrapped)."""
    torch.manual_seed(0)
    sd = {f"module.{k}": v for k, v in torch.nn.Linear(3, 4).state_dict().items()}
    path = tmp_path_factory.mktemp("digests") / "src.pth"
    torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def outputs(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each kind of output, converted once."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, dst, options, torch_free in KINDS:
            mp.setenv(ENV_SWITCH, torch_free)
            path = tmp_path_factory.mktemp(name.replace(" ", "_").replace(".", "_")) / dst
            ckptfix.convert(source, path, **options)
            out[name] = path
    return out


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix != ".json") if path.is_dir() else [path]  # (DCP's sidecar too)


@pytest.mark.parametrize("kind", [k[0] for k in KINDS])
def test_every_output_records_digests_and_plain_loaders_take_it(kind: str, outputs: dict[str, Path],
                                                                  source: Path) -> None:
    path = outputs[kind]
    _, fmt = ckptfix.formats.resolve(str(path))
    recorded = digests.read(str(path), fmt)
    assert recorded.digests is not None
    assert sorted(n for d in recorded.digests for n in d.names) == ["bias", "weight"]
    assert digests.failures(str(path), fmt) == []
    assert ckptfix.scan(path).ok  # the records added are accounted for, as torch's own are
    assert recorded.lineage is not None and recorded.lineage["source"]["name"] == "src.pth"
    want = {k.removeprefix("module."): v for k, v in torch.load(source, weights_only=True).items()}
    got: dict[str, Any] = {}
    for f in _files(path):
        if f.name == "__0_0.distcp":  # DCP: torch's own converter
            dcp_to_torch_save(path, path.parent / "plain.pth")
            got.update(torch.load(path.parent / "plain.pth", weights_only=True))
        elif f.suffix == ".distcp" or f.name == ".metadata":
            continue
        elif f.suffix == ".safetensors":
            got.update(load_file(f))
        else:
            plain, mapped = torch.load(f, weights_only=True), torch.load(f, weights_only=True, mmap=True)
            assert plain.keys() == mapped.keys() and all(torch.equal(plain[k], mapped[k]) for k in plain)
            got.update(plain)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)


def test_tied_tensors_share_a_digest(tmp_path: Path) -> None:
    w = torch.arange(6.0).reshape(2, 3)
    torch.save({"emb": w, "head": w, "b": torch.ones(2)}, tmp_path / "tied.pth")
    for dst in ("o.pth", "o.safetensors"):
        ckptfix.convert(tmp_path / "tied.pth", tmp_path / dst)
        found = digests.read(str(tmp_path / dst), sniff(str(tmp_path / dst)))
        assert found.digests is not None
        names = {n: d.crc for d in found.digests for n in d.names}
        assert names["emb"] == names.get("head", names["emb"])  # one record (pth) or an alias of it (safetensors)
    pth = digests.read(str(tmp_path / "o.pth"), "torch-zip").digests
    assert pth is not None and [d.names for d in pth if "emb" in d.names] == [("emb", "head")]


@pytest.mark.parametrize("compact", [False, True], ids=["ties-stored", "compact-ties"])
@pytest.mark.parametrize("torch_free", ["1", "0"], ids=["torch-free", "streamed"])
def test_digests_of_views_are_their_bytes(torch_free: str, compact: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of one storage (overlapping, nested, touching, a row), a tied pair and the whole storage: each
    safetensors digest, computed from the source record's bytes as they pass, is the CRC-32 of that tensor's
    bytes (computed here by the standard library) and of its ``data_offsets`` range in the output; a tied name
    stored twice has its twin's digest."""
    base = torch.arange(64.0)
    sd = {"whole": base, "slice": base[8:24], "overlap": base[16:40], "touching": base[40:41], "tied": base[8:24],
          "row": base.view(8, 8)[2], "other": torch.ones(3)}
    torch.save(sd, tmp_path / "views.pth")
    monkeypatch.setenv(ENV_SWITCH, torch_free)
    if torch_free == "1":  # (the torch-free writer, not a fallback to the streamed one)
        monkeypatch.setattr(steps, "write_with_torch", lambda *a, **k: pytest.fail("the torch path was taken"))
    out = tmp_path / "views.safetensors"
    ckptfix.convert(tmp_path / "views.pth", out, compact_ties=compact)
    found = digests.read(str(out), "safetensors").digests
    assert found is not None and digests.failures(str(out), "safetensors") == []
    crcs = {n: d.crc for d in found for n in d.names}
    assert sorted(crcs) == sorted(set(sd) - ({"tied"} if compact else set()))  # (an alias: its tensor's digest)
    assert crcs.get("tied", crcs["slice"]) == crcs["slice"]
    assert all(crc == zlib.crc32(sd[n].numpy().tobytes()) for n, crc in crcs.items())


def _flip(path: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s stored bytes."""
    found = digests.read(str(path), sniff(str(path))).digests
    assert found is not None
    d = next(d for d in found if tensor in d.names)
    with open(path, "r+b") as f:
        f.seek(d.offset + d.size // 2)
        byte = f.read(1)
        f.seek(d.offset + d.size // 2)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def damaged(outputs: dict[str, Path], tmp_path: Path) -> Path:
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(outputs["safetensors torch-free"].read_bytes())
    _flip(path, "weight")
    return path


def test_verify_names_the_damaged_tensor(damaged: Path, cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["verify", str(damaged), *LINEAR, "--json"])
    assert res.exit_code == 3, res.output
    failures = json.loads(res.stdout)["failures"]
    assert len(failures) == 1 and "tensor 'weight' does not match its recorded digest" in failures[0]


def test_verify_passes_an_intact_output(outputs: dict[str, Path], cli_runner: Any) -> None:
    res = cli_runner.invoke(cli, ["verify", str(outputs["safetensors torch"]), *LINEAR])
    assert res.exit_code == 0, res.output


def _linear(built: bool) -> torch.nn.Module:
    if built:
        return torch.nn.Linear(3, 4)
    with torch.device("meta"):
        return torch.nn.Linear(3, 4)


@pytest.mark.parametrize("kind", ["safetensors torch-free", "pth torch-free"])
@pytest.mark.parametrize("built", [True, False], ids=["built", "meta-built"])
def test_load_and_load_into_refuse_damage(kind: str, built: bool, outputs: dict[str, Path], tmp_path: Path) -> None:
    """A flipped byte in one tensor: ``load_into`` on meta refuses by default (the check rides on its value pass),
    a built model and ``load`` with ``check_digests=True`` (a pass of their own), each naming the tensor, the model
    unchanged; ``check_digests=False`` loads the damaged values, as the default does where the check would cost a
    pass of its own."""
    path = tmp_path / outputs[kind].name
    path.write_bytes(outputs[kind].read_bytes())
    _flip(path, "weight")
    with pytest.raises(ckptfix.errors.FormatError, match="tensor 'weight' does not match"):
        ckptfix.load(path, check_digests=True)
    model = _linear(built)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckptfix.errors.FormatError, match="tensor 'weight'.*nothing was loaded"):
        ckptfix.load_into(model, path, **({"check_digests": True} if built else {}))
    after = model.state_dict()
    assert all(v.is_meta for v in after.values()) if not built else all(
        torch.equal(before[k], v) for k, v in after.items())
    assert "weight" in ckptfix.load(path) and "weight" in ckptfix.load(path, check_digests=False)
    if built:  # by default: no pass of its own, the damaged values loaded
        ckptfix.load_into(_linear(built), path)
    ckptfix.load_into(model, path, check_digests=False)
    intact = load_file(outputs["safetensors torch-free"])["weight"]
    assert not torch.equal(intact, model.weight.detach()) and torch.equal(intact, ckptfix.load(outputs[kind])["weight"])


@pytest.mark.parametrize("asked, refused", [(None, False), (True, True)], ids=["default", "check_digests=True"])
def test_a_meta_built_load_without_the_value_check_touches_no_byte_unless_asked(asked: bool | None, refused: bool,
                                                                              outputs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """``check_values=False`` on meta: no pass over the file, so by default no digest check either (views of the
    file only); ``check_digests=True`` makes the pass for the CRC-32s alone and refuses the damage."""
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(outputs["safetensors torch-free"].read_bytes())
    _flip(path, "weight")
    model = _linear(built=False)
    options = {} if asked is None else {"check_digests": asked}
    if refused:
        with pytest.raises(ckptfix.errors.FormatError, match="tensor 'weight'.*nothing was loaded"):
            ckptfix.load_into(model, path, check_values=False, **options)
    else:
        assert ckptfix.load_into(model, path, check_values=False, **options).assigned == 2


@pytest.mark.parametrize("kind", ["safetensors torch-free", "pth torch-free", "sharded safetensors"])
def test_a_meta_built_load_checks_digests_in_its_value_pass(kind: str, outputs: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Meta-built: no byte read twice for the digests — every CRC-32 comes from the chunks the NaN/Inf check took."""
    def reread(*args: Any) -> int:
        raise AssertionError(f"read again: {args}")

    monkeypatch.setattr(digests, "crc32_range", reread)
    monkeypatch.setattr(digests, "mismatches", reread)
    model = _linear(built=False)
    report = ckptfix.load_into(model, outputs[kind])
    assert report.assigned == 2 and torch.equal(model.weight.detach(), ckptfix.load(outputs[kind],
                                                                                   check_digests=False)["weight"])


def test_a_damaged_pth_names_its_tensor(outputs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "damaged.pth"
    path.write_bytes(outputs["pth torch-free"].read_bytes())
    _flip(path, "bias")
    lines = digests.failures(str(path), "torch-zip")
    assert len(lines) == 1 and "tensor 'bias' does not match" in lines[0]


def test_lineage_is_deterministic(source: Path, tmp_path: Path) -> None:
    def lineage(dst: str, **options: Any) -> Any:
        ckptfix.convert(source, tmp_path / dst, force=True, **options)
        return digests.read(str(tmp_path / dst), sniff(str(tmp_path / dst))).lineage

    first = lineage("a.safetensors", to="ddp")
    assert (tmp_path / "a.safetensors").read_bytes() == (lineage("b.safetensors", to="ddp") and
                                                         (tmp_path / "b.safetensors").read_bytes())
    assert first == lineage("c.pth", to="ddp")
    (tmp_path / "again").mkdir()  # (a torch zip's records are named after its file: the same name, elsewhere)
    assert (tmp_path / "c.pth").read_bytes() == (lineage("again/c.pth", to="ddp") and
                                                 (tmp_path / "again" / "c.pth").read_bytes())
    assert first["transform"] == "--to ddp" and first["ckptfix"] == ckptfix.__version__
    assert lineage("d.safetensors", to="ddp", checksums=True)["source"]["sha256"] == ckptfix.convert(
        source, tmp_path / "e.safetensors", to="ddp", checksums=True).sha256_in
    os.utime(source, ns=(1, 1))  # a touched source is another source
    assert lineage("a.safetensors", to="ddp")["source"]["mtime_ns"] == 1


def test_inspect_shows_digests_and_lineage(outputs: dict[str, Path], cli_runner: Any) -> None:
    path = str(outputs["pth torch-free"])
    text = cli_runner.invoke(cli, ["inspect", path]).output
    assert "digests:        crc32, 2 tensors" in text and "lineage:        ckptfix" in text
    info = json.loads(cli_runner.invoke(cli, ["inspect", path, "--json"]).stdout)
    assert info["digests"] == {"algorithm": "crc32", "tensors": 2}
    assert info["lineage"]["source"]["name"] == "src.pth"


@pytest.mark.parametrize("kind", ["pth torch-free", "safetensors torch-free", "sharded safetensors"])
def test_inspect_of_a_url_shows_the_local_digests_and_lineage(kind: str, outputs: dict[str, Path],
                                                              http_server: FileServer, cli_runner: Any) -> None:
    local = outputs[kind]
    served = http_server.root / local.name
    (shutil.copytree if local.is_dir() else shutil.copy2)(local, served)
    url = http_server.url(local.name)
    rows = [[line for line in cli_runner.invoke(cli, ["inspect", where]).output.splitlines()
             if line.lstrip().startswith(("digests:", "lineage:"))] for where in (str(local), url)]
    assert len(rows[0]) == 2 and rows[0] == rows[1]
    info = [json.loads(cli_runner.invoke(cli, ["inspect", where, "--json"]).stdout) for where in (str(local), url)]
    assert info[1]["digests"] == info[0]["digests"] and info[1]["lineage"] == info[0]["lineage"]
    assert info[1]["bytes_fetched"] == file_bytes(http_server) // 2  # (each inspect counted what the server sent)


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MiB nn.Linear(512, 512) converted to safetensors (digests recorded): fetching it twice would show."""
    root = tmp_path_factory.mktemp("large")
    torch.save(torch.nn.Linear(512, 512).state_dict(), root / "src.pth")
    ckptfix.convert(root / "src.pth", root / "model.safetensors")
    return root / "model.safetensors"


@pytest.mark.parametrize("model", [[], ["--model", "torch.nn:Linear", "--arg", "in_features=512", "--arg",
                                        "out_features=512", "--no-forward"]], ids=["model-free", "with-model"])
@pytest.mark.parametrize("intact", [True, False], ids=["intact", "damaged"])
def test_verify_of_a_url_checks_the_digests_of_what_it_fetched(model: list[str], intact: bool, large: Path,
                                                               http_server: FileServer, cli_runner: Any) -> None:
    served = http_server.root / large.name
    shutil.copy2(large, served)
    if not intact:
        _flip(served, "weight")
    res = cli_runner.invoke(cli, ["verify", http_server.url(large.name), *model, "--json"])
    assert res.exit_code == (0 if intact else 3), res.output
    failures = json.loads(res.stdout)["failures"]
    assert failures == [] if intact else (len(failures) == 1 and "tensor 'weight' does not match" in failures[0]
                                          and http_server.url(large.name) in failures[0])
    assert file_bytes(http_server) < 1.25 * large.stat().st_size  # every byte fetched once: none again for the check


def test_load_and_load_into_of_a_url_refuse_a_corrupted_served_byte(large: Path, http_server: FileServer) -> None:
    served = http_server.root / large.name
    shutil.copy2(large, served)
    _flip(served, "weight")
    url = http_server.url(large.name)
    with pytest.raises(ckptfix.errors.FormatError, match="tensor 'weight' does not match"):
        ckptfix.load(url)
    with torch.device("meta"):
        model = torch.nn.Linear(512, 512)
    with pytest.raises(ckptfix.errors.FormatError, match="tensor 'weight'.*nothing was loaded"):
        ckptfix.load_into(model, url)
    assert model.weight.is_meta
    assert file_bytes(http_server) < 2.5 * large.stat().st_size  # each of the two fetched its bytes once
    assert ckptfix.load_into(model, url, check_digests=False).assigned == 2


@pytest.mark.parametrize("chunks", [[], [(0, 4096)], [(0, 100), (100, 900), (2000, 3000)], [(50, 500), (100, 300)],
                                    [(0, 1000), (900, 1200), (1000, 4096)], [(4000, 5000)]],
                         ids=["none", "whole", "gaps", "overlap", "overlap-then-tile", "past-the-end"])
def test_a_tally_joins_its_chunks_and_reads_only_its_gaps(chunks: list[tuple[int, int]]) -> None:
    """The CRC-32 of any range from whatever chunks a pass recorded (in any order, gaps, overlaps, past the range's
    end), the gaps read; zlib's combine without a C one (the fallback) gives the same values."""
    import zlib

    from ckptfix.core import checksums

    data = bytes(range(256)) * 20
    tally, read = checksums.Tally(), []
    for start, end in reversed(chunks):
        tally.add("f", start, data[start:end])

    def gap(offset: int, size: int) -> int:
        read.append(size)
        return zlib.crc32(data[offset : offset + size])

    for offset, size in [(0, 4096), (100, 3000), (0, 0), (4095, 1)]:
        read.clear()
        assert tally.crc("f", offset, size, gap) == zlib.crc32(data[offset : offset + size])
        assert sum(read) <= size and (chunks != [(0, 4096)] or size != 4096 or not read)
    assert checksums.crc32_combine_gf2(zlib.crc32(data[:9]), zlib.crc32(data[9:700]), 691) == zlib.crc32(data[:700])
