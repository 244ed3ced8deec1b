"""A ``save_pretrained`` directory — one ``model.safetensors`` or ``pytorch_model.bin``, no index, a ``config.json``
beside it or not — is read as that file by every verb, locally and from a URL; ``model.safetensors`` wins when
both are there (as transformers prefers); other weights files beside it are refused in one line naming them.
ckptfix's own ``--max-shard-size`` output that fits one shard is such a directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import FormatError
from tests.memory_backend import MemoryBackend, registered

#: the file each kind of directory holds, and how transformers' save_pretrained writes it
WRITERS: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "model.safetensors": lambda sd, path: save_file(sd, str(path), metadata={"format": "pt"}),
    "pytorch_model.bin": lambda sd, path: torch.save(sd, path),
}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _net().state_dict().items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same keys (a safetensors file stores them sorted) and bit-identical tensors."""
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _directory(root: Path, names: tuple[str, ...], config: bool = True, state: dict | None = None) -> Path:
    """A save_pretrained-style directory holding ``names`` (each the same weights unless ``state`` says)."""
    root.mkdir()
    for name in names:
        WRITERS[name](state or _state(), root / name)
    if config:
        (root / "config.json").write_text(json.dumps({"model_type": "mlp", "hidden": 3}))
    return root


def _loaded_into(path: Any) -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ckptfix.load_into(model, path)
    return model.state_dict()


def _diffed(path: Any, out: Path) -> tuple[None, str]:
    """``diff`` of ``path`` and the weights it must hold: identical."""
    torch.save(_state(), expected := out.parent / "expected.pth")
    report = ckptfix.diff(path, expected)
    assert report.identical and report.counts["common"] == len(_state()), report.format_text()
    return None, ""


def _converted(path: Any, out: Path) -> dict[str, Any]:
    ckptfix.convert(path, out / "out.pth")
    return torch.load(out / "out.pth", weights_only=True)


#: each verb on a path, returning (what it read as the weights, or None, and the path it names)
VERBS: dict[str, Callable[[Any, Path], tuple[dict[str, Any] | None, str]]] = {
    "inspect": lambda p, out: (None, ckptfix.inspect(p).path),
    "describe": lambda p, out: (None, ckptfix.describe(p).path),
    "scan": lambda p, out: (None, ckptfix.scan(p).path),
    "read": lambda p, out: (dict(ckptfix.read(p).state_dict), ckptfix.read(p).path),
    "load": lambda p, out: (dict(ckptfix.load(p)), ""),
    "load_into": lambda p, out: (_loaded_into(p), ""),
    "convert": lambda p, out: (_converted(p, out), ckptfix.convert(p, out / "again.safetensors").src),
    "verify": lambda p, out: (None, ckptfix.verify(p, _net(), exact=True).checkpoint),
    "diff": _diffed,
}


@pytest.mark.parametrize("verb", list(VERBS))
@pytest.mark.parametrize("names, chosen", [
    (("model.safetensors",), "model.safetensors"), (("pytorch_model.bin",), "pytorch_model.bin"),
    (("model.safetensors", "pytorch_model.bin"), "model.safetensors"),
], ids=["safetensors", "bin", "both"])
def test_every_verb_reads_the_directory_as_its_file(verb: str, names: tuple[str, ...], chosen: str,
                                                    tmp_path: Path) -> None:
    both = len(names) == 2
    state = _state()
    root = _directory(tmp_path / "hf", names, state=state)
    if both:  # the bin holds other values: only the chosen file's may come back
        torch.save({k: v + 1 for k, v in state.items()}, root / "pytorch_model.bin")
    (out := tmp_path / "out").mkdir()
    weights, named = VERBS[verb](root, out)
    if weights is not None:
        assert _same(weights, state)
    if named:  # the report names the file read
        assert named == str(root / chosen)
    if verb == "verify":
        assert ckptfix.verify(root, _net(), exact=True).ok


