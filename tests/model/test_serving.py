"""verify --exact as the serving code loads a file: tied weights (stored once, dropped, re-tied by the model),
the devices a plain load puts tensors on (--serving-device), failure lines that name their keys, progress."""

from __future__ import annotations

import io
import re
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_model

import ckptfix
from ckptfix.cli import cli
from ckptfix.core.progress import Progress
from ckptfix.model.spec import build_model

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"

LMS = '''
import torch
from torch import nn

class TiedLM(nn.Module):
    """A language model in miniature: the output head shares the embedding's weight (one Parameter)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))

class RetyingLM(TiedLM):
    """Ties the head again after loading, as a Hugging Face model's tie_weights() (from_pretrained calls it)."""

    def tie_weights(self):
        self.head.weight = self.embed.weight

def plain():
    torch.manual_seed(0)
    return TiedLM()

def retying():
    torch.manual_seed(0)
    return RetyingLM()
'''


def _json(cli_runner: Any, args: list[str], code: int | None = None) -> dict[str, Any]:
    res = cli_runner.invoke(cli, ["verify", *args, "--json"])
    assert code is None or res.exit_code == code, res.output
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def _serves(path: Path, model: torch.nn.Module) -> bool:
    """What the serving code does, no ckptfix: load_file (torch.load for a .pth), then a strict load_state_dict
    (``--serving-loader torch``: a model's tie_weights() is from_pretrained's, which this load does not call)."""
    sd = load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def lms(tmp_path: Path) -> Path:
    (tmp_path / "lms.py").write_text(LMS)
    return tmp_path / "lms.py"


def _write(writer: str, spec: str, tmp_path: Path) -> Path:
    """The tied model's weights as each writer stores them."""
    model = build_model(spec)
    torch.save(model.state_dict(), tmp_path / "tied.pth")  # torch.save keeps the tie (one storage, two keys)
    out = tmp_path / ("tied.pth" if writer == "torch.save" else f"tied-{writer}.safetensors")
    if writer == "compact":  # the tie written once, as ckptfix's alias (which load_file does not return)
        ckptfix.convert(tmp_path / "tied.pth", out, compact_ties=True)
    elif writer == "ckptfix":  # the default: every tied name stored
        ckptfix.convert(tmp_path / "tied.pth", out)
    elif writer == "save_model":  # one name of the tie dropped, as save_pretrained does
        save_model(model, str(out))
    return out


@pytest.mark.parametrize("writer", ["compact", "save_model", "ckptfix", "torch.save"])
@pytest.mark.parametrize("fn", ["plain", "retying"])
def test_tied_weights_pass_exactly_when_the_serving_loader_takes_them(writer: str, fn: str, cli_runner: Any, lms: Path,
                                                                       tmp_path: Path) -> None:
    spec = f"{lms}:{fn}"
    path = _write(writer, spec, tmp_path)
    args = [str(path), "--model", spec, "--exact", "--reference", str(tmp_path / "tied.pth"), "--input-shape", "2,5"]
    report = _json(cli_runner, args)
    serves = _serves(path, build_model(spec))
    # the verdict is the serving loader's, and the report agrees with itself
    assert report["ok"] is serves is (not report["failures"])
    assert report["ok"] is (writer in ("ckptfix", "torch.save"))
    tied = {t["key"] for t in report["tolerated"] if t["kind"] == "tied"}
    assert report["matched"] + len(tied) + len(report["missing"]) == report["total"] == 2
    text = cli_runner.invoke(cli, ["verify", *args]).stdout
    assert text.startswith("VERIFIED" if serves else "FAILED")
    assert f"keys: as saved: {report['matched']}/2 keys match" in text
    if report["missing"]:
        (key,) = report["missing"]
        assert f"  missing (1):\n    {key}\n" in text and not tied
        assert report["failures"][0].startswith(f"exact: load_state_dict(strict=True) would fail as saved: 1 missing: {key}; "
                                                f"{key} is tied to ")
    if report["missing"]:  # the loader's own verdict, observed, names why too
        assert any(f.startswith("exact: the serving loader failed as saved: ") and "Missing key(s)" in f
                   for f in report["failures"])
    if fn == "retying" and writer == "save_model":  # only from_pretrained calls tie_weights(): the fix names both ways
        assert "RetyingLM.tie_weights() ties it again" in report["failures"][0]
        assert "--serving-loader transformers" in report["failures"][0] and "convert --untie" in report["failures"][0]
    if writer == "compact" and fn == "plain":  # stored as an alias: --untie writes the file that passes
        assert report["convert_command"] == f"ckptfix convert {path} {tmp_path / 'tied-compact.fixed.safetensors'} " \
                                            "--to single --untie"
        assert "(convert --untie stores it under its own key)" in report["failures"][0]
        assert cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:]).exit_code == 0
        fixed = tmp_path / "tied-compact.fixed.safetensors"
        assert _json(cli_runner, [str(fixed), *args[1:]], 0)["ok"] and _serves(fixed, build_model(spec))
        assert sorted(load_file(fixed)) == ["embed.weight", "head.weight"]
    elif writer == "save_model" and fn == "plain":  # dropped from the file: no convert restores it
        assert report["convert_command"] is None
        assert "serve it with safetensors.torch.load_model(model, PATH), which skips tied names" in report["failures"][0]
    # without --exact ckptfix's own reader fills the tie either way
    assert _json(cli_runner, args[:3] + args[4:], 0)["ok"]


