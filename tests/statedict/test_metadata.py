"""The state dict's ``_metadata``: what torch's loaders read is kept, every other entry dropped with a line naming
its module key and why, a ``_metadata`` no model loads refused in one line (``verify``: a finding).

Each file is ``torch.save`` of a real model's state dict (BatchNorm: versions exist) with its ``_metadata`` edited;
what plain torch does with each (``torch.load(weights_only=True)`` + strict ``load_state_dict``) is asserted beside
what ckptfix does, and every output is loaded by the plain loader. No payload runs: the ``os.system`` one would
create a canary file.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import adversarial
import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from ckptfix.model.spec import build_model
from ckptfix.statedict.metadata import clean_metadata

NET = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))
'''
CANARY = "canary-metadata"


#: name -> (edit of a copy of the clean _metadata (returns the new _metadata), what plain torch does with the file:
#: None loads, else the error it raises, the module keys ckptfix drops (None: refused as a whole))
CASES: dict[str, tuple[Callable[[OrderedDict, Path], Any], str | None, list[str] | None]] = {
    "normal": (lambda md, d: md, None, []),
    "extra-plain-data": (lambda md, d: (md["bn"].update(note="kept", sizes=[1, 2.5, None]),
                                        md.update(other={"x": {"y": "z"}}), md)[-1], None, []),
    "placeholder-os-system": (lambda md, d: (md["bn"].update(cmd=adversarial.Reduce(os.system, f"touch {d / CANARY}")),
                                             md)[-1], "Weights only load failed", ["bn"]),
    "namespace": (lambda md, d: (md["fc"].update(cfg=argparse.Namespace(lr=0.1)), md)[-1], "Weights only load failed",
                  ["fc"]),
    "version-str": (lambda md, d: (md.__setitem__("bn", {"version": "1"}), md)[-1], "'<' not supported", ["bn"]),
    "entry-not-a-dict": (lambda md, d: (md.__setitem__("bn", [1]), md)[-1], "has no attribute 'get'", ["bn"]),
    "assign-flag": (lambda md, d: (md[""].update(assign_to_params_buffers=True), md)[-1], None, [""]),
    "not-a-dict": (lambda md, d: [1, 2], "has no attribute 'get'", None),
}
REFUSED = [name for name, (_, _, dropped) in CASES.items() if dropped is None]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model spec, the clean state dict, and each case's file (a trained BatchNorm: running stats and
    num_batches_tracked that differ from a fresh model's)."""
    d = tmp_path_factory.mktemp("metadata")
    (d / "net.py").write_text(NET)
    spec = f"{d / 'net.py'}:Net"
    torch.manual_seed(0)
    model = build_model(spec)
    model.train()
    for _ in range(3):
        model(torch.randn(8, 3))
    clean = model.state_dict()
    out = {"dir": d, "spec": spec, "clean": clean}
    for name, (edit, _, _) in CASES.items():
        sd = OrderedDict(clean)
        sd._metadata = edit(copy.deepcopy(clean._metadata), d)  # type: ignore[attr-defined]
        torch.save(sd, d / f"{name}.pth")
        out[name] = d / f"{name}.pth"
    return out


@pytest.fixture(autouse=True)
def no_payload_ran(files: dict[str, Any]) -> Any:
    yield
    assert not (files["dir"] / CANARY).exists()


def _expected(files: dict[str, Any], name: str) -> OrderedDict:
    """The _metadata ckptfix keeps: the clean one plus the case's plain extras, less what the case dropped."""
    md = copy.deepcopy(files["clean"]._metadata)
    if name == "extra-plain-data":
        md["bn"].update(note="kept", sizes=[1, 2.5, None])
        md["other"] = {"x": {"y": "z"}}
    elif name == "version-str":
        md["bn"] = {}
    elif name == "entry-not-a-dict":
        del md["bn"]
    return md


def _fresh(files: dict[str, Any]) -> torch.nn.Module:
    return build_model(files["spec"])


