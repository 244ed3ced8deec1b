"""Benchmark: a remote checkpoint's header and contents (issue 19): bytes fetched and time of ``ckptfix inspect URL``
against ``huggingface_hub.get_safetensors_metadata`` and against downloading the file; ``ckptfix convert URL``
against download-then-convert.

Not a test. Writes a --size-mib checkpoint (2 GiB by default; 100 fp32 tensors) twice under --workdir, as
``model.safetensors`` (safetensors' ``save_file``) and ``model.pth`` (``torch.save``), and serves that folder on
127.0.0.1 with tests/hub_server.py's ``HubServer``: as the Hub repo ``org/name`` (``HF_ENDPOINT`` points there)
and as plain files (``http://127.0.0.1:PORT/model.pth``), both honouring Range. Rows, per file:

- ``get_safetensors_metadata``: ``huggingface_hub.get_safetensors_metadata("org/name")`` (safetensors only);
- ``hf_hub_download`` and ``GET``: the whole file, by huggingface_hub (into a fresh cache) and by requests
  (streamed to a file, 8 MiB chunks);
- ``ckptfix inspect http://…`` and ``ckptfix inspect hf://org/name/…``: the CLI, one process;
- ``ckptfix convert URL`` (to safetensors) against ``GET`` then ``ckptfix convert`` of the downloaded file;
- ``ckptfix.load(URL)`` (the state dict in memory; http:// and hf://) against ``GET`` (or ``hf_hub_download``)
  then the plain loader of the download: safetensors' ``load_file``, ``torch.load(mmap=True, weights_only=True)``;
- ``ckptfix.load_into(model, http://…)`` into a model built on the CPU (zeros written, before the timer) against
  ``GET`` then ``safetensors.torch.load_model`` / ``load_state_dict(torch.load(mmap=True, weights_only=True))``.
  The model: one module per key, ``layers.{i}.weight``, as the files hold. One child does both steps of a
  plain row, so its "call" is the download and the load together.

Method. Every row runs in child processes (the server's threads have this process to themselves); the files
are read once first, so the server reads them from the page cache (a warm run: the network path is what is
measured, not this disk). Bytes fetched: the body bytes the server sent for the row (its own count, every
path: API answers, redirects, the file), and the requests it answered. Time: wall seconds of the row's
processes (Python start and imports included); a child that calls a library prints ``call_s=`` for the call
alone (imports excluded: torch, safetensors.torch, requests and ckptfix's modules are imported first), shown
as "call"; after it, a load row checks one value of the last tensor. Peak RssAnon: the largest resident
anonymous memory of the row's processes, sampled every 5 ms from outside (bench/measure.py's ``rss_anon``),
the whole process (a load_into row's model included). Rounds alternate the order of the rows; medians. A ckptfix row
that fails with "no such file" or "needs a local copy" (a ckptfix without remote sources, or without them for
that verb: convert) is skipped with a note, so the script runs before and after they land.

    python bench/remote.py                            # 2 GiB, 3 rounds
    python bench/remote.py --size-mib 64 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository root: the servers of the tests (standard library only)
from tests.hub_server import REPO, HubServer  # noqa: E402

from measure import INTERVAL, read_through, rss_anon  # noqa: E402  (bench/measure.py)

PY = sys.executable
FILES = {"safetensors": "model.safetensors", "pth": "model.pth"}
TENSORS = 100
#: what a ckptfix says of a URL it can't read yet: no remote sources at all, or not for this verb (convert)
NOT_YET = ("no such file", "needs a local copy")


def per_tensor(size_mib: int) -> int:
    """Elements (fp32) of each of the files' tensors."""
    return size_mib * 2**20 // TENSORS // 4


def make_inputs(repo: Path, size_mib: int) -> None:
    """The two files, written by a child process (so this one never imports torch)."""
    code = f"""
import torch
from safetensors.torch import save_file
state = {{f"layers.{{i}}.weight": torch.empty({per_tensor(size_mib)}).fill_(i) for i in range({TENSORS})}}
save_file(state, {str(repo / FILES["safetensors"])!r}, metadata={{"format": "pt"}})
torch.save(state, {str(repo / FILES["pth"])!r})
"""
    subprocess.run([PY, "-c", code], check=True)


def timed_call(code: str) -> list[str]:
    """A child that runs ``code`` (setup; then CALL; then, optionally, CHECK) and prints the call's seconds as
    ``call_s=``: the check runs after the timer."""
    setup, _, rest = code.partition("\nCALL\n")
    call, _, check = rest.partition("\nCHECK\n")
    body = (f"{setup}\nimport time\n_t = time.perf_counter()\n{call}\n"
            f"print(f'call_s={{time.perf_counter() - _t}}')\n{check}\n")
    return [PY, "-c", body]


