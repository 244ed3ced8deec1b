"""``ckptfix.read/load(URL)`` and ``load_into(model, URL)`` (issue 19): a remote checkpoint's structure read from its
headers, each storage's bytes fetched once into memory (or, for a DTensor, only this rank's ranges), never
``torch.load`` of the file and never a download; the result bit for bit the local read's and load's. Real servers
on 127.0.0.1 (tests/remote_servers.py): the HTTP file server, the Hub, moto's S3; the FSDP2 case runs 2 gloo
ranks (tests/dist_harness.py) that fetch from the HTTP server.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import ckptfix
from ckptfix import errors
from tests import dist_harness, sharded_ranks
from tests.file_server import FileServer
from tests.hub_server import REPO
from tests.remote_servers import http_server, hub_server, s3_server
from tests.remote_sources import file_bytes

SERVERS = (http_server, hub_server, s3_server)  # the fixtures, registered by being in this module's namespace


class Net(nn.Module):
    """A Linear, a BatchNorm (its own ``_load_from_state_dict``, an int64 buffer) and a Linear."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def trained(width: int = 32) -> Net:
    torch.manual_seed(1)
    net = Net(width)
    net(torch.randn(8, 16))  # BatchNorm's running stats and num_batches_tracked move
    return net.eval()


def ddp_state_dict(net: nn.Module) -> dict[str, torch.Tensor]:
    """What DDP's ``state_dict()`` holds: every key under ``module.``."""
    return {f"module.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def write(root: Path, fmt: str, net: nn.Module) -> str:
    """``net``'s DDP state dict saved as ``fmt`` under ``root`` by the real writers: the name to fetch."""
    sd = ddp_state_dict(net)
    if fmt == "zip":
        torch.save({"state_dict": sd, "epoch": 3}, root / "model.pth")
        return "model.pth"
    if fmt == "safetensors":
        save_file(sd, str(root / "model.safetensors"))
        return "model.safetensors"
    if fmt == "sharded":
        save_file(sd, str(root / "whole.safetensors"))
        ckptfix.convert(root / "whole.safetensors", root / "sharded", max_shard_size=2_000, to="ddp")
        (root / "whole.safetensors").unlink()
        return "sharded"
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, as intended
        dcp.save({"model": sd, "step": 7}, checkpoint_id=str(root / "dcp"))
    return "dcp"


class Remote:
    """One backend's server: write files under ``root``, ``publish()`` them, fetch ``url(name)``."""

    def __init__(self, request: pytest.FixtureRequest, backend: str, tmp_path: Path):
        self.server = request.getfixturevalue("hub_server" if backend == "hf" else f"{backend}_server")
        self.backend = backend
        self.root = tmp_path / "bucket" if backend == "s3" else self.server.root
        self.root.mkdir(exist_ok=True)

    def publish(self) -> None:
        if self.backend == "s3":
            self.server.upload(self.root, key="")

    def url(self, name: str) -> str:
        return f"hf://{REPO}/{name}" if self.backend == "hf" else self.server.url(name)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, with the same type, dtype, layout and requires_grad."""
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad and a.device == b.device
            and torch.equal(a.detach().view(torch.uint8) if a.dtype.is_floating_point and a.dtype.itemsize == 1 else a.detach(),
                            b.detach().view(torch.uint8) if b.dtype.is_floating_point and b.dtype.itemsize == 1 else b.detach()))


@pytest.mark.parametrize("target", ["built", "meta"])
@pytest.mark.parametrize("fmt", ["zip", "safetensors", "sharded", "dcp"])
@pytest.mark.parametrize("backend", ["http", "s3", "hf"])
def test_load_into_from_a_url_is_the_local_load(request: pytest.FixtureRequest, tmp_path: Path, backend: str, fmt: str,
                                                 target: str) -> None:
    remote = Remote(request, backend, tmp_path)
    net = trained()
    name = write(remote.root, fmt, net)
    remote.publish()

    def model() -> Net:
        if target == "meta":
            with torch.device("meta"):
                return Net().eval()
        torch.manual_seed(0)
        return Net().eval()

    local, fetched = model(), model()
    local_report = ckptfix.load_into(local, remote.root / name)
    report = ckptfix.load_into(fetched, remote.url(name))
    assert report.fix == local_report.fix == "strip module."  # the DDP file repaired the same way
    assert report.bytes_fetched is not None and report.bytes_fetched > 0 and local_report.bytes_fetched is None
    want, got = local.state_dict(), fetched.state_dict()
    assert list(got) == list(want) and all(same_tensor(got[k], want[k]) for k in want)
    x = torch.randn(5, 16)
    assert torch.equal(fetched(x), net(x))
    fresh = Net().eval()
    fresh.load_state_dict(ckptfix.load(remote.url(name)), strict=True)  # the state dict, normalised: torch's own load
    assert torch.equal(fresh(x), net(x))


def _odd_tensors() -> dict[str, Any]:
    """Every kind of tensor a state dict holds: a Parameter, a view at a storage offset, a transposed (strided)
    view, tied names of one tensor, bfloat16, float8, an int64 scalar (BatchNorm's), a tensor requiring grad; and
    a real module's state dict with its ``_metadata``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g)
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(4, 3, generator=g))
    sd = bn.state_dict()
    sd.update({"param": nn.Parameter(w), "tail": w[2:], "t": w.t(), "tied": w,
               "bf16": torch.randn(5, generator=g).bfloat16(), "f8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
               "grad": torch.ones(3, requires_grad=True), "empty": torch.zeros(0, 4)})
    return {"state_dict": sd, "epoch": 3, "lr": 0.1}


def _storages(sd: dict[str, torch.Tensor]) -> list[set[str]]:
    """The keys grouped by the storage they share (ties and views)."""
    groups: dict[int, set[str]] = {}
    for k, v in sd.items():
        if v.untyped_storage().nbytes():
            groups.setdefault(v.untyped_storage().data_ptr(), set()).add(k)
    return sorted(groups.values(), key=sorted)


@pytest.mark.parametrize("backend", ["http", "s3"])
def test_read_of_a_url_is_torch_load_bit_for_bit(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    remote = Remote(request, backend, tmp_path)
    torch.save(_odd_tensors(), remote.root / "odd.pth")
    remote.publish()
    want = torch.load(remote.root / "odd.pth", weights_only=True)
    ckpt = ckptfix.read(remote.url("odd.pth"))
    got = ckpt.state_dict
    assert list(got) == list(want["state_dict"])
    assert all(same_tensor(got[k], v) for k, v in want["state_dict"].items())
    assert got._metadata == want["state_dict"]._metadata  # type: ignore[attr-defined]
    assert _storages(got) == _storages(want["state_dict"])  # ties and views share one storage, as torch.load's
    assert ckpt.extra == {"epoch": 3, "lr": 0.1} and ckpt.bytes_fetched and ckpt.stats == ckptfix.read(
        remote.root / "odd.pth").stats
    loaded = ckptfix.load(remote.url("odd.pth"))
    assert all(same_tensor(loaded[k], v) for k, v in ckptfix.load(remote.root / "odd.pth").items())


def test_read_of_a_safetensors_url_is_the_local_read(http_server: FileServer) -> None:
    sd = {k: v for k, v in _odd_tensors()["state_dict"].items() if k not in ("tail", "t", "tied", "grad")}
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(http_server.root / "m.safetensors"))
    want = ckptfix.read(http_server.root / "m.safetensors").state_dict
    got = ckptfix.read(http_server.url("m.safetensors")).state_dict
    assert list(got) == list(want) and all(same_tensor(got[k], v) for k, v in want.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_map_location_cuda_without_a_gpu_is_the_local_error(http_server: FileServer) -> None:
    torch.save(_odd_tensors(), http_server.root / "odd.pth")
    with pytest.raises(errors.DeviceError) as local:
        ckptfix.read(http_server.root / "odd.pth", map_location="cuda:0")
    with pytest.raises(errors.DeviceError) as remote:
        ckptfix.read(http_server.url("odd.pth"), map_location="cuda:0")
    assert str(remote.value).replace(http_server.url("odd.pth"), "F") == str(local.value).replace(
        str(http_server.root / "odd.pth"), "F")


@pytest.mark.parametrize("fmt", ["zip", "safetensors"])
def test_a_load_fetches_the_file_once(http_server: FileServer, fmt: str) -> None:
    """A 4 MiB checkpoint into a meta-built model: the server sends about the file's size (its headers' blocks
    overlap the data a little), not twice; the report counts every byte it sent."""
    net = trained(width=16_384)
    name = write(http_server.root, fmt, net)
    size = (http_server.root / name).stat().st_size
    with torch.device("meta"):
        model = Net(16_384).eval()
    report = ckptfix.load_into(model, http_server.url(name))
    sent = file_bytes(http_server)
    assert report.bytes_fetched == sent and size <= sent < 1.1 * size, (sent, size)
    assert torch.equal(model.inp.weight, net.inp.weight)


DELAY, TENSORS = 0.25, 24


@pytest.mark.parametrize("how", ["load", "built", "meta"])
def test_many_small_tensors_are_fetched_at_once(http_server: FileServer, how: str) -> None:
    """Every request to the file waits DELAY seconds (a far server's round trip): one tensor after another, TENSORS
    of them take TENSORS × DELAY; fetched at once, a few round trips. The bound, half the one-by-one time, holds
    on any machine; before fetch_ahead the load took more than TENSORS × DELAY."""
    sd = {f"layers.{i}.weight": torch.randn(4096) for i in range(TENSORS)}  # 16 KiB each: one request each
    save_file(sd, str(http_server.root / "many.safetensors"))
    model = nn.Module()
    with torch.device("meta" if how == "meta" else "cpu"):
        model.layers = nn.ModuleList(nn.Module() for _ in range(TENSORS))
        for layer in model.layers:
            layer.weight = nn.Parameter(torch.zeros(4096))
    http_server.delay["/many.safetensors"] = DELAY
    start = time.perf_counter()
    if how == "load":
        got = ckptfix.load(http_server.url("many.safetensors"))
    else:
        ckptfix.load_into(model, http_server.url("many.safetensors"))
        got = model.state_dict()
    elapsed = time.perf_counter() - start
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert elapsed < TENSORS * DELAY / 2, (elapsed, http_server.counts.total_requests)


@pytest.mark.parametrize("how", ["load_into", "load_into meta", "load_into strict_values", "load"])
def test_the_crc_of_every_fetched_record_is_checked(http_server: FileServer, how: str) -> None:
    """A record damaged on the server (its zip CRC-32 not updated): every load from a URL refuses it (the bytes
    came over a network and are in memory already), the model untouched; the intact file loads."""
    net = trained()
    name = write(http_server.root, "zip", net)
    data = bytearray((http_server.root / name).read_bytes())
    at = data.find(net.out.weight.detach().numpy().tobytes())
    data[at] ^= 0xFF  # one byte of a record changed, its zip CRC-32 not
    (http_server.root / "damaged.pth").write_bytes(bytes(data))
    with torch.device("meta" if how == "load_into meta" else "cpu"):
        model = Net().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def load(url: str) -> None:
        if how == "load":
            model.load_state_dict(ckptfix.load(url))
        else:
            ckptfix.load_into(model, url, strict_values=how.endswith("strict_values"))

    with pytest.raises(errors.FormatError, match="does not match the CRC-32 its zip records"):
        load(http_server.url("damaged.pth"))
    assert all(v.is_meta if how == "load_into meta" else torch.equal(v, before[k]) for k, v in model.state_dict().items())
    load(http_server.url(name))
    assert torch.equal(model.out.weight, net.out.weight)


def _requests(server: FileServer, path: str) -> int:
    with server.counts.lock:
        return server.counts.requests.get(path, 0)


@pytest.mark.parametrize("failure", ["missing", "changing", "shrinking"])
def test_a_failed_fetch_is_one_error_and_the_model_is_untouched(http_server: FileServer, failure: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    name = write(http_server.root, "zip", trained(width=4096))
    model = Net(4096).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if failure == "missing":
        url, error, message = http_server.url("nope.pth"), errors.MissingFileError, "no such file"
    else:  # the file replaced once its structure has been read: while its tensors are being fetched
        ckptfix.inspect(http_server.url(name))
        structure = _requests(http_server, f"/{name}")
        content = (http_server.root / name).read_bytes()  # shrinking: its tensors now past its end (HTTP 416)
        http_server.change_after(name, 2 * structure + 1, content if failure == "changing" else content[:1])
        url, error, message = http_server.url(name), errors.RemoteError, "changed while it was being read"
    with pytest.raises(error, match=message) as raised:
        ckptfix.load_into(model, url)
    assert isinstance(raised.value, errors.CkptfixError)
    if failure != "missing":
        assert _requests(http_server, f"/{name}") > 2 * structure + 1  # it failed on a tensor's fetch
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- FSDP2: each rank fetches its own shards' ranges ------------------------------------------------------------

def run_rank(rank: int, world: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Build a FSDP2 model (sharded_ranks' fully_shard on every Linear), load it from the URL, and return what the
    checks need: each local shard against its slice of the full tensor, and the bytes this rank fetched."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    out: dict[str, Any] = {}
    for case in ("fsdp2", "big"):
        model = sharded_ranks.build_model(case, meshes)
        report = ckptfix.load_into(model, payload[case])
        full = sharded_ranks.full_state_dict("mixed" if case == "fsdp2" else sharded_ranks.BIG)
        want = sharded_ranks.expected_locals(model, full)
        got = sharded_ranks.local_tensors(model)
        out[case] = {"wrong": [k for k, v in got.items() if not sharded_ranks.same_bits(sharded_ranks.bits(v),
                                                                                      sharded_ranks.bits(want[k]))],
                     "fetched": report.bytes_fetched, "sharded": report.sharded}
    return out


def test_fsdp2_ranks_fetch_only_their_shards(http_server: FileServer, tmp_path: Path) -> None:
    world = 2
    torch.save(sharded_ranks.full_state_dict("mixed"), http_server.root / "mixed.pth")
    big = sharded_ranks.full_state_dict(sharded_ranks.BIG)
    save_file(big, str(http_server.root / "big.safetensors"))
    payload = {"fsdp2": http_server.url("mixed.pth"), "big": http_server.url("big.safetensors")}
    ranks = dist_harness.run("tests.ops.test_remote_load:run_rank", world, tmp_path / "run", payload, timeout=300)
    tensor_bytes = sum(t.nbytes for t in big.values())
    for r in ranks:
        assert r["fsdp2"]["wrong"] == [] and r["fsdp2"]["sharded"] > 0 and r["big"]["wrong"] == []
        assert r["big"]["fetched"] < tensor_bytes / world + 256 * 1024, (r["big"]["fetched"], tensor_bytes)
    assert sum(r["big"]["fetched"] for r in ranks) >= tensor_bytes  # every byte fetched by some rank

