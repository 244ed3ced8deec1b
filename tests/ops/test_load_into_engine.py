"""load_into against the plain loaders, differentially: every format × dtype × way the model is built gives
tensors bit-identical to ``model.load_state_dict(torch.load(path, weights_only=True))`` (or safetensors'
``load_file``); meta-built models are assigned (zero-copy where the file allows), tied parameters stay tied,
nothing is left on meta; every failure leaves the model as it was."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from torch import nn

import ckptfix
from ckptfix.core import rollback, tensorcopy
from ckptfix.errors import CkptfixError, LoadError
from tests.page_cache import mapped_from


class Net(nn.Module):
    """Parameters, buffers (float and integer), BatchNorm's version hook, an embedding tied to the head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 11, bias=False) if not tied else nn.Linear(8, 11, bias=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        if tied:
            self.head.weight = self.emb.weight  # one Parameter, two names (GPT-2's lm_head)


def _random_state(model: nn.Module, dtype: torch.dtype, seed: int = 0) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    out: Any = OrderedDict()
    for k, v in sd.items():
        if v.is_floating_point():
            out[k] = (torch.randn(v.shape, generator=g) * 3).to(dtype)
        else:
            out[k] = torch.randint(0, 100, v.shape, generator=g).to(v.dtype)
    out._metadata = sd._metadata
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: nn.Module, b: nn.Module, nan_bits: bool = True) -> None:
    """Bit for bit; ``nan_bits=False``: a NaN where the other has one, whatever its payload (a cast on a
    CUDA device and one on the CPU make different NaN bits from the same input)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        x, y = _bits(sa[k]), _bits(sb[k])
        if not nan_bits and sa[k].is_floating_point():
            nan = sa[k].detach().cpu().isnan()
            assert torch.equal(nan, sb[k].detach().cpu().isnan()), k
            x, y = x[~nan], y[~nan]
        assert torch.equal(x, y), k


def _save(sd: Any, path: Path, fmt: str) -> Path:
    if fmt == "pth":
        torch.save(sd, path.with_suffix(".pth"))
        return path.with_suffix(".pth")
    if fmt == "safetensors":
        st.save_file({k: v.contiguous() for k, v in sd.items()}, path.with_suffix(".safetensors"))
        return path.with_suffix(".safetensors")
    src = _save(sd, path, "pth")
    out = path.parent / f"{path.name}_{fmt}"
    if fmt == "sharded":
        ckptfix.convert(src, out, max_shard_size=200)
    else:
        ckptfix.convert(src, out, format="dcp")
    return out


def _plain_load(model: nn.Module, path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        model.load_state_dict(st.load_file(path))
    elif fmt == "pth":
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        model.load_state_dict(ckptfix.load(path))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _build(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """Net in ``dtype`` on ``device``; torch can't ``.to()`` a module to float8, so its parameters are given it."""
    with torch.device(device):
        model = Net()
    if dtype != torch.float8_e4m3fn:
        return model.to(dtype)
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
    return model


@pytest.mark.parametrize("built", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["pth", "safetensors", "sharded", "dcp"])
def test_bit_identical_to_the_plain_loader(tmp_path: Path, fmt: str, dtype: torch.dtype, built: str) -> None:
    sd = _random_state(Net(), dtype)
    path = _save(sd, tmp_path / "m", fmt)
    want = _build(dtype)
    _plain_load(want, path, fmt)
    got = _build(dtype, built)
    report = ckptfix.load_into(got, path)
    _same(got, want)
    assert not [n for n, t in [*got.named_parameters(), *got.named_buffers()] if t.is_meta]
    assert (report.assigned, report.copied) == ((len(sd), 0) if built == "meta" else (0, len(sd)))


