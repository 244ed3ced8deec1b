"""URL schemes as a table (issue 25): every scheme is one backend in ``ckptfix.core.remote``'s table, ``is_remote``
agrees with it, and a scheme registered through ``ckptfix.register_url_scheme`` (tests/memory_backend.py's
``mem://``, no server) is read by every verb exactly as the local file is — and refused, with NeedsLocalCopy, by
the verbs the format registry's ``from_url`` leaves out. The real servers' tests (Range, ETag, redirects,
deadlines) stay in tests/ops/test_remote*.py and tests/test_remote_servers.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix import errors
from ckptfix.core import locations, remote
from ckptfix.parse.format_registry import FORMATS, URL_VERBS
from ckptfix.parse.sniff import sniff
from tests import remote_sources
from tests.memory_backend import MemoryBackend, registered

#: fixtures of each kind: a torch zip (DDP keys), safetensors, DCP, legacy, TorchScript; "sharded" is made here
FIXTURES = ["mlp_ddp.pth", "mlp_safetensors.safetensors", "mlp_fsdp2", "mlp_legacy.pth", "mlp_torchscript.pt", "sharded"]
#: each verb → the registry's ``from_url`` verb that says whether a URL may be given to it
VERBS = {"describe": "describe", "inspect": "read", "read": "read", "load": "read", "load_into": "read",
         "scan": "scan", "convert": "convert"}


@pytest.fixture
def mem() -> Iterator[MemoryBackend]:
    with registered(MemoryBackend()) as backend:
        yield backend


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "sharded"
    ckptfix.convert(fixtures_dir / "mlp_safetensors.safetensors", out, max_shard_size="1KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    return out


# -- the table -------------------------------------------------------------------------------------------------

def test_every_scheme_has_a_backend() -> None:
    assert set(remote.SCHEMES) == {"http", "https", "s3", "hf"}
    for scheme in remote.SCHEMES:
        assert isinstance(remote.backend_for(f"{scheme}://host/model.pth"), remote.Backend), scheme
        assert isinstance(remote.backend_for(f"{scheme.upper()}://host/model.pth"), remote.Backend), scheme


@pytest.mark.parametrize("location", ["https://h/m.pth", "HTTP://h/m.pth", "s3://b/k.pth", "hf://org/repo/m.pth",
                                      "mem://k/m.pth", "gs://b/m.pth", "/tmp/m.pth", "m.pth", "C:\\m.pth", "s3:/b/k",
                                      "https", Path("/tmp/m.pth"), None])
def test_is_remote_is_the_table(location: Any, mem: MemoryBackend) -> None:
    scheme, sep, _ = location.partition("://") if isinstance(location, str) else ("", "", "")
    assert locations.is_remote(location) == bool(sep and scheme.lower() in remote.SCHEMES)
    assert locations.is_remote(location) == (remote.backend_for(location) is not None)


def test_register_and_unregister() -> None:
    backend = MemoryBackend()
    assert not locations.is_remote("mem://k")
    with registered(backend):
        assert "mem" in remote.SCHEMES and remote.backend_for("MEM://k") is backend and locations.is_remote("mem://k")
        with pytest.raises(ValueError, match="unregister it first"):
            ckptfix.register_url_scheme("mem", MemoryBackend())
    assert "mem" not in remote.SCHEMES and not locations.is_remote("mem://k")
    with pytest.raises(KeyError):
        ckptfix.unregister_url_scheme("mem")


@pytest.mark.parametrize("scheme, backend, error", [("c", MemoryBackend(), ValueError), ("9p", MemoryBackend(), ValueError),
                                                    ("my scheme", MemoryBackend(), ValueError),
                                                    ("mem", object(), TypeError)])
def test_register_refuses(scheme: str, backend: Any, error: type) -> None:
    with pytest.raises(error):
        ckptfix.register_url_scheme(scheme, backend)
    assert scheme not in remote.SCHEMES


def test_an_unregistered_scheme_is_a_local_path(tmp_path: Path) -> None:
    """Without a backend, ``mem://…`` is a local (relative) path, as any unknown scheme always was."""
    with pytest.raises(errors.MissingFileError) as unregistered:
        ckptfix.describe("mem://d/model.pth")
    assert not isinstance(unregistered.value, errors.RemoteError)
    with pytest.raises(errors.MissingFileError) as local:
        ckptfix.describe("nothing/model.pth")
    assert str(unregistered.value) == str(local.value).replace("nothing/model.pth", "mem://d/model.pth")


def test_from_url_names_known_verbs_within_the_formats_abilities() -> None:
    for fmt in FORMATS.values():
        assert fmt.from_url <= set(URL_VERBS), fmt.name
        assert "describe" not in fmt.from_url or fmt.describe, fmt.name  # described from a URL: without torch
        assert "convert" not in fmt.from_url or fmt.copy_without_torch, fmt.name  # a URL converts torch-free only