def download_code(url: str, dst: Path) -> str:
    return f"""import requests
CALL
with requests.get({url!r}, stream=True, timeout=60) as r, open({str(dst)!r}, "wb") as f:
    r.raise_for_status()
    for chunk in r.iter_content(8 << 20):
        f.write(chunk)"""


#: imported before the timer by every load row, the ckptfix ones and the plain ones alike
LOAD_SETUP = ("import requests, torch, safetensors.torch, huggingface_hub, ckptfix\n"
              "import ckptfix.ops.api, ckptfix.ops.load_into.loading, ckptfix.ops.remote_read, ckptfix.core.remote\n")
#: the plain loaders of a downloaded file (``{path}``): the state dict, and into ``model``
PLAIN_READ = {"safetensors": ("load_file", "sd = safetensors.torch.load_file({path!r})"),
              "pth": ("torch.load(mmap=True)", "sd = torch.load({path!r}, mmap=True, weights_only=True)")}
PLAIN_INTO = {"safetensors": ("load_model(model, …)", "safetensors.torch.load_model(model, {path!r})"),
              "pth": ("load_state_dict(torch.load(mmap=True))",
                      "model.load_state_dict(torch.load({path!r}, mmap=True, weights_only=True))")}
CHECK_SD = f"assert float(sd['layers.{TENSORS - 1}.weight'][-1]) == {TENSORS - 1}, 'wrong values'"
CHECK_MODEL = f"assert float(model.layers[{TENSORS - 1}].weight[-1]) == {TENSORS - 1}, 'wrong values'"


def model_code(size_mib: int) -> str:
    """A model with the files' keys (``layers.{i}.weight``, one module per key), built on the CPU: zeros
    written, so its pages are there before the timer."""
    return f"""from torch import nn
class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros({per_tensor(size_mib)}))
model = nn.Module()
model.layers = nn.ModuleList(One() for _ in range({TENSORS}))
"""


def load_rows(hub: HubServer, work: Path, kind: str, name: str, size_mib: int) -> list[Row]:
    """``ckptfix.load`` / ``load_into`` of a URL against a download, then the plain loader."""
    local, cache = work / "download" / name, work / "hf-cache"
    get = download_code(hub.url(name), local).split("\nCALL\n")[1]
    hf_get = f"path = huggingface_hub.hf_hub_download({REPO!r}, {name!r}, cache_dir={str(cache)!r})"
    read_name, read = PLAIN_READ[kind]
    into_name, into = PLAIN_INTO[kind]
    model = model_code(size_mib)

    def child(setup: str, call: str, check: str) -> list[list[str]]:
        return [timed_call(f"{LOAD_SETUP}{setup}CALL\n{call}\nCHECK\n{check}")]

    return [
        Row("ckptfix.load(http://) → state dict", kind, child("", f"sd = ckptfix.load({hub.url(name)!r})", CHECK_SD),
            ckptfix=True),
        Row(f"GET, then {read_name} → state dict", kind, child("", f"{get}\n{read.format(path=str(local))}", CHECK_SD)),
        Row("ckptfix.load(hf://) → state dict", kind, child("", f"sd = ckptfix.load('hf://{REPO}/{name}')", CHECK_SD),
            ckptfix=True),
        Row(f"hf_hub_download, then {read_name} → state dict", kind,
            child("", f"{hf_get}\n{read.replace('{path!r}', 'path')}", CHECK_SD)),
        Row("ckptfix.load_into(model, http://), CPU-built", kind,
            child(model, f"ckptfix.load_into(model, {hub.url(name)!r})", CHECK_MODEL), ckptfix=True),
        Row(f"GET, then {into_name}, CPU-built", kind,
            child(model, f"{get}\n{into.format(path=str(local))}", CHECK_MODEL)),
    ]


@dataclass
class Row:
    name: str
    file: str  # a key of FILES
    commands: list[list[str]]
    ckptfix: bool = False  # skipped with a note if ckptfix has no remote sources
    walls: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # peak RssAnon of the row's processes, bytes
    skipped: str | None = None