def test_views_and_shared_storages_as_torch_loads_them(tmp_path: Path) -> None:
    """A non-contiguous tensor and two keys over one storage (torch zip only): the same values as torch's load."""
    sd = _random_state(Net(), torch.float32)
    sd["head.weight"] = torch.randn(6, 11).t()  # non-contiguous, strides (1, 11)
    both = torch.randn(12)
    sd["fc.bias"], sd["bn.bias"] = both[:6], both[6:]  # one storage, two views (the second at an offset)
    torch.save(sd, tmp_path / "views.pth")
    want, got = Net(), Net()
    want.load_state_dict(torch.load(tmp_path / "views.pth", weights_only=True))
    ckptfix.load_into(got, tmp_path / "views.pth")
    _same(got, want)
    with torch.device("meta"):
        meta = Net()
    ckptfix.load_into(meta, tmp_path / "views.pth")
    _same(meta, want)


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_meta_model_is_assigned_views_of_the_file(tmp_path: Path, fmt: str) -> None:
    sd = _random_state(Net(), torch.float32)
    path = _save(sd, tmp_path / "m", fmt)
    with torch.device("meta"):
        model = Net()
    model.fc.weight.requires_grad_(False)
    report = ckptfix.load_into(model, path)
    assert report.assigned == len(sd) and report.copied == 0
    assert mapped_from(model.fc.weight) == str(path)  # zero-copy: the parameter's bytes are the file's pages
    assert isinstance(model.fc.weight, nn.Parameter) and not model.fc.weight.requires_grad and model.fc.bias.requires_grad
    assert isinstance(model.bn.running_mean, torch.Tensor) and not isinstance(model.bn.running_mean, nn.Parameter)
    model.fc.weight.data.add_(1)  # copy-on-write: the file is unchanged
    again = Net()
    ckptfix.load_into(again, path)
    assert torch.equal(again.fc.weight, sd["fc.weight"])


def test_meta_model_cast_to_its_dtype_is_materialised(tmp_path: Path) -> None:
    torch.save(_random_state(Net(), torch.float32), tmp_path / "m.pth")
    with torch.device("meta"):
        model = Net().to(torch.bfloat16)
    ckptfix.load_into(model, tmp_path / "m.pth")
    want = Net().to(torch.bfloat16)
    want.load_state_dict(torch.load(tmp_path / "m.pth", weights_only=True))
    _same(model, want)
    assert mapped_from(model.fc.weight) != str(tmp_path / "m.pth")


@pytest.mark.parametrize("built", ["cpu", "meta"])
def test_tied_parameters_stay_one_tensor(tmp_path: Path, built: str) -> None:
    src = Net(tied=True)
    st.save_model(src, tmp_path / "tied.safetensors")  # safetensors keeps one of the two names
    with torch.device(built):
        model = Net(tied=True)
    report = ckptfix.load_into(model, tmp_path / "tied.safetensors")
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight, src.emb.weight) and not model.emb.weight.is_meta
    assert report.missing == [] and len(report.tolerated) <= 1


#: how a file holds the two names a model ties → whether their values agree (a NaN's bits included)
TWINS = {"one-storage": True, "equal-copies": True, "equal-copies-with-a-nan": True, "different": False,
         "different-nan-payload": False}


def _twins(how: str) -> dict[str, torch.Tensor]:
    sd = _random_state(Net(tied=True), torch.float32)
    emb = sd["emb.weight"]
    if how == "one-storage":
        return {**sd, "head.weight": emb}
    if "nan" in how:
        emb[0, 0] = float("nan")
    head = emb.clone()
    if how == "different":
        head[3, 2] += 1
    if how == "different-nan-payload":
        head.view(torch.int32)[0, 0] ^= 1  # (still a NaN: equal to torch's eye, not bit for bit)
    return {**sd, "head.weight": head}


