"""Files that ended in "a bug in ckptfix" (issue 27, item 13) and torch's warnings on stderr (item 11): each is a
one-line error, or read as torch's weights-only loader reads it; a failing command prints exactly one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptfix.cli import cli
from tests.hostile_names import meta_rebuild_state_dict, namespace_class_swap, safetensors_with_metadata

ROOT = Path(__file__).resolve().parents[2]
LINEAR = ["--model", "torch.nn:Linear", "--arg", "in_features=2", "--arg", "out_features=1"]


def _bad_order(path: Path) -> Path:
    return safetensors_with_metadata(path, {"ckptfix": json.dumps({"version": 1, "order": 5})})


CASES = [
    (meta_rebuild_state_dict, "meta.pt", ["diff", "{f}", "{f}"], 1, "'w' was saved on meta and holds none"),
    (namespace_class_swap, "ns.pt", ["convert", "{f}", "{tmp}/x.pth"], 1, "sets its attribute __class__"),
    (namespace_class_swap, "ns.pt", ["scan", "{f}"], 3, "sets its attribute __class__, which no checkpoint sets"),
    *[(_bad_order, "order.safetensors", args, 1, "metadata's order is not a list of key names")
      for args in (["inspect", "{f}"], ["scan", "{f}"], ["convert", "{f}", "{tmp}/x.pth"], ["diff", "{f}", "{f}"],
                   ["verify", "{f}", *LINEAR])],
]


@pytest.mark.parametrize("make,name,args,code,message", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_no_internal_error(make, name: str, args: list[str], code: int, message: str, tmp_path: Path, cli_runner) -> None:
    path = make(tmp_path / name)
    res = cli_runner.invoke(cli, [a.format(f=path, tmp=tmp_path) for a in args])
    assert res.exit_code == code, res.output
    assert message in res.output and "a bug in ckptfix" not in res.output
    assert len(res.stderr.splitlines()) == (code == 1)


def test_meta_tensors_read_as_torch_reads_them(tmp_path: Path, cli_runner) -> None:
    path = meta_rebuild_state_dict(tmp_path / "meta.pt")
    want = torch.load(path, weights_only=True)
    res = cli_runner.invoke(cli, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    assert [(k["key"], k["shape"]) for k in json.loads(res.stdout)["keys"]] == [(k, list(v.shape)) for k, v in want.items()]


def test_namespace_class_swap_is_refused_by_torch_too(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(namespace_class_swap(tmp_path / "ns.pt"), weights_only=True)


_WARNS = """
import sys, warnings, torch
from ckptfix import text
torch.storage._set_always_warn_typed_storage_removal(True)
FAIL = sys.argv[2] == "fail"
def noisy(*args, **kwargs):
    len(torch.FloatStorage([1.0]))  # torch's own deprecation note
    warnings.warn("ckptfix's own note", UserWarning)
    if FAIL:
        raise ValueError("boom")
    return real(*args, **kwargs)
real, text.inspect_text = text.inspect_text, noisy  # inspect's last step, run in the command
from ckptfix.cli import main
sys.argv = ["ckptfix", "inspect", sys.argv[1]]
main()
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_torch_deprecation_warnings_stay_off_stderr(outcome: str, tmp_path: Path) -> None:
    """A real process: torch's TypedStorage note is not printed; ckptfix's own warnings and one Error line are."""
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(2)}, path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", _WARNS, str(path), outcome], capture_output=True, text=True, env=env)
    lines = res.stderr.splitlines()
    assert "TypedStorage" not in res.stderr and any("ckptfix's own note" in line for line in lines), res.stderr
    own = [line for line in lines if "ckptfix's own note" not in line and not line.startswith("  ")]
    assert (res.returncode, own) == ((1, ["Error: unexpected ValueError: boom (a bug in ckptfix; CKPTFIX_DEBUG=1 "
                                          "shows the traceback)"]) if outcome == "fail" else (0, [])), res.stderr