@pytest.mark.parametrize("name", list(WRITERS))
def test_the_command_line_reads_the_directory(name: str, tmp_path: Path, cli_runner: Any) -> None:
    root = _directory(tmp_path / "hf", (name,), config=False)
    for argv, code in [(["inspect", str(root)], 0), (["scan", str(root)], 0),
                       (["convert", str(root), str(tmp_path / "o.safetensors")], 0),
                       (["verify", str(root), "--model", "torch.nn:Linear", "--arg", "in_features=4", "--arg",
                         "out_features=3", "--quiet"], 3),  # read as the file: its keys are the Sequential's
                       (["diff", str(root), str(root / name)], 0)]:
        res = cli_runner.invoke(cli, argv)
        assert res.exit_code == code, (argv, res.output)
        assert res.stderr == "", res.stderr
    assert _same(ckptfix.load(tmp_path / "o.safetensors"), ckptfix.load(root / name))


@pytest.mark.parametrize("extra", ["adapter_model.safetensors", "weights.pth", "old.pt", "model-00001-of-00002.bin"])
@pytest.mark.parametrize("verb", list(VERBS))
def test_other_weights_files_beside_it_are_refused(verb: str, extra: str, tmp_path: Path) -> None:
    root = _directory(tmp_path / "hf", ("model.safetensors",))
    torch.save(_state(), root / extra)
    (out := tmp_path / "out").mkdir()
    with pytest.raises(FormatError, match=rf"hf: holds {extra} beside model.safetensors: which is the checkpoint\?"):
        VERBS[verb](root, out)
    assert list(out.iterdir()) == []


def test_the_refusal_is_one_line_naming_the_files(tmp_path: Path, cli_runner: Any) -> None:
    root = _directory(tmp_path / "hf", ("pytorch_model.bin",))
    for extra in ("b.safetensors", "a.pt"):
        torch.save(_state(), root / extra)
    res = cli_runner.invoke(cli, ["inspect", str(root)])
    assert res.exit_code == 1
    assert res.stderr == (f"Error: {root}: holds a.pt, b.safetensors beside pytorch_model.bin: which is the checkpoint? "
                          "Give the file itself, or move the other weights files out of the directory\n")


def test_a_trainer_checkpoint_directory_is_its_weights(tmp_path: Path) -> None:
    """transformers' Trainer saves its state beside the weights (checkpoint-N/): not weights, not refused."""
    root = _directory(tmp_path / "checkpoint-500", ("model.safetensors",))
    for name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_3.pth"):
        torch.save({"step": 500}, root / name)
    assert _same(ckptfix.load(root), _state())


def test_a_directory_without_weights_says_what_it_lacks(tmp_path: Path) -> None:
    root = _directory(tmp_path / "hf", ())
    (root / "weights.safetensors").write_bytes(b"x")  # not a name save_pretrained writes
    with pytest.raises(FormatError, match="is a directory but neither .* nor a save_pretrained directory "
                                          r"\(no model.safetensors / pytorch_model.bin\)$"):
        ckptfix.inspect(root)


@pytest.mark.parametrize("fmt, name", [(None, "model.safetensors"), ("pth", "pytorch_model.bin")])
def test_a_one_shard_output_is_read_back_by_every_verb(fmt: str | None, name: str, tmp_path: Path) -> None:
    """``convert --max-shard-size`` writes save_pretrained's layout: one shard that fits → that file, no index."""
    src = tmp_path / "src.safetensors"
    save_file(_state(), str(src))
    ckptfix.convert(src, tmp_path / "hf", max_shard_size="1GB", **({"format": fmt} if fmt else {}))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [name]
    (out := tmp_path / "out").mkdir()
    for verb, run in VERBS.items():
        weights, named = run(tmp_path / "hf", out)
        assert weights is None or _same(weights, _state()), verb
        assert named in ("", str(tmp_path / "hf" / name)), verb


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_remote_directory_is_read_as_its_file(name: str, tmp_path: Path) -> None:
    root = _directory(tmp_path / "hf", (name,))
    with registered(MemoryBackend()) as mem:
        url = mem.put_tree(root, "org/hf")
        assert ckptfix.describe(url).path == f"{url}/{name}"
        assert ckptfix.scan(url).ok
        assert _same(dict(ckptfix.read(url).state_dict), dict(ckptfix.read(root / name).state_dict))
        assert _same(_loaded_into(url), _state())
        assert ckptfix.verify(url, _net()).checkpoint == f"{url}/{name}"
        mem.objects["org/hf/extra.safetensors"] = b"x"
        with pytest.raises(FormatError, match="holds extra.safetensors beside"):
            ckptfix.describe(url)