def test_untie_is_for_safetensors_output(lms: Path, tmp_path: Path) -> None:
    _write("torch.save", f"{lms}:plain", tmp_path)
    with pytest.raises(ckptfix.errors.ConversionError, match="--untie is for safetensors output.*drop --untie"):
        ckptfix.convert(tmp_path / "tied.pth", tmp_path / "out.pth", untie=True)
    for torch_free in ("1", "0"):  # every read path: torch-free, streamed and loaded (trust)
        for i, kwargs in enumerate([{}, {"trust": True}, {"dtype": "fp16"}]):
            out = tmp_path / f"out{torch_free}{i}.safetensors"
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("CKPTFIX_TORCH_FREE", torch_free)
                report = ckptfix.convert(tmp_path / "tied.pth", out, untie=True, **kwargs)
            sd, want = load_file(out), torch.load(tmp_path / "tied.pth", weights_only=True)
            assert "--untie: 1 tied tensor(s) stored under their own keys: head.weight" in report.notes
            cast = torch.float16 if kwargs.get("dtype") else torch.float32
            assert all(torch.equal(sd[k], want[k].to(cast)) for k in want) and sorted(sd) == sorted(want)


def test_a_real_hugging_face_gpt2_release_passes_exact_with_the_transformers_loader(cli_runner: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    (tmp_path / "gpt.py").write_text(
        "import torch\nfrom transformers import GPT2Config, GPT2LMHeadModel\n\n"
        "def build():\n    torch.manual_seed(0)\n"
        "    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16,\n"
        "                                      bos_token_id=0, eos_token_id=0))\n")
    spec = f"{tmp_path / 'gpt.py'}:build"
    model = build_model(spec)
    model.save_pretrained(tmp_path / "release")
    torch.save(model.state_dict(), tmp_path / "run.pth")
    path = tmp_path / "release" / "model.safetensors"
    assert "lm_head.weight" not in load_file(path)  # save_pretrained writes the tie once
    served = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "release")  # the real serving loader
    assert served.lm_head.weight is served.transformer.wte.weight
    args = [str(path), "--model", spec, "--exact", "--reference", str(tmp_path / "run.pth"), "--input-shape", "1,8"]
    plain = _json(cli_runner, args, 3)  # the default serving loader is the plain strict load: the tie is missing
    assert plain["missing"] == ["lm_head.weight"] and "--serving-loader transformers" in plain["failures"][0]
    report = _json(cli_runner, [*args, "--serving-loader", "transformers"], 0)
    assert report["missing"] == [] and report["failures"] == [] and report["convert_command"] is None
    assert report["tolerated"] == [{"key": "lm_head.weight", "kind": "tied", "reason": "tied to transformer.wte.weight, "
                                    "which is present; the model ties it again after loading"}]
    assert report["matched"] == report["total"] - 1 and report["forward"]["max_abs_diff"] == 0.0
    assert any(n.startswith("lm_head.weight: not among the keys safetensors.torch.load_file returns; "
                            "GPT2LMHeadModel.tie_weights() ties it to transformer.wte.weight") for n in report["notes"])


# --- devices: where a plain torch.load puts the tensors ---

HAS_CUDA = [f"cuda:{i}" for i in range(torch.cuda.device_count())]


