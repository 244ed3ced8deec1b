"""bench/remote.py runs end to end on a small file and produces every row, so it can't rot between the runs
that fill bench/RESULTS.md: the server's counts say the header rows fetched a part of the file and the
download rows all of it, ckptfix's convert from a URL all of it once, and ckptfix's load / load_into from a URL
all of it once but for the part of a header block that overlaps the data (at most a 16 KiB block per tensor);
every row ran (none skipped), and every row's peak RssAnon was sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TENSORS = 100  # bench/remote.py's files
BLOCK = 16 * 1024  # ckptfix.core.positional.BLOCK: the block a header read fetches
#: the load rows (per file: the plain loader of a download, the state dict's and the model's)
LOADS = {"safetensors": ("load_file", "load_model(model, …)"),
         "pth": ("torch.load(mmap=True)", "load_state_dict(torch.load(mmap=True))")}


@pytest.mark.slow
def test_bench_remote_produces_every_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "remote.py"), "--size-mib", "4", "--rounds", "1",
                          "--workdir", str(tmp_path / "work"), "--json", str(out)], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    names = {(row["name"], row["file"]) for row in rows}
    for kind, (read, into) in LOADS.items():
        for name in ("hf_hub_download (whole file)", "GET (whole file)", "ckptfix inspect http://", "ckptfix inspect hf://",
                     "ckptfix convert http:// → safetensors", "GET, then ckptfix convert → safetensors",
                     "ckptfix.load(http://) → state dict", f"GET, then {read} → state dict",
                     "ckptfix.load(hf://) → state dict", f"hf_hub_download, then {read} → state dict",
                     "ckptfix.load_into(model, http://), CPU-built", f"GET, then {into}, CPU-built"):
            assert (name, kind) in names
    assert ("huggingface_hub.get_safetensors_metadata", "safetensors") in names
    for row in rows:
        assert row["skipped"] is None, row  # inspect and convert of a URL both run (issue 19)
        assert len(row["walls"]) == 1 and row["walls"][0] > 0 and row["requests"][0] >= 1 and row["peaks"][0] > 0, row
        sent, size = row["sent"][0], row["size"]
        if row["name"] == "huggingface_hub.get_safetensors_metadata" or row["name"].startswith("ckptfix inspect"):
            assert 0 < sent < size, row  # the header, not the file
        else:
            assert sent >= size, row  # the whole file (hf_hub_download: plus nothing else, GET: exactly it)
        if row["name"].startswith("ckptfix convert"):
            assert sent == size, row  # each byte once: the header blocks inspect fetched are not fetched again
        if row["name"].startswith("ckptfix.load"):
            # the file once: every tensor's bytes fetched once, plus the headers' blocks (their overlap with the data
            # fetched again: at most one block per tensor and the header's own)
            assert size <= sent <= size + (TENSORS + 2) * BLOCK, row
    assert "| huggingface_hub.get_safetensors_metadata | safetensors |" in run.stdout
    assert "| ckptfix.load_into(model, http://), CPU-built | pth |" in run.stdout