def _loaded_like_clean(files: dict[str, Any], sd: Any) -> None:
    """``sd`` loads strictly into a fresh model, with the tensors the clean file's plain load gives."""
    got, want = _fresh(files), _fresh(files)
    got.load_state_dict(sd, strict=True)
    want.load_state_dict(torch.load(files["normal"], weights_only=True), strict=True)
    for key, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], value), key


@pytest.mark.parametrize("name", CASES)
def test_plain_torch_does_what_the_case_says(files: dict[str, Any], name: str) -> None:
    """The premise of each case, observed: torch.load(weights_only=True) + strict load_state_dict."""
    fails = CASES[name][1]
    try:
        _fresh(files).load_state_dict(torch.load(files[name], weights_only=True), strict=True)
    except Exception as e:  # noqa: BLE001 (torch raises UnpicklingError, TypeError or AttributeError)
        assert fails is not None and fails in str(e), e
    else:
        assert fails is None


def _dropped_lines(notes: list[str]) -> list[str]:
    return [n for n in notes if n.startswith("_metadata") and n.endswith("; dropped")]


@pytest.mark.parametrize("name", CASES)
def test_load(files: dict[str, Any], name: str) -> None:
    dropped = CASES[name][2]
    if dropped is None:
        with pytest.raises(FormatError) as e:
            ckptfix.load(files[name])
        assert str(e.value).startswith(f"{files[name]}: the state dict's _metadata is a list, not a dict")
        assert "\n" not in str(e.value)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = ckptfix.load(files[name])
    assert sd._metadata == _expected(files, name)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "_metadata" in str(w.message)]
    assert len(said) == (1 if dropped else 0), said
    for module in dropped:
        assert f"_metadata[{module!r}]" in said[0]
    _loaded_like_clean(files, sd)


@pytest.mark.parametrize("name", CASES)
def test_load_into(files: dict[str, Any], name: str) -> None:
    model, before = _fresh(files), None
    dropped = CASES[name][2]
    if dropped is None:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(FormatError, match="_metadata is a list"):
            ckptfix.load_into(model, files[name])
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # untouched
        return
    report = ckptfix.load_into(model, files[name])
    lines = _dropped_lines(report.notes)
    assert len(lines) == len(dropped) and all(f"_metadata[{m!r}]" in line for m, line in zip(dropped, lines))
    _loaded_like_clean(files, model.state_dict())


@pytest.mark.parametrize("ext", [".pth", ".safetensors"])
@pytest.mark.parametrize("name", CASES)
def test_convert_writes_what_the_plain_loader_takes(files: dict[str, Any], name: str, ext: str,
                                                    tmp_path: Path) -> None:
    dropped, dst = CASES[name][2], tmp_path / f"out{ext}"
    if dropped is None:
        with pytest.raises(FormatError, match="_metadata is a list"):
            ckptfix.convert(files[name], dst)
        assert not dst.exists()
        return
    report = ckptfix.convert(files[name], dst)
    lines = _dropped_lines(report.notes)
    assert len(lines) == len(dropped) and all(f"_metadata[{m!r}]" in line for m, line in zip(dropped, lines))
    plain = torch.load(dst, weights_only=True) if ext == ".pth" else load_file(dst)
    if ext == ".pth":  # the BatchNorm versions as the clean file has them, plain extras kept, the rest dropped
        assert plain._metadata == _expected(files, name)
    _loaded_like_clean(files, plain)


@pytest.mark.parametrize("name", CASES)
def test_verify_reports_a_finding(cli_runner: Any, files: dict[str, Any], name: str) -> None:
    dropped = CASES[name][2]
    res = cli_runner.invoke(cli, ["verify", str(files[name]), "--model", files["spec"], "--json"])
    assert "a bug in ckptfix" not in res.output
    report = json.loads(res.stdout)
    metadata = [f for f in report["failures"] if f.startswith("state dict _metadata")]
    if dropped == []:
        assert res.exit_code == 0 and report["ok"] and metadata == [], res.output
        return
    assert res.exit_code == 3 and not report["ok"], res.output
    if dropped is None:
        assert metadata == ["state dict _metadata is a list, not a dict of module paths: load_state_dict fails on it "
                            "with any model (its first step is _metadata.get(''))"]
    else:
        assert len(metadata) == len(dropped) and all(f"_metadata[{m!r}]" in f for m, f in zip(dropped, metadata))
    assert not [n for n in report["notes"] if n.startswith("_metadata")]  # a failure, not a note too