@pytest.mark.parametrize("fixture, serving, ok", [
    ("mlp_cuda0.pth", "cpu", False),
    ("mlp_cuda0.pth", "cuda:0", True),
    ("mlp_cuda0.pth", "cuda", True),  # torch's current device: cuda:0
    ("mlp_cuda1.pth", "cuda:0", False),
    ("mlp_model_parallel.pth", "cuda:1", False),
    ("mlp_model_parallel.pth", None, len(HAS_CUDA) >= 2),  # this machine
    ("mlp_cuda0.pth", None, len(HAS_CUDA) >= 1),
    ("mlp_single.pth", "cpu", True),
    ("mlp_single.pth", "cuda:1", True),  # CPU tensors load anywhere; load_state_dict copies them over
    ("mlp_safetensors.safetensors", "cuda:0", True),  # load_file puts every tensor on the CPU
])
def test_exact_checks_the_devices_a_plain_load_needs(fixture: str, serving: str | None, ok: bool, cli_runner: Any,
                                                     fixtures_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / fixture
    src.write_bytes((fixtures_dir / fixture).read_bytes())
    device = ["--serving-device", serving] if serving else []
    report = _json(cli_runner, [str(src), "--model", MLP_SPEC, "--exact", "--no-forward", *device], 0 if ok else 3)
    saved = ckptfix.inspect(src).devices
    assert report["devices"] == saved and report["serving_device"] == serving and report["ok"] is ok
    if not HAS_CUDA and "cuda:0" in saved:  # the bug: plain torch.load raises here, so --exact must fail here
        with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
            torch.load(src, weights_only=True)
    text = cli_runner.invoke(cli, ["verify", str(src), "--model", MLP_SPEC, "--exact", "--no-forward", *device]).output
    assert "  devices: " + ", ".join(f"{k} ×{v}" for k, v in saved.items()) in text
    if ok:
        return
    placed = [f for f in report["failures"] if not f.startswith("exact: the serving loader failed as saved: ")]
    assert placed and all(f.startswith("exact: torch.load(weights_only=True) puts ") and "(as saved)" in f for f in placed)
    if not HAS_CUDA:  # the loader, observed here (the serving GPU's storages mapped onto the CPU), fails too
        assert len(report["failures"]) - len(placed) == 1
    assert report["convert_command"].endswith("--to single --map-location cpu")
    assert cli_runner.invoke(cli, shlex.split(report["convert_command"])[1:]).exit_code == 0
    fixed = Path(shlex.split(report["convert_command"])[3])
    assert _json(cli_runner, [str(fixed), "--model", MLP_SPEC, "--exact", *device], 0)["devices"] == {"cpu": 6}
    torch.load(fixed, weights_only=True)  # loads on any machine, no map_location


def test_serving_device_goes_with_exact(cli_runner: Any, fixtures_dir: Path) -> None:
    path = str(fixtures_dir / "mlp_cuda0.pth")
    res = cli_runner.invoke(cli, ["verify", path, "--model", MLP_SPEC, "--serving-device", "cpu"])
    assert res.exit_code == 2 and "--serving-device goes with --exact" in res.output
    res = cli_runner.invoke(cli, ["verify", path, "--model", MLP_SPEC, "--exact", "--serving-device", "gpu0", "--quiet"])
    assert res.exit_code == 2 and res.output.endswith("Error: --serving-device 'gpu0' is not a device the serving code "
                                                       "loads on: use cpu, cuda or cuda:N\n"), res.output
    with pytest.raises(ckptfix.errors.DeviceError, match="pass exact=True"):
        ckptfix.verify(path, MLP_SPEC, serving_device="cpu")


# --- failure lines name their keys; progress on a terminal ---

def test_failure_lines_name_their_keys(cli_runner: Any, fixtures_dir: Path, tmp_path: Path) -> None:
    sd = torch.load(fixtures_dir / "mlp_single.pth", weights_only=True)
    sd["0.weight"][0, 0] = float("nan")
    del sd["4.bias"]
    torch.save(sd, tmp_path / "bad.pth")
    report = _json(cli_runner, [str(tmp_path / "bad.pth"), "--model", MLP_SPEC, "--exact"], 3)
    assert report["failures"] == [
        "1 missing: 4.bias; 1 non-finite: 0.weight (a different architecture or configuration than the checkpoint's?)",
        "exact: load_state_dict(strict=True) would fail as saved: 1 missing: 4.bias",
        "exact: the serving loader failed as saved: torch.load(PATH, weights_only=True, mmap=True) + "
        "load_state_dict(strict=True): the strict load: RuntimeError: Error(s) in loading state_dict for Sequential: "
        'Missing key(s) in state_dict: "4.bias".']
    text = cli_runner.invoke(cli, ["verify", str(tmp_path / "bad.pth"), "--model", MLP_SPEC, "--exact"]).output
    assert all(f"  FAIL: {f}\n" in text for f in report["failures"])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_long_verify_shows_progress_on_a_terminal(tty: bool, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr(Progress, "DELAY", 0.0)  # "long": every run here
    report = ckptfix.verify(fixtures_dir / "mlp_single.pth", MLP_SPEC, progress=True)
    assert report.ok
    if tty:  # the long part: checking the values (the file is hashed while it is read: no line of its own)
        out = err.getvalue()
        assert out.startswith("\r  verify: NaN/Inf: ") and "SHA-256" not in out
        assert "6/6 tensors" in out and "(100%)" in out and out.endswith("\n")
    else:  # a CI log: a line per phase, no progress line
        assert re.findall(r"^ckptfix verify: (\w+) \(\d+\.\d s\)$", err.getvalue(), re.M) == \
            ["read", "build", "hash", "values", "crc", "load"] and "\r" not in err.getvalue()