@pytest.mark.parametrize("leased", [True, False], ids=["leased", "no-lease"])
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
@pytest.mark.parametrize("built", ["cpu", "meta"])
@pytest.mark.parametrize("how", list(TWINS))
def test_tied_names_the_file_holds_apart_load_only_with_equal_values(tmp_path: Path, how: str, built: str, fmt: str,
                                                                     leased: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model ties emb.weight and head.weight; the file holds both names: as one storage, as two equal copies
    (loaded, still tied), or with different values — refused, naming both and the file, the model untouched (torch's
    load_state_dict keeps the last silently; safetensors' load_model refuses). Compared by recorded digests, in the
    leased file's mapping, or (no lease) read from the file."""
    if not leased:
        monkeypatch.setattr(rollback, "SETLEASE", None)
    sd = _twins(how)
    path = tmp_path / f"twins.{fmt}"
    if fmt == "pth":
        torch.save(sd, path)
    elif how == "one-storage":  # (safetensors' save_file refuses shared tensors: ckptfix's convert stores each name,
        torch.save(sd, tmp_path / "tied.pth")  # its digests recorded, which the comparison then reads)
        ckptfix.convert(tmp_path / "tied.pth", path)
        assert set(st.load_file(path)) >= {"emb.weight", "head.weight"}
    else:
        st.save_file(sd, str(path))
    with torch.device(built):
        model = Net(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if TWINS[how]:
        ckptfix.load_into(model, path, strict=False)
        assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
        assert torch.equal(model.emb.weight.view(torch.int32), sd["emb.weight"].view(torch.int32))
        return
    with pytest.raises(LoadError, match=rf"^{path}: the model ties emb.weight and head.weight \(one tensor each\), "
                                        "but the checkpoint holds different values for them.*nothing was loaded"):
        ckptfix.load_into(model, path, strict=False)
    after = model.state_dict()
    assert model.head.weight is model.emb.weight
    assert all(torch.equal(after[k], v) if not v.is_meta else after[k].is_meta for k, v in before.items())


def test_meta_tensors_nothing_fills_are_named_and_the_model_is_untouched(tmp_path: Path) -> None:
    class WithRope(Net):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)  # not in any checkpoint

    torch.save(_random_state(Net(), torch.float32), tmp_path / "m.pth")
    with torch.device("meta"):
        model = WithRope()
    with pytest.raises(LoadError, match=r"1 tensor\(s\) of the model are on the meta device .*: inv_freq; nothing was loaded"):
        ckptfix.load_into(model, tmp_path / "m.pth")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_assign_true_replaces_a_built_models_tensors(tmp_path: Path) -> None:
    sd = _random_state(Net(), torch.float32)
    torch.save(sd, tmp_path / "m.pth")
    model = Net()
    old = model.fc.weight
    report = ckptfix.load_into(model, tmp_path / "m.pth", assign=True)
    assert model.fc.weight is not old and torch.equal(model.fc.weight, sd["fc.weight"]) and report.assigned == len(sd)


def test_compiled_model_from_ddp_keys_and_outputs_match(tmp_path: Path) -> None:
    sd = _random_state(Net(), torch.float32)
    torch.save(OrderedDict((f"module.{k}", v) for k, v in sd.items()), tmp_path / "ddp.pth")
    want = Net().eval()
    want.load_state_dict(sd)
    with torch.device("meta"):
        inner = Net()
    model = torch.compile(inner, backend="eager")
    report = ckptfix.load_into(model, tmp_path / "ddp.pth")
    assert report.fix == "replace module. with _orig_mod."
    inner.eval()
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(inner.fc(inner.emb(x)), want.fc(want.emb(x)))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert all(torch.equal(_bits(now[k]), _bits(v)) for k, v in before.items())


@pytest.mark.parametrize("built", ["cpu", "meta"])
@pytest.mark.parametrize("failure", ["shape", "missing", "nan_strict", "truncated"])
def test_all_or_nothing(tmp_path: Path, failure: str, built: str) -> None:
    sd = _random_state(Net(), torch.float32)
    if failure == "shape":
        sd["head.weight"] = torch.randn(11, 7)
    elif failure == "missing":
        del sd["fc.bias"]
    elif failure == "nan_strict":
        sd["fc.weight"][2, 3] = float("nan")
    path = tmp_path / "m.pth"
    torch.save(sd, path)
    if failure == "truncated":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:  # the zip end records moved up: keep the directory, lose tensor bytes
            data = f.read()
            f.seek(0)
            f.truncate()
            f.write(data[: size // 2] + data[size - 2000 :])
    with torch.device(built):
        model = Net()
    before = _snapshot(model) if built == "cpu" else None
    with pytest.raises(CkptfixError):  # LoadError, or the reader's FormatError for the damaged file
        ckptfix.load_into(model, path, strict_values=True)
    if before is not None:
        _untouched(model, before)
    else:
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_nonfinite_check_is_fused_and_names_keys(tmp_path: Path) -> None:
    big = nn.Linear(2048, 2048)  # 16 MiB: more than one chunk
    sd = big.state_dict()
    sd["weight"][-1, -1] = float("inf")
    torch.save(sd, tmp_path / "inf.pth")
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) hold NaN/Inf values: weight"):
        report = ckptfix.load_into(nn.Linear(2048, 2048), tmp_path / "inf.pth")
    assert report.nonfinite == ["weight"]
    report = ckptfix.load_into(nn.Linear(2048, 2048), tmp_path / "inf.pth", check_values=False)
    assert report.nonfinite == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2,
                                   torch.complex64], ids=str)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "big"])
def test_finite_check_exact_per_dtype(dtype: torch.dtype, value: str) -> None:
    """The sum shortcut never hides a NaN/Inf, and finite values whose sum overflows are still finite."""
    n = tensorcopy.CHUNK_BYTES // (2 * torch.empty((), dtype=dtype).element_size()) + 5  # two chunks
    x = torch.zeros(n, dtype=torch.float32)
    if value == "big":
        x.fill_(torch.finfo(torch.float16 if dtype in (torch.float16, torch.float8_e5m2) else torch.float32).max / 2)
    else:
        x[n - 3] = float(value)
    t = x.to(dtype)
    want = value == "big" or bool(torch.isfinite(t.to(torch.complex64 if t.is_complex() else torch.float64)).all())
    assert tensorcopy.all_finite(t) is want
    out = torch.empty_like(t)
    assert tensorcopy.copy_checked(out, t) is want and torch.equal(_bits(out), _bits(t))