# -- every verb through a registered scheme ----------------------------------------------------------------------

def _local(name: str, fixtures_dir: Path, sharded: Path) -> Path:
    return sharded if name == "sharded" else fixtures_dir / name


def _as_local(report: Any, url: str, local: Path) -> dict[str, Any]:
    """A report's dict with the URL (and a remote source's output folder) spelled as the local path's, without what
    only a URL's report has, or the clock and the process's memory measure."""
    text = json.dumps(report.to_dict()).replace(url, str(local)).replace("/remote/out.", "/local/out.")
    out = json.loads(text)
    for measured in ("bytes_fetched", "seconds", "peak_rss"):
        out.pop(measured, None)
    for recorded in ("digests", "lineage"):  # inspect shows a local file's, not a URL's (docs/digests.md)
        out.pop(recorded, None)
    out.pop("bytes_written", None)  # (an output's lineage names its source: a URL's is not its local copy's length)
    return out


def _same_tensors(got: Any, want: Any) -> None:
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].stride() == tensor.stride(), key
        assert torch.equal(got[key], tensor), key


def _run(verb: str, source: str, tmp: Path, train: Any) -> Callable[[], Any]:
    """The verb on ``source`` (a path or a URL), returning what the local and remote results are compared by."""
    def run() -> Any:
        if verb in ("describe", "inspect"):
            return getattr(ckptfix, verb)(source)
        if verb == "scan":
            return ckptfix.scan(source, check_crc=False)  # (a URL's scan reads no tensor bytes: no CRCs)
        if verb == "read":
            return ckptfix.read(source)
        if verb == "load":
            return ckptfix.load(source)
        if verb == "load_into":
            torch.manual_seed(0)
            model = train.mlp()
            return ckptfix.load_into(model, source), model.state_dict()
        out = tmp / ("remote" if locations.is_remote(source) else "local") / "out.safetensors"
        out.parent.mkdir()
        return ckptfix.convert(source, out), remote_sources.masked(out)  # (its lineage names the source)
    return run


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("name", FIXTURES)
def test_a_registered_scheme_reads_as_the_local_file(mem: MemoryBackend, fixtures_dir: Path, sharded: Path,
                                                     tmp_path: Path, train: Any, name: str, verb: str) -> None:
    local = _local(name, fixtures_dir, sharded)
    url = mem.put_tree(local, f"bucket/{name}")
    fmt = sniff(str(local))
    assert sniff(url) == fmt
    if VERBS[verb] not in FORMATS[fmt].from_url:
        with pytest.raises(errors.NeedsLocalCopy) as refused:
            _run(verb, url, tmp_path, train)()
        assert str(refused.value).startswith(f"{url}: ") and str(refused.value).endswith("; download it first")
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # nothing written
        return
    want, got = _run(verb, str(local), tmp_path, train)(), _run(verb, url, tmp_path, train)()
    if verb in ("describe", "inspect", "scan"):
        assert got.bytes_fetched > 0
        assert _as_local(got, url, local) == _as_local(want, str(local), local)
    elif verb == "read":
        assert _as_local(got, url, local) == _as_local(want, str(local), local)
        _same_tensors(got.state_dict, want.state_dict)
    elif verb == "load":
        _same_tensors(got, want)
    elif verb == "load_into":
        assert _as_local(got[0], url, local) == _as_local(want[0], str(local), local)
        _same_tensors(got[1], want[1])
    else:
        assert got[1] == want[1]  # the output, byte for byte
        assert _as_local(got[0], url, local) == _as_local(want[0], str(local), local)


@pytest.mark.parametrize("name", ["mlp_ddp.pth", "mlp_safetensors.safetensors"])
def test_a_registered_scheme_is_written_as_the_local_file(mem: MemoryBackend, fixtures_dir: Path, tmp_path: Path,
                                                          name: str) -> None:
    """A backend that uploads takes convert's one-file output: the bytes the local output has; a directory output
    and an existing object without force are refused before anything is written."""
    src = fixtures_dir / name
    want = ckptfix.convert(src, tmp_path / "out.safetensors")
    report = ckptfix.convert(src, mem.url("out/model.safetensors"))
    assert mem.objects["out/model.safetensors"] == Path(want.dst).read_bytes()
    assert report.dst == mem.url("out/model.safetensors")
    with pytest.raises(errors.DestinationError, match="already exists"):
        ckptfix.convert(src, mem.url("out/model.safetensors"))
    with pytest.raises(errors.DestinationError, match="not a directory"):
        ckptfix.convert(src, mem.url("out/shards"), max_shard_size="1KB")
    assert list(mem.objects) == ["out/model.safetensors"]
