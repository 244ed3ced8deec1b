"""map_location: GPU-saved files on a CPU machine, every accepted form, missing devices, auto policy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import ckptfix
from ckptfix.core.devices import DevicePlan, auto_device, parse_cli_map_location
from ckptfix.errors import DeviceError

GPU_FIXTURES = ["mlp_cuda0.pth", "mlp_cuda1.pth", "mlp_model_parallel.pth"]


@contextlib.contextmanager
def fake_location(tag: str | Callable[[Any], str]) -> Iterator[None]:
    """Make ``torch.save`` record ``tag`` (or ``tag(storage)``) as every storage's device.

    A GPU-saved file differs from a CPU one only in these tags, so this makes real
    cuda-tagged files on a machine without a GPU.
    """
    fn = tag if callable(tag) else (lambda _storage: tag)
    with mock.patch.object(torch.serialization, "location_tag", fn):
        yield


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_gpu_saved_loads_on_cpu_by_default(name: str, fixtures_dir: Path, manifest: dict) -> None:
    path = fixtures_dir / name
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
        torch.load(path, weights_only=True)  # the bug ckptfix fixes
    ckpt = ckptfix.read(path)
    assert ckpt.devices == manifest[name]["devices"]
    assert all(t.device.type == "cpu" for t in ckpt.state_dict.values())
    assert ckptfix.inspect(path).devices == manifest[name]["devices"]


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu"), {"cuda:0": "cpu", "cuda:1": "cpu"}, "auto",
                                  lambda storage, loc: storage])
def test_every_map_location_form(spec: object, fixtures_dir: Path) -> None:
    sd = ckptfix.load(fixtures_dir / "mlp_model_parallel.pth", map_location=spec)
    ref = ckptfix.load(fixtures_dir / "mlp_model_parallel.pth")
    assert all(torch.equal(sd[k], ref[k]) and sd[k].device.type == "cpu" for k in ref)


def test_meta_reads_structure_only(fixtures_dir: Path) -> None:
    sd = ckptfix.load(fixtures_dir / "mlp_cuda1.pth", map_location="meta")
    assert all(t.device.type == "meta" for t in sd.values())
    assert sd["0.weight"].shape == (16, 13)


@pytest.mark.parametrize("spec, device", [("cuda:0", "cuda:0"), ("cuda", "cuda"), ({"cuda:1": "cuda:3"}, "cuda:3")])
def test_missing_device_is_a_clear_error(spec: object, device: str, fixtures_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match=f"device {device}.* not available on this machine \\(available: cpu\\)"):
        ckptfix.load(fixtures_dir / "mlp_cuda1.pth", map_location=spec)


def test_unmapped_saved_device_is_named(fixtures_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match="device cuda:1 is not available.*--map-location cuda:1=cpu"):
        ckptfix.load(fixtures_dir / "mlp_model_parallel.pth", map_location={"cuda:0": "cpu"})


def test_bad_spec() -> None:
    with pytest.raises(DeviceError, match="not a device"):
        DevicePlan("gpu0")
    with pytest.raises(DeviceError):
        parse_cli_map_location(["cpu", "cuda:1=cpu"])
    assert parse_cli_map_location(["cuda:1=cuda:0", "cuda:2=cpu"]) == {"cuda:1": "cuda:0", "cuda:2": "cpu"}
    assert parse_cli_map_location(["auto"]) == "auto"


def test_auto_policy_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank lands on its own GPU, never every rank on cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert auto_device("cuda:0") == "cuda:2"
    assert auto_device("cpu") == "cpu"
    monkeypatch.delenv("LOCAL_RANK")
    assert auto_device("cuda:1") == "cuda:1"
    assert auto_device("cuda:7") == "cpu"


def test_auto_without_cuda_goes_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert auto_device("cuda:1") == "cpu"


def test_mixed_tags_counted_per_tensor(tmp_path: Path) -> None:
    sd = {"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(4)}
    tags = {sd["a"].untyped_storage().data_ptr(): "cuda:0", sd["b"].untyped_storage().data_ptr(): "cuda:1"}
    with fake_location(lambda s: tags.get(s.data_ptr(), "cpu")):
        torch.save(sd, tmp_path / "mixed.pth")
    assert ckptfix.read(tmp_path / "mixed.pth").devices == {"cuda:0": 1, "cuda:1": 1, "cpu": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["cpu", "auto", "cuda:0"])
def test_real_cuda_tensors(spec: str, tmp_path: Path) -> None:
    sd = {"w": torch.randn(3, 3, device="cuda:0")}
    torch.save(sd, tmp_path / "gpu.pth")
    ckpt = ckptfix.read(tmp_path / "gpu.pth", map_location=spec)
    assert ckpt.devices == {"cuda:0": 1}
    expected = "cpu" if spec == "cpu" else "cuda"
    assert ckpt.state_dict["w"].device.type == expected
    assert torch.equal(ckpt.state_dict["w"].cpu(), sd["w"].cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_a_safetensors_file_loads_onto_the_gpu_as_safetensors_loads_it(spec: str, tmp_path: Path) -> None:
    """Read through pinned staging windows (no copy from the mapping): equal to ``load_file(device=…)`` bit for bit,
    every dtype, an empty tensor and a scalar too."""
    import safetensors.torch as st

    w = torch.randn(300, 70)
    sd = {"w": w, "bf": torch.randn(5000).bfloat16(), "i": torch.arange(7), "empty": torch.empty(0, 3),
          "scalar": torch.tensor(2.5, dtype=torch.float64), "f8": torch.randn(64).to(torch.float8_e4m3fn)}
    st.save_file(sd, tmp_path / "m.safetensors")
    got = ckptfix.load(tmp_path / "m.safetensors", map_location=spec)
    want = st.load_file(tmp_path / "m.safetensors", device=spec)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].device.type == "cuda" and got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].cpu().view(-1).view(torch.uint8), v.cpu().view(-1).view(torch.uint8)), k



@pytest.mark.parametrize(("spec", "gpu"), [("cpu", False), ("meta", False), (lambda s, _loc: s, False),
                                           ("auto", None), ({"cuda:0": "cpu"}, None), (None, None),
                                           pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_a_read_takes_the_staging_windows_only_where_a_storage_may_go_to_a_gpu(spec: Any, gpu: bool | None) -> None:
    """``reaches_gpu``: never for the CPU, meta or a callable (the caller's own); for ``auto``, a mapping or None
    (a saved tag may stay on a GPU) where CUDA is available."""
    want = torch.cuda.is_available() if gpu is None else gpu
    assert DevicePlan(spec).reaches_gpu() is want

@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["cuda", {"cpu": "cuda:0"}])
def test_a_torch_zip_loads_onto_the_gpu_through_the_windows(spec: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``load(map_location=cuda)`` of a torch zip reads its storages through pinned staging windows (not torch's
    copy from the mapping): equal to ``torch.load(map_location=…)`` bit for bit, ties kept, empty storages too."""
    from ckptfix.core import filefill

    staged: list[int] = []
    fill = filefill.fill_staged
    monkeypatch.setattr(filefill, "fill_staged", lambda fills, *a, **k: (staged.append(len(fills)), fill(fills, *a, **k))[1])
    w = torch.randn(300, 70)
    sd = {"w": w, "tied": w, "view": w[2:5], "bf": torch.randn(5000).bfloat16(), "i": torch.arange(7),
          "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    torch.save(sd, tmp_path / "m.pth")
    got = ckptfix.load(tmp_path / "m.pth", map_location=spec)
    want = torch.load(tmp_path / "m.pth", map_location=spec, weights_only=True)
    assert staged and staged[0] >= 4  # (w, bf, i, scalar: the storages with bytes)
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].device == v.device and got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].stride() == v.stride() and got[k].storage_offset() == v.storage_offset(), k
        assert torch.equal(got[k].cpu(), v.cpu()), k
    assert got["tied"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr() \
        == got["view"].untyped_storage().data_ptr()