@pytest.mark.parametrize("name", CASES)
def test_inspect_describes_it(cli_runner: Any, files: dict[str, Any], name: str) -> None:
    dropped = CASES[name][2]
    res = cli_runner.invoke(cli, ["inspect", str(files[name]), "--json"])
    assert res.exit_code == 0, res.output
    lines = _dropped_lines(json.loads(res.stdout)["notes"])
    assert len(lines) == (1 if dropped is None else len(dropped))


def test_cli_refusal_is_one_line(cli_runner: Any, files: dict[str, Any], tmp_path: Path) -> None:
    for name in REFUSED:
        res = cli_runner.invoke(cli, ["convert", str(files[name]), str(tmp_path / "o.pth")])
        assert res.exit_code == 1 and res.stderr.startswith(f"Error: {files[name]}: ") and res.stderr.count("\n") == 1


def _spectral() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(3, 3)), torch.nn.BatchNorm2d(3),
                               torch.nn.InstanceNorm1d(3, track_running_stats=True))


@pytest.mark.parametrize("make", [_spectral, lambda: torch.nn.LSTM(3, 4), lambda: torch.nn.TransformerEncoderLayer(8, 2)])
def test_what_torch_writes_is_kept_as_is(make: Callable[[], torch.nn.Module]) -> None:
    md = make().state_dict()._metadata
    kept, lines, whole = clean_metadata(md)
    assert kept is md and lines == [] and not whole


def _nested(depth: int) -> list:
    out: list = [0]
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("md, why", [
    ({"bn": {"version": [2]}}, "a list, not a number"),
    ({"": {"spectral_norm": {"weight.version": "1"}}}, "not a dict of versions"),
    ({"a": {"x": {1: 2}}}, "not plain data"),
    ({"a": {"x": {1, 2}}}, "a set, not plain data"),
    ({"a": {"x": b"raw"}}, "a bytes, not plain data"),
    ({"a": {"x": torch.zeros(1)}}, "a torch.Tensor, not plain data"),
    ({"a": {"x": _nested(40)}}, "a list, not plain data"),
    ({"a": {5: 1}}, "an int (5) key, not a name"),
    ({5: {}}, "an int (5) key, not a module path"),
    ({"a\x1b[2J": 1}, r"_metadata['a\x1b[2J']: an int (1), not a dict"),
])
def test_each_drop_names_the_module_key_and_why(md: dict, why: str) -> None:
    kept, lines, whole = clean_metadata(md)
    assert len(lines) == 1 and why in lines[0] and not whole, lines
    assert "\x1b" not in lines[0]


@pytest.mark.parametrize("shard_md, refused", [([1, 2], True), ({"bn": [1]}, False)])
def test_sharded_shards_metadata_is_judged_as_one(files: dict[str, Any], tmp_path: Path, shard_md: Any,
                                                  refused: bool) -> None:
    """A sharded checkpoint's _metadata is the union of its shards': one shard's that no model loads is refused
    in one line naming the checkpoint; a bad entry is dropped as in a single file."""
    clean = files["clean"]
    keys = list(clean)
    weight_map = {}
    for i, part in enumerate((keys[:2], keys[2:])):
        name = f"pytorch_model-0000{i + 1}-of-00002.bin"
        sd = OrderedDict((k, clean[k]) for k in part)
        sd._metadata = shard_md if i else copy.deepcopy(clean._metadata)  # type: ignore[attr-defined]
        torch.save(sd, tmp_path / name)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if refused:
        with pytest.raises(FormatError, match=r"the state dict's _metadata is a list, not a dict") as e:
            ckptfix.load(tmp_path)
        assert "\n" not in str(e.value)
        return
    with pytest.warns(UserWarning, match=r"_metadata\['bn'\]: a list, not a dict"):
        sd = ckptfix.load(tmp_path)
    assert "bn" not in sd._metadata and sd._metadata["fc"] == {"version": 1}
    _loaded_like_clean(files, sd)
