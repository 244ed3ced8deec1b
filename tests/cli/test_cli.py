"""The CLI shell: exit codes, one Error: line, --json objects, --help without torch, real subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.cli import cli
from ckptfix.safety.signing import Signed

ROOT = Path(__file__).resolve().parents[2]


def test_convert_text_and_json(cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "single.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(dst)])
    assert res.exit_code == 0, res.output
    assert "module. -> none (6 keys renamed)" in res.output
    dst = tmp_path / "compiled.weights"
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_ddp.pth"), str(dst), "--to", "compile",
                                  "--format", "pth", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["wrappers_before"] == ["module"] and report["wrappers_after"] == ["_orig_mod"]
    assert report["format_out"] == "torch-zip" and report["num_tensors"] == 6
    assert list(torch.load(dst, weights_only=True))[0] == "_orig_mod.0.weight"


def test_inspect_json_fields(cli_runner, fixtures_dir: Path, manifest: dict) -> None:
    res = cli_runner.invoke(cli, ["inspect", str(fixtures_dir / "mlp_model_parallel.pth"), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    for field in ("path", "format", "state_dict_key", "ema_keys", "wrappers", "inner_wrappers", "num_tensors",
                  "num_params", "nbytes", "dtypes", "devices", "non_tensor_keys", "extra", "has_metadata", "keys",
                  "num_keys", "notes"):
        assert field in info
    assert info["devices"] == manifest["mlp_model_parallel.pth"]["devices"]


def test_inspect_text(cli_runner, fixtures_dir: Path) -> None:
    res = cli_runner.invoke(cli, ["inspect", str(fixtures_dir / "mlp_train_ckpt.pth")])
    assert res.exit_code == 0
    assert "at 'model_state_dict'" in res.output and "optimizer_state_dict: dict" in res.output


def test_inspect_lists_every_key_with_all_and_in_json(cli_runner, tmp_path: Path) -> None:
    """Text shows the first and last five keys, ``--all`` every key; ``--json`` always lists every key."""
    sd = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(8)]).state_dict()
    torch.save(sd, tmp_path / "deep.pth")
    every = list(sd)
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "deep.pth")])
    assert res.exit_code == 0, res.output
    listed = [line.split()[0] for line in res.output.splitlines() if line.startswith("  ") and "[" in line]
    assert listed == every[:5] + every[-5:] and "  …" in res.output and "--all" in res.output
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "deep.pth"), "--all"])
    assert res.exit_code == 0, res.output
    listed = [line.split()[0] for line in res.output.splitlines() if line.startswith("  ") and "[" in line]
    assert listed == every and "  …" not in res.output
    res = cli_runner.invoke(cli, ["inspect", str(tmp_path / "deep.pth"), "--json"])
    info = json.loads(res.output)
    assert [row["key"] for row in info["keys"]] == every and info["num_keys"] == len(every) == 16
    assert info["keys"][3] == {"key": every[3], "shape": list(sd[every[3]].shape), "dtype": "float32"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "missing.pth"], "missing.pth: no such file"),
        (["convert", "{fx}/mlp_cuda1.pth", "{tmp}/o.pth", "--map-location", "cuda:0"], "device cuda:0 is not available"),
        (["convert", "{fx}/mlp_ddp.pth", "{fx}/mlp_ddp.pth", "--force"], "is the source file itself"),
        (["convert", "{fx}/mlp_ddp.pth", "{fx}/mlp_dp.pth"], "already exists; pass --force"),
        (["convert", "{fx}/mlp_train_ckpt.pth", "{tmp}/o.pth", "--select", "nope"], "no entry 'nope'"),
        (["convert", "{fx}/mlp_ddp.pth", "{tmp}/o.pth", "--map-location", "gpu"], "not a device"),
    ],
)
def test_errors_are_one_line_exit_1(args: list[str], message: str, cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = [a.format(fx=fixtures_dir, tmp=tmp_path) for a in args]
    res = cli_runner.invoke(cli, argv)
    assert res.exit_code == 1
    assert res.stderr.startswith("Error: ") and message in res.stderr and res.stderr.count("\n") == 1
    assert "Traceback" not in res.output
    assert not (tmp_path / "o.pth").exists()


def test_usage_error_exit_2(cli_runner) -> None:
    assert cli_runner.invoke(cli, ["convert", "only-one-arg"]).exit_code == 2
    assert cli_runner.invoke(cli, ["convert", "a", "b", "--to", "sideways"]).exit_code == 2


def test_help_and_version_do_not_import_torch() -> None:
    code = ("import sys; from ckptfix.cli import main; sys.argv=['ckptfix', '{arg}']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    for arg in ("--help", "--version"):
        out = subprocess.run([sys.executable, "-c", code.format(arg=arg)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_every_command_has_help_and_is_in_readme(cli_runner) -> None:
    readme = (ROOT / "README.md").read_text()
    for name, command in cli.commands.items():
        assert command.help, name
        assert cli_runner.invoke(cli, [name, "--help"]).exit_code == 0
        assert f"ckptfix {name}" in readme, f"README does not show `ckptfix {name}`"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, env=env)


def test_subprocess_convert_and_inspect(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "m.safetensors"
    out = _run("convert", str(fixtures_dir / "mlp_compile_ddp.pth"), str(dst))
    assert out.returncode == 0, out.stderr
    out = _run("inspect", str(dst), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["wrappers"] == []
    out = _run("inspect", str(tmp_path / "nope.pth"))
    assert out.returncode == 1 and out.stderr.startswith("Error: ") and "Traceback" not in out.stderr


def test_debug_env_shows_traceback(tmp_path: Path) -> None:
    env_out = subprocess.run([sys.executable, "-m", "ckptfix", "inspect", str(tmp_path / "nope.pth")],
                             capture_output=True, text=True, env={**os.environ, "CKPTFIX_DEBUG": "1", "PYTHONPATH": str(ROOT)})
    assert env_out.returncode == 1 and "Traceback" in env_out.stderr


def readme_json_docs(text: str) -> dict[str, str]:
    """docs/json.md split by command: each paragraph that starts with `command`:."""
    docs = {}
    for paragraph in text.split("\n\n"):
        if match := re.match(r"`(\w+)`: ", paragraph):
            docs[match.group(1)] = paragraph
    return docs


#: Records inside a --json object whose own fields the command's paragraph names too (as words).
NESTED = {"verify": ["forward", "forward.against"]}


def _records(obj: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """The dicts at ``path`` ("forward", "forward.against": each row of that list)."""
    found: list[Any] = [obj]
    for part in path.split("."):
        found = [v for o in found for v in (o[part] if isinstance(o[part], list) else [o[part]])]
    return found


def test_every_json_field_is_documented_in_readme(fixtures_dir: Path, tmp_path: Path) -> None:
    """docs/json.md documents each `--json` field in that command's own paragraph; a field added to a
    report without docs there fails here (one named elsewhere in the docs does not count)."""
    import ckptfix

    docs = readme_json_docs((ROOT / "docs" / "json.md").read_text())
    objects = {
        "inspect": ckptfix.inspect(fixtures_dir / "mlp_ddp.pth").to_dict(),
        "convert": ckptfix.convert(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth", checksums=True).to_dict(),
        "verify": ckptfix.verify(fixtures_dir / "mlp_ddp.pth", str(fixtures_dir / "train.py") + ":mlp",
                                 reference=fixtures_dir / "mlp_single.pth").to_dict(),
        "diff": ckptfix.diff(fixtures_dir / "mlp_ddp.pth", tmp_path / "o.pth").to_dict(),
        "scan": ckptfix.scan(fixtures_dir / "mlp_ddp.pth").to_dict(),
        # what `ckptfix sign --json` prints (signing itself: tests/safety/test_signing.py, with model-signing installed)
        "sign": Signed("o.pth", "o.pth.sig", {"method": "key", "curve": "P-256"}, {".": "0" * 64}).to_dict(),
    }
    with_json = {name for name, command in cli.commands.items() if any(o.name == "as_json" for o in command.params)}
    assert set(objects) == with_json and set(docs) == with_json, (sorted(docs), sorted(with_json))
    for command, obj in objects.items():
        undocumented = [k for k in obj if f"`{k}`" not in docs[command]]
        assert not undocumented, f"{command} --json fields missing from its docs/json.md paragraph: {undocumented}"
        for path in NESTED.get(command, []):
            records = _records(obj, path)
            assert records, path  # the sample object has such a record to check
            nested = sorted({k for r in records for k in r if not re.search(rf"\b{k}\b", docs[command])})
            assert not nested, f"{command} --json {path} fields missing from its docs/json.md paragraph: {nested}"


@pytest.mark.parametrize("args, code, error_type, message", [
    (["inspect", "{tmp}/nope.pth"], 1, "MissingFileError", "{tmp}/nope.pth: no such file"),
    (["convert", "{tmp}/nope.pth", "{tmp}/o.pth"], 1, "MissingFileError", "{tmp}/nope.pth: no such file"),
    (["convert", "{fx}/mlp_ddp.pth", "{fx}/mlp_dp.pth"], 1, "DestinationError", "already exists; pass --force"),
    (["verify", "{tmp}/nope.pth", "--model", "torch.nn:Linear"], 1, "MissingFileError", "no such file"),
    (["verify", "{fx}/mlp_single.pth", "--model", "torchvision:resnet19"], 1, "ModelSpecError", "no model 'resnet19'"),
    (["diff", "{fx}/mlp_single.pth", "{tmp}/nope.pth"], 1, "MissingFileError", "no such file"),
    (["scan", "{tmp}/empty.pth"], 1, "FormatError", "is empty (0 bytes)"),
    (["verify", "{fx}/mlp_single.pth", "--model", "{fx}/train.py:mlp", "--input-range", "9,1"], 1, "InputError",
     "input range '9,1': expected LOW,HIGH with LOW < HIGH"),
    (["diff", "{fx}/mlp_single.pth", "{fx}/mlp_ddp.pth", "--map-location", "meta"], 1, "DeviceError",
     "map_location='meta' reads none"),
    (["convert", "{fx}/mlp_ddp.pth", "{tmp}/o.pth", "--by-order"], 2, "UsageError", "--by-order and --model go together"),
    (["diff", "{fx}/mlp_single.pth", "{fx}/mlp_ddp.pth", "--atol", "lots"], 2, "BadParameter", "'lots' is not a valid float"),
])
def test_json_failures_print_one_object_on_stdout(args: list[str], code: int, error_type: str, message: str,
                                                  cli_runner, fixtures_dir: Path, tmp_path: Path) -> None:
    """A CI step parses stdout whatever happened: with --json a failure is one object too."""
    (tmp_path / "empty.pth").write_bytes(b"")
    argv = [a.format(fx=fixtures_dir, tmp=tmp_path) for a in [*args, "--json"]]
    res = cli_runner.invoke(cli, argv)
    assert res.exit_code == code, res.output
    obj = json.loads(res.stdout)
    assert set(obj) == {"error", "error_type", "exit_code"} and (obj["exit_code"], obj["error_type"]) == (code, error_type)
    assert message.format(tmp=tmp_path) in obj["error"] and "\n" not in obj["error"]
    assert f"Error: {obj['error']}" in res.stderr  # the line on stderr is still there
    without = cli_runner.invoke(cli, [a for a in argv if a != "--json"])
    assert without.exit_code == code and without.stdout == ""  # without --json: nothing on stdout


def test_json_failure_in_a_real_process(tmp_path: Path) -> None:
    out = _run("verify", str(tmp_path / "nope.pth"), "--model", "torch.nn:Linear", "--json")
    assert out.returncode == 1 and out.stderr == f"Error: {tmp_path / 'nope.pth'}: no such file\n"
    assert json.loads(out.stdout) == {"error": f"{tmp_path / 'nope.pth'}: no such file",
                                      "error_type": "MissingFileError", "exit_code": 1}


def test_errors_are_also_the_builtin_types(fixtures_dir: Path, tmp_path: Path) -> None:
    import errno

    import ckptfix
    from ckptfix.errors import DestinationError, FormatError, MissingFileError

    with pytest.raises(FileNotFoundError) as missing:
        ckptfix.read(tmp_path / "nope.pth")
    e = missing.value
    assert isinstance(e, MissingFileError) and isinstance(e, FormatError) and isinstance(e, ValueError)
    assert (e.errno, e.filename, str(e)) == (errno.ENOENT, str(tmp_path / "nope.pth"), f"{tmp_path / 'nope.pth'}: no such file")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="junk.pth") as malformed:
        ckptfix.read(tmp_path / "junk.pth")
    assert isinstance(malformed.value, FormatError) and not isinstance(malformed.value, OSError)
    with pytest.raises(OSError, match="already exists; pass --force") as dest:
        ckptfix.convert(fixtures_dir / "mlp_ddp.pth", fixtures_dir / "mlp_dp.pth")
    assert isinstance(dest.value, DestinationError) and "\n" not in str(dest.value)
    # one raised inside a write (the hashed name, known once written, exists) keeps its own message
    first = ckptfix.convert(fixtures_dir / "mlp_single.pth", tmp_path / "o.safetensors", hash=True).dst  # same bytes
    with pytest.raises(DestinationError) as hashed:
        ckptfix.convert(fixtures_dir / "mlp_single.pth", tmp_path / "o.safetensors", hash=True)
    assert str(hashed.value) == f"{first}: already exists; pass --force (library: force=True) to replace it"