def rows(hub: HubServer, work: Path, size_mib: int) -> list[Row]:
    out, dl, cache = work / "out", work / "download", work / "hf-cache"
    ckptfix = [PY, "-m", "ckptfix"]
    table = [Row("huggingface_hub.get_safetensors_metadata", "safetensors",
                 [timed_call(f"import huggingface_hub\nCALL\nhuggingface_hub.get_safetensors_metadata({REPO!r})")])]
    for kind, name in FILES.items():
        local = dl / name
        table += [
            Row("hf_hub_download (whole file)", kind, [timed_call(
                f"import huggingface_hub\nCALL\nhuggingface_hub.hf_hub_download({REPO!r}, {name!r}, cache_dir={str(cache)!r})")]),
            Row("GET (whole file)", kind, [timed_call(download_code(hub.url(name), local))]),
            Row("ckptfix inspect http://", kind, [[*ckptfix, "inspect", hub.url(name)]], ckptfix=True),
            Row("ckptfix inspect hf://", kind, [[*ckptfix, "inspect", f"hf://{REPO}/{name}"]], ckptfix=True),
            Row("ckptfix convert http:// → safetensors", kind,
                [[*ckptfix, "convert", hub.url(name), str(out / "o.safetensors")]], ckptfix=True),
            Row("GET, then ckptfix convert → safetensors", kind,
                [timed_call(download_code(hub.url(name), local)), [*ckptfix, "convert", str(local), str(out / "o.safetensors")]]),
            *load_rows(hub, work, kind, name, size_mib),
        ]
    return table


def run_row(row: Row, hub: HubServer, work: Path, env: dict[str, str]) -> None:
    for folder in ("out", "download", "hf-cache"):
        shutil.rmtree(work / folder, ignore_errors=True)
        (work / folder).mkdir()
    subprocess.run(["sync"], check=True)
    hub.counts.reset()
    wall = call = 0.0
    peak = 0
    for cmd in row.commands:
        start = time.perf_counter()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files: a long output can't block
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
            while proc.poll() is None:
                peak = max(peak, rss_anon(proc.pid) or 0)
                time.sleep(INTERVAL)
            wall += time.perf_counter() - start
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        if proc.returncode != 0:
            if row.ckptfix and any(text in stderr for text in NOT_YET):
                row.skipped = stderr.strip()
                return
            raise SystemExit(f"{row.name} ({row.file}) failed: {' '.join(cmd)}\n{stderr[-2000:]}")
        printed = [line for line in stdout.splitlines() if line.startswith("call_s=")]
        call += float(printed[0].split("=")[1]) if printed else float("nan")
    row.walls.append(wall)
    row.calls.append(call)
    row.sent.append(hub.counts.total_bytes)
    row.requests.append(hub.counts.total_requests)
    row.peaks.append(peak)


def render(table: list[Row], sizes: dict[str, int], args: argparse.Namespace) -> str:
    lines = [f"`python bench/remote.py --size-mib {args.size_mib} --rounds {args.rounds}` on {os.uname().machine}, "
             f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; files: "
             + ", ".join(f"{FILES[k]} {sizes[k] / 2**20:.1f} MiB" for k in FILES) + " (127.0.0.1, page cache warm).", "",
             "| row | file | bytes fetched | % of file | requests | wall (s) | call (s) | peak RssAnon (MiB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        if row.skipped:
            lines.append(f"| {row.name} | {row.file} | skipped¹ | | | | | |")
            continue
        sent, call = max(row.sent), statistics.median(row.calls)
        lines.append(f"| {row.name} | {row.file} | {sent:,} | {100 * sent / sizes[row.file]:.3f} | {max(row.requests)} | "
                     f"{statistics.median(row.walls):.3f} | {'—' if call != call else f'{call:.3f}'} | "
                     f"{statistics.median(row.peaks) / 2**20:,.0f} |")
    skipped = [row for row in table if row.skipped]
    if skipped:
        lines += ["", f"¹ this ckptfix can't do this from a URL yet (`{skipped[0].skipped}`): run again once it can."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, deleted after")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptfix-remote-")) if args.workdir is None else args.workdir
    repo = work / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    try:
        make_inputs(repo, args.size_mib)
        sizes = {kind: (repo / name).stat().st_size for kind, name in FILES.items()}
        for name in FILES.values():
            read_through(repo / name)
        with HubServer(repo) as hub:
            env = {**os.environ, "HF_ENDPOINT": hub.base_url, "HF_HUB_DISABLE_TELEMETRY": "1",
                   "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            table = rows(hub, work, args.size_mib)
            for r in range(args.rounds):
                for row in table if r % 2 == 0 else table[::-1]:
                    if row.skipped is None:
                        run_row(row, hub, work, env)
        print(render(table, sizes, args))
        if args.json is not None:
            args.json.write_text(json.dumps([{k: v for k, v in vars(row).items() if k != "commands"} | {"size": sizes[row.file]}
                                             for row in table], indent=1))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
