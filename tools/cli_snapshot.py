"""The CLI's visible output, recorded and compared: every ckptfix command over every fixture, local and remote, as
(exit code, stdout, stderr, what it wrote), so a refactor proves its text and ``--json`` byte-identical (issue 25).

    PYTHONPATH=$PWD .venv/bin/python tools/cli_snapshot.py compare 19b69fe   # that revision vs this tree; exit 1 on a difference
    PYTHONPATH=$PWD .venv/bin/python tools/cli_snapshot.py record OUT.json   # this tree's snapshot only

``record`` runs in one process: click's CliRunner against ``ckptfix.cli.cli`` over ``fixtures/``, a few files made
here by torch and safetensors (fixed seeds), broken inputs (missing, JSON, HTML, a git-LFS pointer, a tar …), and the
same checkpoints served over http://, hf:// and s3:// by tests/file_server.py, tests/hub_server.py and moto's
ThreadedMotoServer on 127.0.0.1. Only what varies run to run is masked (:func:`mask`: the temp dir, the servers'
ports, ``seconds``, ``peak_rss``, the hash of a torch zip's random serialization_id); a written file is recorded by
its SHA-256 (a torch zip's with its serialization_id zeroed, and its archive listing). ``compare REV`` checks REV
out in a temp worktree and records both trees with this script, each importing its own ``ckptfix``. It takes a few
minutes, so no test of the suite runs it (tests/test_cli_snapshot.py checks :func:`mask`).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
SERVER_MODULES = ROOT / "tests"  # file_server.py, hub_server.py: standard library only
BUCKET, REPO = "ckpt", "org/name"
SID = ".data/serialization_id"
ZIP_SHA = "<sha256 of a torch zip: random serialization_id>"
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # DCP's save_id
_TEMP_SUFFIX = re.compile(rb"(ckptfix-tmp-)[a-z0-9_]{8}")  # tempfile's random part of the folder DCP saved into

#: numbers that differ between two runs of the same code, by the JSON key that holds them
_VARYING = ((re.compile(r'("seconds": )-?\d+(?:\.\d+)?(?:[eE]-?\d+)?'), r"\1<SECONDS>"),
            (re.compile(r'("peak_rss": )\d+'), r"\1<PEAK_RSS>"),
            (re.compile(r"^(ckptfix \w+: [\w -]+ \()\d+\.\d s\)$", re.M), r"\1<SECONDS> s)"))  # a phase's line


def mask(text: str, literals: Mapping[str, str] | None = None) -> str:
    """``text`` with each literal (the temp dir, a server's address) replaced by its placeholder, longest first,
    and the numbers that vary run to run (``"seconds"``, ``"peak_rss"``, a phase line's seconds) by names; everything
    else as it was."""
    for literal, placeholder in sorted((literals or {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(literal, placeholder)
    for pattern, placeholder in _VARYING:
        text = pattern.sub(placeholder, text)
    return text


# -- torch zips: serialization_id ----------------------------------------------------------------------------

def fixed_serialization_id(data: bytes) -> bytes:
    """A torch zip's bytes with its ``.data/serialization_id`` (random where an older ckptfix's torch-free writer made it)
    made all zeros, its CRC-32 rewritten (local header or data descriptor, and central directory) so the file stays
    valid; other bytes unchanged."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next((i for i in z.infolist() if i.filename.endswith(SID)), None)
        start_dir = z.start_dir
    if info is None:
        return data
    out = bytearray(data)
    h = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", out, h + 26)
    begin = h + 30 + name_len + extra_len
    end = begin + info.compress_size
    out[begin:end] = b"0" * info.file_size
    crc = struct.pack("<I", zlib.crc32(bytes(out[begin:end])))
    if info.flag_bits & 0x08:  # a data descriptor after the data, with or without its signature
        at = end + (4 if data[end:end + 4] == b"PK\x07\x08" else 0)
        out[at:at + 4] = crc
    else:
        out[h + 14:h + 18] = crc
    at = start_dir
    while out[at:at + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<HHH", out, at + 28)
        if out[at + 46:at + 46 + n].decode() == info.filename:
            out[at + 16:at + 20] = crc
        at += 46 + n + e + c
    return bytes(out)


def fingerprint(path: Path, literals: Mapping[str, str]) -> dict[str, Any]:
    """What a written file holds: size and SHA-256; a zip's listing too, and its SHA-256 taken with the
    serialization_id zeroed (ckptfix's torch-free zip writer draws it at random). A DCP ``.metadata`` records its folder
    and a random ``save_id``: its SHA-256 is taken with the folder masked (a path pickles as its parts: the temp dir's name,
    the random suffix of the temp folder it was written in) and the id zeroed."""
    data = path.read_bytes()
    if path.name == ".metadata":
        for literal, placeholder in literals.items():
            data = data.replace(literal.encode(), placeholder.encode())
        data = _TEMP_SUFFIX.sub(rb"\1<random>", _UUID.sub(b"0" * 36, data))
        return {"sha256 (folder masked, save_id zeroed)": hashlib.sha256(data).hexdigest()}
    if not data.startswith(b"PK") or not zipfile.is_zipfile(path):
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with zipfile.ZipFile(path) as z:
        listing = [f"{i.filename} {i.file_size} {'<random>' if i.filename.endswith(SID) else f'{i.CRC:08x}'}"
                   for i in z.infolist()]
    fixed = fixed_serialization_id(data)
    return {"size": len(data), "zip": listing, "sha256 (serialization_id zeroed)": hashlib.sha256(fixed).hexdigest()}


def _outputs(folder: Path, literals: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every file under ``folder`` by relative path → its fingerprint; and the real SHA-256 of each torch zip
    among them → a placeholder (convert --json prints it; it changes with the serialization_id)."""
    prints, hashes = {}, {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            prints[p.relative_to(folder).as_posix()] = fp = fingerprint(p, literals)
            if "zip" in fp:
                hashes[hashlib.sha256(p.read_bytes()).hexdigest()] = ZIP_SHA
    return prints, hashes


# -- the corpus -----------------------------------------------------------------------------------------------

class _Payload:
    """Pickles as ``posix.system('echo pwned')``: scan must name it; nothing here ever loads it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    torch.save(obj, path)
    path.write_bytes(fixed_serialization_id(path.read_bytes()))


def _hf_shards(sd: dict[str, Any], folder: Path, stem: str, ext: str, save: Any) -> None:
    """A Hugging Face sharded checkpoint: two shards and the index (weight_map, total_size)."""
    folder.mkdir()
    keys = list(sd)
    halves = [keys[:len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for n, part in enumerate(halves, 1):
        name = f"{stem}-{n:05d}-of-00002.{ext}"
        save({k: sd[k].clone() for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build_corpus(root: Path, fixtures: Path) -> Path:
    """``fixtures/`` copied to ``root/fixtures``, plus the made files and the broken inputs beside them."""
    import torch
    from safetensors.torch import save_file

    fx = root / "fixtures"
    shutil.copytree(fixtures, fx, ignore=shutil.ignore_patterns("__pycache__"))
    torch.manual_seed(0)
    sd = torch.load(fx / "mlp_single.pth", weights_only=True)
    _hf_shards(sd, fx / "sharded_safetensors", "model", "safetensors", lambda d, p: save_file(d, str(p)))
    _hf_shards(sd, fx / "hf_bin", "pytorch_model", "bin", _torch_save)
    nan = {k: v.clone() for k, v in sd.items()}
    nan["2.weight"][3, 5] = float("nan")
    save_file(nan, str(fx / "nan.safetensors"))
    _torch_save({"state_dict": sd, "hook": _Payload()}, fx / "evil.pth")
    (fx / "lfs.pth").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 6265\n")
    (fx / "page.html").write_text("<!DOCTYPE html>\n<html><body>Sign in to download</body></html>\n")
    (fx / "error.json").write_text('{"error": "Repository not found"}\n')
    (fx / "empty.pth").write_bytes(b"")
    with tarfile.open(fx / "archive.tar", "w", format=tarfile.USTAR_FORMAT) as tar:  # no owner, mtime 0: the same bytes
        member, data = tarfile.TarInfo("mlp_safetensors.safetensors"), (fx / "mlp_safetensors.safetensors").read_bytes()
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    for p in [root, *root.rglob("*")]:  # fixed mtimes: the servers' ETag and Last-Modified come from them
        os.utime(p, (1_600_000_000, 1_600_000_000))
    return fx


# -- the servers ----------------------------------------------------------------------------------------------

SERVED = ["mlp_ddp.pth", "mlp_safetensors.safetensors", "mlp_legacy.pth", "mlp_lightning.ckpt", "mlp_fsdp2",
          "sharded_safetensors", "hf_bin", "evil.pth", "nan.safetensors", "page.html"]


def _server_module(name: str) -> Any:
    """``tests/NAME.py`` loaded by its path, known as ``NAME`` and ``tests.NAME`` (hub_server imports file_server by
    one of the two), with no folder put on sys.path: the tree being recorded keeps its own ckptfix."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SERVER_MODULES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = sys.modules[f"tests.{name}"] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def servers(root: Path, fx: Path) -> Iterator[dict[str, tuple[Any, str]]]:
    """http, hub and s3 servers on 127.0.0.1 serving :data:`SERVED`, the environment pointing the clients at
    them; yields scheme → (a function name → URL, the server's ``127.0.0.1:PORT``)."""
    FileServer, HubServer = (getattr(_server_module(name), cls) for name, cls in (("file_server", "FileServer"),
                                                                                  ("hub_server", "HubServer")))
    served = root / "served"
    served.mkdir()
    for name in SERVED:
        (shutil.copytree if (fx / name).is_dir() else shutil.copy2)(fx / name, served / name)
    with FileServer(served) as http, HubServer(served, repo=REPO) as hub:
        os.environ.update({"HF_ENDPOINT": hub.base_url, "HF_HUB_CACHE": str(root / "hf-cache"), "HF_HUB_OFFLINE": "0",
                           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
                           "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
        os.environ.pop("HF_TOKEN", None)
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: no line per request on stderr

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        try:
            host, port = moto.get_host_and_port()
            _s3_environment(f"http://{host}:{port}")
            _upload(served)
            yield {"http": (http.url, http.base_url.removeprefix("http://")),
                   "hf": (lambda name: f"hf://{REPO}/{name}", hub.base_url.removeprefix("http://")),
                   "s3": (lambda name: f"s3://{BUCKET}/{name}", f"{host}:{port}")}
        finally:
            moto.stop()


def _s3_environment(endpoint: str) -> None:
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        os.environ.pop(key, None)
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull})


def _upload(served: Path) -> None:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for p in sorted(served.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), BUCKET, p.relative_to(served).as_posix())


# -- the invocations ------------------------------------------------------------------------------------------

MADE = ["sharded_safetensors", "hf_bin", "nan.safetensors", "evil.pth"]
BROKEN = ["missing.pth", "manifest.json", "error.json", "page.html", "lfs.pth", "archive.tar", "empty.pth", "train.py"]
DEEP = ["mlp_ddp.pth", "mlp_safetensors.safetensors", "mlp_lightning.ckpt", "mlp_fsdp2", "sharded_safetensors",
        "mlp_legacy.pth", "mlp_cuda1.pth", "hf_bin"]


def plan(fx: Path, fixtures: Path, remote: Mapping[str, tuple[Any, str]]) -> Iterator[tuple[list[str], bool]]:
    """Every invocation: (argv, whether it writes under its own output folder ``{out}``)."""
    model = ["--model", f"{fx}/train.py:mlp"]
    ref = str(fx / "mlp_single.pth")
    names = sorted(p.name for p in fixtures.iterdir() if p.suffix not in (".py", ".json") and p.name != "quant") + MADE
    yield from (([*command, "--help"], False) for command in ([], ["inspect"], ["scan"], ["verify"], ["diff"], ["convert"]))
    yield ["--version"], False
    yield ["nonsense"], False
    for name in names:
        yield from _local(str(fx / name), model, ref, deep=name in DEEP)
    yield from _options(fx, model, ref)
    for name in BROKEN:
        path = str(fx / name)
        for argv in (["inspect", path], ["inspect", "--json", path], ["scan", path], ["scan", "--json", path],
                     ["verify", "--json", path, *model], ["diff", path, ref]):
            yield argv, False
        yield ["convert", path, "{out}/o.safetensors"], True
        yield ["convert", "--json", path, "{out}/o.pth"], True
    for scheme, (url, _) in remote.items():
        for name in SERVED:
            yield from _remote(url(name), str(fx / name), model, deep=name in ("mlp_ddp.pth", "sharded_safetensors"))
        for argv in (["inspect", url("missing.pth")], ["scan", "--json", url("missing.pth")],
                     ["inspect", "--trust", url("mlp_ddp.pth")], ["verify", "--trust", url("mlp_ddp.pth"), *model]):
            yield argv, False
        for flags in (["--dtype", "bf16"], ["--dtype", "fp16", "--json"], ["--keep-extra"], ["--trust"]):
            yield ["convert", url("mlp_ddp.pth"), "{out}/o.safetensors", *flags], True
        yield ["convert", "--json", url("mlp_lightning.ckpt"), "{out}/o.pth"], True
        if scheme == "s3":
            yield ["convert", "--json", str(fx / "mlp_ddp.pth"), url("written/o.safetensors")], False
            yield ["inspect", "--json", url("written/o.safetensors")], False


def _local(path: str, model: list[str], ref: str, deep: bool) -> Iterator[tuple[list[str], bool]]:
    for argv in (["inspect", path], ["inspect", "--json", path], ["inspect", "--all", path], ["scan", path],
                 ["scan", "--json", path], ["verify", path, *model], ["verify", "--json", path, *model]):
        yield argv, False
    yield ["convert", path, "{out}/o.safetensors"], True
    yield ["convert", "--json", path, "{out}/o.pth"], True
    if not deep:
        return
    for argv in (["verify", "--exact", path, *model], ["verify", "--exact", "--json", path, *model],
                 ["verify", "--no-forward", path, *model], ["verify", "--no-forward", "--json", path, *model],
                 ["verify", "--json", path, *model, "--reference", ref], ["verify", path, *model, "--reference", path],
                 ["inspect", "--trust", "--json", path], ["diff", path, path], ["diff", path, ref],
                 ["diff", "--json", path, ref], ["diff", "--raw", "--json", path, ref]):
        yield argv, False
    for flags in (["--max-shard-size", "2KB", "--json"], ["--to", "ddp"], ["--to", "compile", "--json"],
                  ["--to", "keep", "--json"], ["--dtype", "fp16", "--json"], ["--trust", "--json"]):
        yield ["convert", path, "{out}/o" if flags[0] == "--max-shard-size" else "{out}/o.safetensors", *flags], True
    yield ["convert", "--json", path, "{out}/o.pth", "--to", "dp"], True


def _options(fx: Path, model: list[str], ref: str) -> Iterator[tuple[list[str], bool]]:
    """Flags beyond the common ones, and usage errors, on a few fixtures."""
    train, st = str(fx / "mlp_train_ckpt.pth"), str(fx / "mlp_safetensors.safetensors")
    for argv in (["inspect", "--select", "state_dict_ema", "--json", train], ["inspect", "--select", "nope", train],
                 ["verify", "--select", "state_dict_ema", "--json", train, *model], ["verify", ref],
                 ["verify", ref, *model, "--record-golden"], ["verify", ref, *model, "--serving-device", "cpu"],
                 ["verify", "--json", ref, *model, "--input-shape", "2,13", "--input-range", "0,1"],
                 ["verify", ref, *model, "--input-range", "9,1"], ["verify", ref, "--model", "torchvision:resnet19"],
                 ["verify", "--json", ref, *model, "--dtype", "bf16", "--atol", "0.5"],
                 ["diff", "--atol", "10", ref, str(fx / "mlp_ddp.pth")], ["diff", "--json", ref, str(fx / "nan.safetensors")]):
        yield argv, False
    for argv in (["convert", "--json", "--format", "dcp", ref, "{out}/dcp"], ["convert", "--hash", st, "{out}/o.safetensors"],
                 ["convert", "--json", "--strip-prefix", "0", "--add-prefix", "backbone", ref, "{out}/o.safetensors"],
                 ["convert", "--json", "--rename", r"(\d)\.weight=layer\1.w", ref, "{out}/o.safetensors"],
                 ["convert", "--json", "--keep-extra", train, "{out}/o.pth"],
                 ["convert", "--untie", "--json", ref, "{out}/o.safetensors"],
                 ["convert", "--json", "--by-order", *model, st, "{out}/o.safetensors"],
                 ["convert", "--by-order", ref, "{out}/o.pth"],
                 ["convert", "--to", "bogus", ref, "{out}/o.pth"], ["convert", ref, "{out}/o.txt"],
                 ["convert", "--json", "--dtype", "fp16", str(fx / "nan.safetensors"), "{out}/o.safetensors"],
                 ["convert", "--json", ref, str(fx / "mlp_ddp.pth")], ["convert", ref, "{out}"]):
        yield argv, True


def _remote(url: str, local: str, model: list[str], deep: bool) -> Iterator[tuple[list[str], bool]]:
    for argv in (["inspect", url], ["inspect", "--json", url], ["scan", url], ["scan", "--json", url],
                 ["verify", "--json", url, *model], ["diff", "--json", url, local]):
        yield argv, False
    yield ["convert", "--json", url, "{out}/o.safetensors"], True
    if deep:
        for argv in (["inspect", "--all", url], ["verify", url, *model], ["verify", "--exact", url, *model],
                     ["verify", "--no-forward", "--json", url, *model], ["diff", url, url]):
            yield argv, False
        yield ["convert", url, "{out}/o.pth"], True
        yield ["convert", "--json", "--max-shard-size", "2KB", url, "{out}/o"], True


# -- record ---------------------------------------------------------------------------------------------------

def _isolate(root: Path) -> None:
    """The process's environment made the same on every run: temp files under ``root``, no CKPTFIX_* setting,
    a fixed terminal width for click's help."""
    (root / "tmp").mkdir()
    os.environ["TMPDIR"] = tempfile.tempdir = str(root / "tmp")
    for key in [k for k in os.environ if k.startswith("CKPTFIX_")]:
        del os.environ[key]
    os.environ["COLUMNS"] = "100"
    os.chdir(root)


def _invoke(runner: Any, cli: Any, argv: list[str], out: Path | None, literals: dict[str, str]) -> dict[str, Any]:
    """One command run in this process, as a fresh process would see it (warnings shown once per command)."""
    import warnings

    if out is not None:
        out.mkdir(parents=True)
        argv = [a.replace("{out}", str(out)) for a in argv]
    with warnings.catch_warnings():
        res = runner.invoke(cli, argv, prog_name="ckptfix")
    literals = dict(literals)
    entry: dict[str, Any] = {"exit_code": res.exit_code}
    if out is not None:
        root = out.parents[1]  # {out} is root/out/N
        entry["written"], hashes = _outputs(out, {**literals, root.name: "<TMP>"})
        literals.update(hashes)
        shutil.rmtree(out)
    entry["stdout"], entry["stderr"] = mask(res.stdout, literals), mask(res.stderr, literals)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        entry["exception"] = mask(f"{type(res.exception).__name__}: {res.exception}", literals)
    return entry


def _fresh_remote_state(root: Path) -> None:
    """Each command starts with an empty Hub cache, as a fresh process on a fresh machine would."""
    shutil.rmtree(root / "hf-cache", ignore_errors=True)
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].HfFileSystem.clear_instance_cache()


def record(out_file: Path, fixtures: Path) -> int:
    start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="ckptfix-snapshot-")).resolve()
    try:
        _isolate(root)
        from click.testing import CliRunner

        import ckptfix
        from ckptfix.cli import cli

        fx = build_corpus(root, fixtures)
        invocations: dict[str, Any] = {}
        with servers(root, fx) as remote:
            literals = {str(root): "<TMP>"}
            for scheme, (_, address) in remote.items():
                host, port = address.rsplit(":", 1)
                literals[address] = f"{host}:<PORT:{scheme}>"
                literals[f"port={port}"] = f"port=<PORT:{scheme}>"
            runner = CliRunner()
            for n, (argv, writes) in enumerate(plan(fx, fixtures, remote)):
                key = mask(" ".join(argv), literals)
                assert key not in invocations, f"twice: {key}"
                _fresh_remote_state(root)
                invocations[key] = _invoke(runner, cli, argv, root / "out" / str(n) if writes else None, literals)
        meta = {"ckptfix": str(Path(ckptfix.__file__).resolve().parent)}  # which tree ran (compare checks it)
        out_file.write_text(json.dumps({"meta": meta, "invocations": invocations}, indent=1) + "\n")
        print(f"recorded {len(invocations)} of {meta['ckptfix']} in {time.monotonic() - start:.0f}s", file=sys.stderr)
        return 0
    finally:
        os.chdir("/")
        shutil.rmtree(root, ignore_errors=True)


# -- compare --------------------------------------------------------------------------------------------------

def _lines(entry: dict[str, Any] | None) -> list[str]:
    """An invocation's record as lines to diff (a text's last element '' when it ends with a newline)."""
    if entry is None:
        return ["(not run)"]
    lines = [f"exit {entry['exit_code']}"]
    if "exception" in entry:
        lines.append(f"exception {entry['exception']}")
    for stream in ("stdout", "stderr"):
        lines += [f"--- {stream}", *entry[stream].split("\n")]
    for name, print_ in entry.get("written", {}).items():
        lines.append(f"--- wrote {name}: {json.dumps(print_, sort_keys=True)}")
    return lines


def differences(base: dict[str, Any], head: dict[str, Any]) -> Iterator[str]:
    """A unified diff per invocation whose record differs, in the base's order (then the new ones)."""
    for key in [*base, *(k for k in head if k not in base)]:
        a, b = _lines(base.get(key)), _lines(head.get(key))
        if a != b:
            yield "\n".join(difflib.unified_diff(a, b, f"base: ckptfix {key}", f"this tree: ckptfix {key}", lineterm=""))


def _record_tree(tree: Path, out: Path, fixtures: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "record", str(out), "--fixtures", str(fixtures)],
                   env={**os.environ, "PYTHONPATH": str(tree)}, check=True, cwd=tree)
    got = json.loads(out.read_text())
    if Path(got["meta"]["ckptfix"]) != tree.resolve() / "ckptfix":
        raise SystemExit(f"{out}: recorded the ckptfix at {got['meta']['ckptfix']}, not {tree}'s")
    return dict(got["invocations"])


def compare(base_rev: str, keep: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="ckptfix-compare-")).resolve()
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(base_tree), base_rev], check=True)
    try:
        base = _record_tree(base_tree, work / "base.json", FIXTURES)
        head = _record_tree(ROOT, work / "head.json", FIXTURES)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    diffs = list(differences(base, head))
    for d in diffs:
        print(d)
    print(f"{len(set(base) | set(head))} invocations, {len(diffs)} differ ({base_rev} vs {ROOT})")
    if keep:
        print(f"records kept: {work / 'base.json'} {work / 'head.json'}")
    else:
        shutil.rmtree(work)
    return 1 if diffs else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record", help="record this process's ckptfix into OUT.json")
    rec.add_argument("out", type=Path)
    rec.add_argument("--fixtures", type=Path, default=FIXTURES)
    cmp_ = sub.add_parser("compare", help="BASE_REV's CLI against this tree's; exit 1 if any invocation differs")
    cmp_.add_argument("base_rev")
    cmp_.add_argument("--keep", action="store_true", help="keep the two JSON records (their folder is printed)")
    args = parser.parse_args(argv)
    if args.mode == "record":
        return record(args.out.resolve(), args.fixtures.resolve())
    return compare(args.base_rev, args.keep)


if __name__ == "__main__":
    sys.exit(main())
