"""DeepSpeed ZeRO 1–3: the fp32 master weights, consolidated as zero_to_fp32.py does, safely and streaming.

Fast tests use fixtures/deepspeed_layouts.py (every file a 2-rank run writes, made with torch only) for
every stage × precision; the real ones train with deepspeed itself (fixtures/deepspeed_train.py, CPU,
gloo, 2 processes), run the zero_to_fp32.py it saved and compare, and hold the imitation to the real
files. They skip where deepspeed can't be imported (the Makefile installs it when it can).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import DeepSpeedZeroError, LoadError, UnsafeCheckpointError

STAGES = (1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
MATRIX = [(s, p) for s in STAGES for p in PRECISIONS]
TAG = "global_step5"


@pytest.fixture(scope="module")
def zero(train: Any) -> Any:
    """fixtures/deepspeed_layouts.py as a module."""
    return train._layouts()._deepspeed_layouts()


@pytest.fixture
def make(tmp_path: Path, train: Any, zero: Any) -> Callable[..., Path]:
    """``make(stage, precision, **kw)``: a ZeroNet run's checkpoint directory (the one holding ``latest``)."""
    def build(stage: int, precision: str, model: str = "zeronet", **kwargs: Any) -> Path:
        out = tmp_path / f"zero{stage}_{precision}"
        zero.save_deepspeed(train, model, out, stage, precision, **kwargs)
        return out
    return build


def assert_same(got: Any, want: Any, shared: bool = True) -> None:
    """Same keys, dtypes and values, bit for bit; tied keys share one tensor where ``want``'s do (``shared``; a
    safetensors output stores every tied name, each its own tensor, unless written with ``compact_ties``)."""
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k]), k
    for k in want if shared else ():
        twins = [j for j in want if j != k and want[j] is want[k]]
        assert all(got[j].data_ptr() == got[k].data_ptr() for j in twins), (k, twins)


def model_order(directory: Path, want: Any) -> list[str]:
    """The model's key order (rank 0's ``module``), which ckptfix keeps (zero_to_fp32.py puts buffers first)."""
    name = next(p for p in sorted((directory / TAG).glob("*model_states.pt")))
    module = torch.load(name, weights_only=True)["module"]
    return [k for k in module if k in want]


@pytest.mark.parametrize("stage, precision", MATRIX)
def test_consolidates_the_fp32_master_weights_as_zero_to_fp32(stage: int, precision: str, make: Any, train: Any,
                                                              zero: Any) -> None:
    directory = make(stage, precision)
    want = zero.expected_fp32(train, "zeronet", stage, precision)
    model_states = sorted((directory / TAG).glob("*model_states.pt"))
    for path in (directory, directory / TAG, *model_states):  # the checkpoint dir, its tag dir, any rank's model_states
        got = ckptfix.load(path)
        assert_same(got, want)
        assert list(got) == model_order(directory, want)
    assert "deepspeed" not in sys.modules  # DeepSpeed's pickled classes loaded as stand-ins


@pytest.mark.parametrize("stage, precision", [(s, p) for s, p in MATRIX if s < 3])
def test_parameter_alignment_padding(stage: int, precision: str, make: Any, train: Any, zero: Any) -> None:
    """``zero_optimization.parameter_alignment`` pads each ZeRO-1/2 parameter to 16 bytes (param_alignment_paddings)."""
    directory = make(stage, precision, parameter_alignment=True)
    paddings = torch.load(next((directory / TAG).glob("*optim_states.pt")), weights_only=False,
                          pickle_module=_stand_in_pickle())["optimizer_state_dict"]["param_alignment_paddings"]
    assert any(paddings[0])  # the fixture really pads
    assert_same(ckptfix.load(directory), zero.expected_fp32(train, "zeronet", stage, precision))


def _stand_in_pickle() -> Any:
    """A pickle module whose Unpickler maps DeepSpeed's names to ckptfix's stand-ins (test-side reading)."""
    import pickle

    from ckptfix.safety.deepspeed_policy import STAND_INS

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return STAND_INS.get(f"{module}.{name}") or super().find_class(module, name)

    return type("StandInPickle", (), {"Unpickler": Unpickler, "load": pickle.load, "__name__": "stand_in_pickle"})


