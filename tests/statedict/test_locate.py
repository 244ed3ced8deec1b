"""Where the state dict sits: bare, training checkpoints, EMA, explicit and ambiguous selection, DeepSpeed ZeRO."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import DeepSpeedZeroError, SelectError
from ckptfix.statedict.locate import find_state_dict, put_back

MLP_SPEC = str(Path(__file__).resolve().parents[2] / "fixtures" / "train.py") + ":mlp"

SD = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.zeros(2)}


@pytest.mark.parametrize("key", ["state_dict", "model_state_dict", "model", "net", "network", "module"])
def test_known_keys(key: str) -> None:
    sel = find_state_dict({key: SD, "epoch": 3, "optimizer": {"state": {}, "param_groups": []}})
    assert sel.key == key and sel.state_dict is SD
    assert set(sel.extra) == {"epoch", "optimizer"}


def test_bare_state_dict() -> None:
    sel = find_state_dict(SD)
    assert sel.key is None and sel.extra == {}
    with pytest.raises(SelectError, match="bare state dict"):
        find_state_dict(SD, select="state_dict")


def test_auto_never_takes_ema_but_reports_it() -> None:
    ema = {k: v * 2 for k, v in SD.items()}
    sel = find_state_dict({"state_dict": SD, "state_dict_ema": ema, "epoch": 1})
    assert sel.key == "state_dict" and sel.ema_keys == ["state_dict_ema"]
    assert find_state_dict({"state_dict": SD, "state_dict_ema": ema}, select="state_dict_ema").state_dict is ema
    with pytest.raises(SelectError, match="only EMA weights .*--select model_ema"):
        find_state_dict({"model_ema": ema, "epoch": 1})


def test_ambiguous_and_missing() -> None:
    with pytest.raises(SelectError, match="several state dicts \\(generator, discriminator\\)"):
        find_state_dict({"generator": SD, "discriminator": SD})
    with pytest.raises(SelectError, match="no state dict found"):
        find_state_dict({"epoch": 1, "loss": 0.5})
    with pytest.raises(SelectError, match="no entry 'nope'; state dicts found: model"):
        find_state_dict({"model": SD}, select="nope")


def test_put_back_keeps_layout_and_order() -> None:
    ckpt = {"epoch": 1, "model_state_dict": SD, "loss": 0.1}
    new = {"x": torch.ones(1)}
    out = put_back(ckpt, "model_state_dict", new)
    assert list(out) == ["epoch", "model_state_dict", "loss"] and out["model_state_dict"] is new
    assert put_back(SD, None, new) is new


# --- DeepSpeed ZeRO model_states files without their optim_states: 'module' is not always the weights
# (fixtures/deepspeed_layouts.py, deepspeed 0.19.8; consolidating with them: tests/formats/test_deepspeed.py) ---

@pytest.fixture
def deepspeed(tmp_path: Path, train: Any) -> Callable[..., list[Path]]:
    """``deepspeed(stage, precision)``: the model_states file(s) of a 2-rank DeepSpeed run without the
    optim_states files, with the zero_to_fp32.py DeepSpeed copies into the checkpoint directory (a
    stand-in: it is never run)."""
    def make(stage: int, precision: str) -> list[Path]:
        out = tmp_path / f"zero{stage}_{precision}"
        paths = train._layouts().save_deepspeed(train, "mlp", out, stage, precision, optim_states=False)
        (out / "zero_to_fp32.py").write_text("# DeepSpeed's consolidation script\n")
        return paths
    return make


ZERO_REFUSED = {  # (stage, precision) → what the refusal says it is
    (3, "fp32"): "is a DeepSpeed ZeRO-3 per-rank file \\(deepspeed 0.19.8, fp32\\): its 'module' holds 6 placeholder",
    (3, "bf16"): "is a DeepSpeed ZeRO-3 per-rank file \\(deepspeed 0.19.8, bf16\\): its 'module' holds 6 placeholder",
    (2, "bf16"): "is a DeepSpeed ZeRO-2 checkpoint trained in bf16 \\(deepspeed 0.19.8\\): "
                 "its 'module' holds the bf16 training copy",
    (1, "fp16"): "is a DeepSpeed ZeRO-1 checkpoint trained in fp16 \\(deepspeed 0.19.8\\): "
                 "its 'module' holds the fp16 training copy",
}


def _verbs(path: Path, tmp_path: Path, train: Any, select: str) -> dict[str, Callable[[], Any]]:
    return {
        "convert": lambda: ckptfix.convert(path, tmp_path / "out.safetensors", select=select),
        "convert-dcp": lambda: ckptfix.convert(path, tmp_path / "out_dcp", format="dcp", select=select),
        "load": lambda: ckptfix.load(path, select=select),
        "load_into": lambda: ckptfix.load_into(train.mlp(), path, select=select),
        "verify": lambda: ckptfix.verify(path, train.mlp(), select=select),
        "verify-no-forward": lambda: ckptfix.verify(path, train.mlp(), forward=False, select=select),
    }


@pytest.mark.parametrize("stage, precision", ZERO_REFUSED)
def test_deepspeed_zero_files_are_refused_with_what_to_do(stage: int, precision: str, deepspeed: Any, tmp_path: Path,
                                                          train: Any, cli_runner: Any) -> None:
    for path in deepspeed(stage, precision):
        todo = f"which are not in {path.parent}: give the checkpoint directory (the one holding `latest`) or the tag directory"
        for verb, call in _verbs(path, tmp_path, train, "auto").items():
            with pytest.raises(DeepSpeedZeroError, match=ZERO_REFUSED[stage, precision]) as info:
                call()
            assert str(info.value).startswith(f"{path}: ") and todo in str(info.value), verb
            assert (stage == 3) != ("pass --select module" in str(info.value))
        for verb in ("convert", "verify"):
            args = [str(path), str(tmp_path / "o.pth")] if verb == "convert" else [str(path), "--model", MLP_SPEC]
            res = cli_runner.invoke(cli, [verb, *args])
            assert res.exit_code == 1 and res.stderr.startswith(f"Error: {path}: is a DeepSpeed ZeRO-")
            assert len(res.stderr.splitlines()) == 1 and res.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"zero{stage}_{precision}"]  # nothing was written


@pytest.mark.parametrize("stage, precision", [(3, "fp32"), (3, "bf16")])
def test_deepspeed_zero3_placeholders_are_never_taken(stage: int, precision: str, deepspeed: Any, tmp_path: Path,
                                                      train: Any) -> None:
    path = deepspeed(stage, precision)[0]
    for _verb, call in _verbs(path, tmp_path, train, "module").items():
        with pytest.raises(DeepSpeedZeroError, match="--select module can't help: the placeholders hold no values"):
            call()


@pytest.mark.parametrize("stage, precision", [(2, "bf16"), (1, "fp16")])
def test_deepspeed_half_copy_when_selected_deliberately(stage: int, precision: str, deepspeed: Any, tmp_path: Path,
                                                        train: Any) -> None:
    path = deepspeed(stage, precision)[0]
    module = torch.load(path, weights_only=True)["module"]
    report = ckptfix.convert(path, tmp_path / "half.safetensors", select="module")
    assert f"took the {precision} training copy in 'module' as asked" in " ".join(report.notes)
    out = ckptfix.load(tmp_path / "half.safetensors")
    assert list(out) == list(module) and all(torch.equal(out[k], module[k]) and out[k].dtype == module[k].dtype for k in out)
    assert ckptfix.verify(path, train.mlp(), select="module", forward=False).ok  # cast on load: a warning only
    ckptfix.load_into(train.mlp(), path, select="module")


def test_deepspeed_fp32_zero2_module_is_the_weights(deepspeed: Any, tmp_path: Path, train: Any) -> None:
    path = deepspeed(2, "fp32")[0]
    report = ckptfix.convert(path, tmp_path / "w.safetensors")
    assert report.state_dict_key == "module" and "DeepSpeed ZeRO-2 (deepspeed 0.19.8, fp32): " \
        "'module' holds the model's full weights; " \
        "no *_optim_states.pt beside it to consolidate the fp32 master weights from" in report.notes
    net, _opt, _loss = train._train("mlp", "single")
    out = ckptfix.load(tmp_path / "w.safetensors")
    assert list(out) == list(net.state_dict()) and all(torch.equal(out[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize("stage, precision", ZERO_REFUSED)
def test_inspect_says_what_a_deepspeed_file_is(stage: int, precision: str, deepspeed: Any, cli_runner: Any) -> None:
    path = deepspeed(stage, precision)[-1]
    assert ckptfix.scan(path).ok  # model_states pickle no deepspeed class: the safe loader reads them as they are
    res = cli_runner.invoke(cli, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["framework"] == "deepspeed" and info["state_dict_key"] == "module"
    note = next(n for n in info["notes"] if n.startswith("a DeepSpeed ZeRO-"))
    assert note.endswith("convert, load and verify refuse it as it is") and "zero_to_fp32.py" in note
    assert all(row["shape"] == ([0] if stage == 3 else row["shape"]) for row in info["keys"])
    text = cli_runner.invoke(cli, ["inspect", str(path)]).stdout
    assert "layout:         deepspeed checkpoint" in text and "note: a DeepSpeed ZeRO-" in text