@pytest.mark.parametrize("built", ["cpu", "meta"])
def test_strict_values_checks_record_crcs_first(tmp_path: Path, built: str) -> None:
    """A record whose bytes don't match its CRC-32: loaded as torch.load(mmap=True) would by default, refused
    (nothing loaded) with strict_values=True."""
    from ckptfix.parse.zipdir import zip_directory

    sd = _random_state(Net(), torch.float32)
    torch.save(sd, tmp_path / "m.pth")
    entry = next(e for e in zip_directory(str(tmp_path / "m.pth")).entries if e.name.endswith("/data/0"))
    data = bytearray((tmp_path / "m.pth").read_bytes())
    start = data.index(b"data/0", entry.header_offset) + len("data/0")
    start += int.from_bytes(data[entry.header_offset + 28 : entry.header_offset + 30], "little")  # extra field
    data[start] ^= 0x01  # one bit of the first tensor's bytes
    (tmp_path / "bad.pth").write_bytes(bytes(data))
    with torch.device(built):
        model = Net()
    before = _snapshot(model) if built == "cpu" else None
    with pytest.raises(CkptfixError, match=r"bad\.pth: record .*data/0 does not match the CRC-32 .* nothing was loaded"):
        ckptfix.load_into(model, tmp_path / "bad.pth", strict_values=True)
    if before is not None:
        _untouched(model, before)
    else:
        assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ckptfix.load_into(model, tmp_path / "bad.pth")  # the default, like torch.load(mmap=True): no CRC pass


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_into_cuda_built_and_meta_models(tmp_path: Path, fmt: str, dtype: torch.dtype) -> None:
    sd = _random_state(Net(), torch.float32)
    sd["fc.weight"][1, 2] = float("nan")
    path = _save(sd, tmp_path / "m", fmt)
    want = _build(dtype)
    _plain_load(want, path, fmt)
    built = _build(dtype).cuda()
    with pytest.warns(UserWarning, match="fc.weight"):
        ckptfix.load_into(built, path)
    with torch.device("meta"):
        meta = Net().to(dtype)
    with pytest.warns(UserWarning, match="fc.weight"):
        report = ckptfix.load_into(meta, path, map_location="cuda")
    for model in (built, meta):
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
        _same(model, want, nan_bits=dtype == torch.float32)
    assert report.assigned == len(sd) and report.nonfinite == ["fc.weight"]


@pytest.mark.gpu
def test_large_tensor_to_cuda_through_the_staging_buffers(tmp_path: Path) -> None:
    big = nn.Linear(4096, 4096 + 7)  # 64 MiB: more than one pinned staging buffer, not a multiple of one
    torch.save(big.state_dict(), tmp_path / "big.pth")
    model = nn.Linear(4096, 4096 + 7, device="cuda", dtype=torch.bfloat16)
    ckptfix.load_into(model, tmp_path / "big.pth")
    assert torch.equal(model.weight.cpu(), big.weight.detach().to(torch.bfloat16))


@pytest.mark.gpu
def test_fsdp2_on_cuda_one_rank(tmp_path: Path) -> None:
    """A real fully_shard model on a one-rank NCCL mesh: its DTensor shards filled on the device."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    sd = _random_state(Net(), torch.float32)
    torch.save(OrderedDict((f"module.{k}", v) for k, v in sd.items()), tmp_path / "ddp.pth")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = Net().cuda()
        fully_shard(model.fc)
        fully_shard(model)
        report = ckptfix.load_into(model, tmp_path / "ddp.pth")
        assert report.sharded > 0 and report.fix == "strip module."
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in model.state_dict().items()}
        assert all(torch.equal(full[k], sd[k]) for k in sd)
    finally:
        dist.destroy_process_group()


def test_success_is_reported_only_when_nothing_is_left_on_meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The postcondition is checked, not assumed: a commit that assigned nothing is an error, not a report."""
    from ckptfix.ops.load_into import commit

    torch.save(_random_state(Net(), torch.float32), tmp_path / "m.pth")
    monkeypatch.setattr(commit, "commit", lambda *args: [])
    with torch.device("meta"):
        model = Net()
    with pytest.raises(LoadError, match=r"still on the meta device: emb\.weight"):
        ckptfix.load_into(model, tmp_path / "m.pth")