@pytest.mark.parametrize("stage, precision", MATRIX)
@pytest.mark.parametrize("ext", [".safetensors", ".pth"])
def test_convert_streams_one_tensor_at_a_time(stage: int, precision: str, ext: str, make: Any, train: Any, zero: Any,
                                              tmp_path: Path) -> None:
    directory = make(stage, precision)
    want = zero.expected_fp32(train, "zeronet", stage, precision)
    report = ckptfix.convert(directory, tmp_path / f"w{ext}")
    assert report.streamed and report.format_in == "deepspeed" and report.num_tensors == len(want)
    assert_same(ckptfix.load(tmp_path / f"w{ext}"), want, shared=ext == ".pth")
    if ext == ".pth":  # what plain torch reads
        assert_same(torch.load(tmp_path / f"w{ext}", weights_only=True), want)
    else:  # the compact form: a tied tensor stored once, ckptfix's reader ties it again
        ckptfix.convert(directory, tmp_path / "compact.safetensors", compact_ties=True)
        assert_same(ckptfix.load(tmp_path / "compact.safetensors"), want)


def test_convert_casts_and_shards_gathered_weights(make: Any, train: Any, zero: Any, tmp_path: Path) -> None:
    directory = make(3, "bf16")  # every ZeRO-3 parameter is gathered from both ranks while it is written
    want = zero.expected_fp32(train, "zeronet", 3, "bf16")
    ckptfix.convert(directory, tmp_path / "half.safetensors", dtype="bf16")
    assert_same(ckptfix.load(tmp_path / "half.safetensors"),
                OrderedDict((k, v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in want.items()), shared=False)
    ckptfix.convert(directory, tmp_path / "sharded", max_shard_size=400)
    assert_same(ckptfix.load(tmp_path / "sharded"), want, shared=False)


@pytest.mark.parametrize("stage, precision", MATRIX)
def test_inspect_says_stage_precision_world_size(stage: int, precision: str, make: Any, cli_runner: Any) -> None:
    directory = make(stage, precision)
    res = cli_runner.invoke(cli, ["inspect", str(directory), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["framework"] == "deepspeed" and info["format"] == "deepspeed" and info["state_dict_key"] is None
    assert info["notes"][0].startswith(f"DeepSpeed ZeRO-{stage} checkpoint (deepspeed 0.19.8, {precision}, world size 2, "
                                       f"tag {TAG}): the fp32 master weights, consolidated from 2 *_optim_states.pt files")
    assert info["dtypes"] == {"float32": 9 if stage > 1 else 7, "int64": 1}
    text = cli_runner.invoke(cli, ["inspect", str(directory)]).stdout
    assert "layout:         deepspeed checkpoint" in text and f"note: DeepSpeed ZeRO-{stage} checkpoint" in text


@pytest.mark.parametrize("stage, precision", [(s, p) for s, p in MATRIX if p != "fp32"])
def test_notes_say_what_was_upcast_or_left_out(stage: int, precision: str, make: Any) -> None:
    notes = " | ".join(ckptfix.inspect(make(stage, precision)).notes)
    saved = "bfloat16" if precision == "bf16" else "float16"
    frozen = ", frozen.weight, frozen.bias" if stage > 1 else ""
    assert f"tensor(s) saved in {saved} (buffers, frozen parameters) written as float32" in notes
    assert f"norm.running_mean, norm.running_var{frozen}" in notes
    assert ("2 key(s) of 'module' have no saved master weights" in notes) == (stage == 1)


@pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "fp16"), (2, "fp32")])
def test_select_module_takes_the_training_copy(stage: int, precision: str, make: Any, tmp_path: Path) -> None:
    directory = make(stage, precision)
    module = torch.load(directory / TAG / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    report = ckptfix.convert(directory, tmp_path / "copy.safetensors", select="module")
    assert report.state_dict_key == "module"
    out = ckptfix.load(tmp_path / "copy.safetensors")
    assert list(out) == list(module) and all(out[k].dtype == module[k].dtype and torch.equal(out[k], module[k]) for k in out)
    note = "took the" if precision != "fp32" else "'module' holds the model's full weights"
    assert any(note in n for n in report.notes), report.notes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_placeholders_are_never_taken(precision: str, make: Any) -> None:
    directory = make(3, precision)
    for path in (directory, directory / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"):
        with pytest.raises(DeepSpeedZeroError, match="--select module can't help: the placeholders hold no values"):
            ckptfix.load(path, select="module")


@pytest.mark.parametrize("stage, precision, message", [
    (3, "bf16", "is a DeepSpeed ZeRO-3 per-rank file .*splits the weights across every rank's \\*_optim_states.pt, "
                "which are not in "),
    (2, "bf16", "trained in bf16 .*the fp32 master weights are in the \\*_optim_states.pt files, which are not in .*"
                "pass --select module"),
])
def test_a_model_states_file_alone_is_refused_with_what_to_give(stage: int, precision: str, message: str, make: Any,
                                                                tmp_path: Path, cli_runner: Any) -> None:
    directory = make(stage, precision)
    alone = tmp_path / "alone" / TAG
    alone.mkdir(parents=True)
    src = sorted((directory / TAG).glob("*model_states.pt"))[0]
    shutil.copy(src, alone / src.name)
    path = alone / src.name
    with pytest.raises(DeepSpeedZeroError, match=message):
        ckptfix.load(path)
    with pytest.raises(DeepSpeedZeroError, match=message):
        ckptfix.load(alone)  # the tag directory without optim_states
    res = cli_runner.invoke(cli, ["convert", str(path), str(tmp_path / "o.safetensors")])
    assert res.exit_code == 1 and res.stderr.startswith(f"Error: {path}: is a DeepSpeed ZeRO-")
    assert len(res.stderr.splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_fp32_model_states_alone_is_its_module(make: Any, train: Any, zero: Any, tmp_path: Path) -> None:
    directory = make(2, "fp32", model="mlp")
    for optim in (directory / TAG).glob("*optim_states.pt"):
        optim.unlink()
    report = ckptfix.convert(directory / TAG / "mp_rank_00_model_states.pt", tmp_path / "w.safetensors")
    assert report.state_dict_key == "module"
    assert any("no *_optim_states.pt beside it" in n for n in report.notes)
    assert_same(ckptfix.load(tmp_path / "w.safetensors"), zero.expected_fp32(train, "mlp", 2, "fp32"), shared=False)


@pytest.mark.parametrize("stage", STAGES)
def test_load_into_and_verify_the_model(stage: int, make: Any, zero: Any) -> None:
    directory = make(stage, "bf16")
    if stage == 1:  # ZeRO-1 saves no frozen parameters: a strict load says which are missing
        with pytest.raises(LoadError, match="2 missing: frozen.weight, frozen.bias"):
            ckptfix.load_into(zero.ZeroNet(), directory)
        return
    model = zero.ZeroNet()
    report = ckptfix.load_into(model, directory)
    assert report.matched == 10 and not report.missing and model.head.weight is model.embed.weight
    assert ckptfix.verify(directory, zero.ZeroNet(), forward=False).ok


def test_trusted_read_needs_deepspeed_or_gives_the_same(make: Any, train: Any, zero: Any, tmp_path: Path) -> None:
    """--trust unpickles with deepspeed's own classes (in a child: deepspeed stays out of this process):
    the same weights, or without deepspeed one line saying so."""
    directory = make(2, "bf16")
    res = subprocess.run([sys.executable, "-m", "ckptfix", "convert", "--trust", str(directory), str(tmp_path / "t.safetensors")],
                         capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if res.returncode:
        assert res.returncode == 1 and "No module named 'deepspeed'" in res.stderr and len(res.stderr.splitlines()) == 1
        return
    assert_same(ckptfix.load(tmp_path / "t.safetensors"), zero.expected_fp32(train, "zeronet", 2, "bf16"), shared=False)


# --- refusals: one line naming the file and what to do ---

class _Evil:
    def __reduce__(self) -> Any:
        return os.system, ("echo pwned",)


def _rewrite_optim(directory: Path, rank: int, zero: Any, change: Callable[[dict], None]) -> Path:
    path = next((directory / TAG).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    state = torch.load(path, weights_only=False, pickle_module=_stand_in_pickle())
    osd = state["optimizer_state_dict"]  # written again with the fixture's classes, under DeepSpeed's names
    osd["loss_scaler"], osd["zero_stage"] = zero.LossScaler(), zero.ZeroStageEnum(int(osd["zero_stage"]))
    osd.pop("param_slice_mappings")
    change(state)
    torch.save(state, path, pickle_module=zero._PickleModule)
    return path


class _Stage:
    """Pickles as ``ZeroStageEnum(7)``."""

    def __init__(self, zero: Any):
        self.zero = zero

    def __reduce__(self) -> Any:
        return self.zero.ZeroStageEnum, (7,)


def test_hostile_optim_states_name_only_the_unsafe_global(make: Any, zero: Any, cli_runner: Any) -> None:
    directory = make(2, "bf16")
    path = _rewrite_optim(directory, 1, zero, lambda s: s["optimizer_state_dict"].update(payload=_Evil()))
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptfix.load(directory)
    message = str(info.value)
    assert message.startswith(f"{path}: refused: ") and "posix.system" in message and "LossScaler," not in message
    assert info.value.globals == ["posix.system"]
    res = cli_runner.invoke(cli, ["inspect", str(directory)])
    assert res.exit_code == 1 and len(res.stderr.splitlines()) == 1 and "posix.system" in res.stderr


@pytest.mark.parametrize("case, error, message", [
    ("missing-rank", DeepSpeedZeroError, "rank files .* are not ranks 0..0: a rank's file is missing"),
    ("extra-rank", DeepSpeedZeroError, "partition_count says 2 ranks but there are 3 \\*_optim_states.pt files"),
    ("latest-escapes", DeepSpeedZeroError, "latest: names '../elsewhere', not a tag directory inside"),
    ("latest-dangling", DeepSpeedZeroError, "latest: names tag 'global_step9' but .* is not a directory"),
    ("model-parallel", DeepSpeedZeroError, "holds model-parallel ranks other than mp_rank_00"),
    ("both-prefixes", DeepSpeedZeroError, "holds both bf16_zero_pp_rank_\\* and zero_pp_rank_\\* optim_states files"),
    ("bad-stage", UnsafeCheckpointError, "ZeroStageEnum is allowed only as pickle writes a member"),
    ("bf16-optimizer", DeepSpeedZeroError, "has no zero_stage: written by DeepSpeed's BF16_Optimizer"),
    ("other-save", DeepSpeedZeroError, "the files don't belong together"),
])
def test_broken_checkpoints_are_refused_in_one_line(case: str, error: type, message: str, make: Any, zero: Any,
                                                    train: Any, tmp_path: Path) -> None:
    directory = make(2, "bf16")
    tag = directory / TAG
    if case == "missing-rank":
        (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif case == "extra-rank":
        shutil.copy(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                    tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    elif case == "latest-escapes":
        (directory / "latest").write_text("../elsewhere")
    elif case == "latest-dangling":
        (directory / "latest").write_text("global_step9")
    elif case == "model-parallel":
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    elif case == "both-prefixes":
        shutil.copy(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    elif case == "bad-stage":
        _rewrite_optim(directory, 0, zero, lambda s: s["optimizer_state_dict"].update(zero_stage=_Stage(zero)))
    elif case == "bf16-optimizer":
        _rewrite_optim(directory, 0, zero, lambda s: s["optimizer_state_dict"].pop("zero_stage"))
    elif case == "other-save":
        other = tmp_path / "other"
        zero.save_deepspeed(train, "mlp", other, 2, "bf16")
        shutil.copy(other / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", tag)
    with pytest.raises(error, match=message) as info:
        ckptfix.load(directory)
    assert "\n" not in str(info.value)


# --- real DeepSpeed: its own checkpoints and its own zero_to_fp32.py ---

REAL = [(2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory, train: Any) -> Path:
    """One 2-process DeepSpeed run (CPU, gloo) saving ZeRO-2/3 × fp32/bf16 checkpoints of ZeroNet."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True, env=env)
    if probe.returncode:
        lines = probe.stderr.strip().splitlines()
        pytest.skip(f"deepspeed can't be imported: {lines[-1] if lines else probe.returncode}")
    out = tmp_path_factory.mktemp("deepspeed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
    try:
        import deepspeed_train
    finally:
        sys.path.pop(0)
    deepspeed_train.generate(out, REAL)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", REAL)
def test_real_deepspeed_matches_its_zero_to_fp32(stage: int, precision: str, real_runs: Path, tmp_path: Path) -> None:
    directory = real_runs / f"zero{stage}_{precision}"
    res = subprocess.run([sys.executable, str(directory / "zero_to_fp32.py"), str(directory), str(tmp_path / "ref")],
                         capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert res.returncode == 0, res.stderr[-2000:]
    want = torch.load(tmp_path / "ref" / "pytorch_model.bin", weights_only=True)
    assert_same(ckptfix.load(directory), want)
    ckptfix.convert(directory, tmp_path / "w.safetensors")
    assert_same(ckptfix.load(tmp_path / "w.safetensors"), want, shared=False)
    assert_same(ckptfix.load(sorted((directory / "global_step3").glob("*model_states.pt"))[-1]), want)
    assert "deepspeed" not in sys.modules


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", REAL)
def test_imitation_matches_real_deepspeed_files(stage: int, precision: str, real_runs: Path, tmp_path: Path, train: Any,
                                                zero: Any) -> None:
    """fixtures/deepspeed_layouts.py writes what deepspeed writes: the same files, keys in the same order,
    tensors of the same shapes, dtypes and storage layouts, the same pickled globals (values differ: its
    training is plain torch)."""
    from ckptfix.formats.torchsave import records
    from ckptfix.safety.deepspeed_policy import optim_policy

    real = real_runs / f"zero{stage}_{precision}" / "global_step3"
    zero.save_deepspeed(train, "zeronet", tmp_path, stage, precision, tag="global_step3")
    fake = tmp_path / "global_step3"
    assert sorted(p.name for p in real.iterdir()) == sorted(p.name for p in fake.iterdir())
    for name in sorted(p.name for p in real.iterdir()):
        a, b = (records.read_structure(str(d / name), optim_policy()).obj for d in (real, fake))
        assert _signature(a) == _signature(b), name
        assert _globals(real / name) == _globals(fake / name), name


def _signature(v: Any) -> Any:
    """Structure, types and tensor layouts, not values (nor the run's step counts and config)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.untyped_storage().nbytes(), v.storage_offset(), v.requires_grad,
                tuple(sorted(getattr(v, "__dict__", {}))))
    if isinstance(v, dict):
        return (type(v).__name__, tuple((k, _signature(x)) for k, x in v.items() if k not in ("global_steps", "global_samples")))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_signature(x) for x in v))
    if hasattr(v, "__dict__") and not isinstance(v, type):
        return (f"{type(v).__module__}.{type(v).__qualname__}", tuple((k, _signature(x)) for k, x in vars(v).items()))
    return v if isinstance(v, (str, bool)) or v is None or isinstance(v, int) and type(v) is not int else type(v).__name__


def _globals(path: Path) -> list[str]:
    return sorted(g.name for g in ckptfix.scan(path).globals)


@pytest.mark.parametrize("stage", [2, 3])
def test_scan_reads_every_rank_file_with_deepspeeds_names_allowed(stage: int, make: Callable[..., Path]) -> None:
    """`ckptfix scan DIR`: each model_states and optim_states file walked; DeepSpeed's loss scaler, ZeRO
    stage and fragment address are `allowed` there (loaded as inert stand-ins), nowhere else."""
    import ckptfix

    ckpt = make(stage, "bf16")
    report = ckptfix.scan(ckpt)
    assert report.ok and report.format == "deepspeed", report.findings
    files = {p.split(":")[0] for p in report.pickles}
    assert any("optim_states" in f for f in files) and any("model_states" in f for f in files)
    allowed = {g.name for g in report.globals if g.category == "allowed"}
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in allowed
    assert all("optim_states" in g.where for g in report.globals if g.name.startswith("deepspeed."))
