"""ckptfix against the ``safetensors`` library on the files safetensors' own tests make (tests/public_safetensors_corpus.py).

- what the library reads (``load_file``), ``ckptfix.load`` reads too, bit for bit: the same keys, dtypes, shapes and
  bytes; ``ckptfix scan`` passes it;
- what the library refuses, ckptfix refuses in one line naming the file (a CkptfixError from ``load``, ``read`` and
  ``describe``; exit 1 and one ``Error:`` line from ``inspect`` and ``scan``), never a traceback;
- the ``save_model`` files load with ``ckptfix.load_into`` into the model ``load_model`` loads them into upstream,
  to the values it loads, ties kept; where ``load_model`` refuses, ``load_into`` refuses and leaves the model as it was.

The torch-free reader is compared with the library on the same corpus in tests/formats/test_torchfree_vs_torch.py
("public-safetensors"), and every file ckptfix reads is converted to every format in tests/ops/test_plain_loadable.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, load_model

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import CkptfixError
from tests import public_safetensors_corpus as corpus


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("public_safetensors")
    return {name: make(out) for name, make in corpus.CASES.items()}


def library_reads(path: Path) -> dict[str, torch.Tensor] | None:
    """``safetensors.torch.load_file(path)``, or None where it refuses (a Rust panic is a BaseException)."""
    try:
        return load_file(path)
    except BaseException as e:  # (pyo3's PanicException included)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """dtype, shape and every byte (float8, float4 and 0-dim tensors too)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    a, b = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (got, want))
    return bool(torch.equal(a, b))


def test_the_table_says_what_the_library_refuses(made: dict[str, Path]) -> None:
    """``REFUSED`` is exactly what the library refuses, so the tests below compare what they mean to."""
    assert {name for name, path in made.items() if name not in corpus.BIG and library_reads(path) is None} == corpus.REFUSED


@pytest.mark.parametrize("name", sorted(set(corpus.CASES) - corpus.REFUSED))
def test_load_reads_what_the_library_reads(name: str, made: dict[str, Path], cli_runner: Any) -> None:
    want = library_reads(made[name])
    assert want is not None
    got = ckptfix.load(made[name])
    assert sorted(got) == sorted(want)
    assert not [k for k in want if not same_bits(got[k], want[k])]
    res = cli_runner.invoke(cli, ["scan", str(made[name])])
    assert res.exit_code == 0, res.output


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(set(corpus.CASES) - corpus.REFUSED - corpus.BIG))
def test_load_onto_a_gpu_reads_what_the_library_reads(name: str, made: dict[str, Path]) -> None:
    """ckptfix reads a GPU's tensors through staging windows, never from the mapping: the same bytes as the library's."""
    want = load_file(made[name], device="cuda:0")
    got = ckptfix.load(made[name], map_location="cuda:0")
    assert sorted(got) == sorted(want) and all(t.device.type == "cuda" for t in got.values())
    assert not [k for k in want if not same_bits(got[k], want[k])]


@pytest.mark.parametrize("name", sorted(corpus.REFUSED))
def test_what_the_library_refuses_ckptfix_refuses_in_one_line(name: str, made: dict[str, Path], cli_runner: Any) -> None:
    path = made[name]
    for verb in (ckptfix.load, ckptfix.read, ckptfix.describe):
        with pytest.raises(CkptfixError) as info:
            verb(path)
        message = str(info.value)
        assert message.startswith(str(path)) and "\n" not in message, (verb.__name__, message)
        assert "a bug in ckptfix" not in message
    for command in ("inspect", "scan"):
        res = cli_runner.invoke(cli, [command, str(path)])
        assert res.exit_code == 1, (command, res.output)
        assert res.stderr.startswith(f"Error: {path}") and res.stderr.count("\n") == 1, (command, res.stderr)
        assert "Traceback" not in res.stderr and "unexpected" not in res.stderr


def _built(name: str) -> torch.nn.Module:
    torch.manual_seed(7)  # (both models start alike: a refused load must leave ckptfix's as it was)
    return corpus.MODELS[name]()


@pytest.mark.parametrize("name", list(corpus.MODELS))
def test_load_into_loads_what_load_model_loads(name: str, made: dict[str, Path]) -> None:
    path = made[name]
    theirs, ours = _built(name), _built(name)
    try:
        load_model(theirs, path)
    except RuntimeError:  # missing or unexpected keys: load_model refuses
        before = {k: v.clone() for k, v in ours.state_dict().items()}
        with pytest.raises(CkptfixError) as info:
            ckptfix.load_into(ours, path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
        assert all(same_bits(v, before[k]) for k, v in ours.state_dict().items()), "a refused load changed the model"
        return
    ckptfix.load_into(ours, path)
    got, want = ours.state_dict(), theirs.state_dict()
    assert not [k for k in want if not same_bits(got[k], want[k])]
    # tied parameters stay tied, and only those (as in the model load_model filled)
    ties = {k: id(v) for k, v in ours.named_parameters(remove_duplicate=False)}
    ref_ties = {k: id(v) for k, v in theirs.named_parameters(remove_duplicate=False)}
    assert [ties[a] == ties[b] for a in ties for b in ties] == [ref_ties[a] == ref_ties[b] for a in ties for b in ties]


#: safetensors' malformed files whose refusal names what is wrong with the header (HeaderTooLarge, and the two
#: files no recogniser claims: an 8-byte length and nothing, a length then a byte that is not JSON)
SAYS = {"rust-test_invalid_header_length": "read as a safetensors header length (60 bytes), but the file ends there",
        "rust-test_invalid_header_non_utf8": "read as a safetensors header length (1 bytes), but what follows is not a JSON",
        "rust-test_header_too_large": "its header length (18446742974197923900 bytes) is over safetensors' limit"}


@pytest.mark.parametrize("name", list(SAYS))
def test_a_damaged_header_is_named_as_one(name: str, made: dict[str, Path]) -> None:
    with pytest.raises(CkptfixError, match=re.escape(SAYS[name])) as info:
        ckptfix.describe(made[name])
    assert str(info.value).startswith(f"{made[name]}: ") and "\n" not in str(info.value)
