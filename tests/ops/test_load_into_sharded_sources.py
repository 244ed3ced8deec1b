"""DTensor-sharded models (FSDP2, placed by hand) from files whose tensors need more than their bytes read.

- ``check_digests=True``: each rank checks a share of the file's recorded digests (a tensor's digest covers all its
  bytes, which no one rank reads), every rank hears of a mismatch before anything is loaded, and a clean file loads
  as without the check. Files written by ``ckptfix convert`` (one safetensors file, HF shards, a DCP directory), and a
  copy of each with one byte of its largest tensor flipped.
- a conjugate and a negative view (``torch.save`` keeps the bits): each rank's shard holds the values torch's
  rebuild gives, not the stored bytes.
- a quantized tensor for a plain DTensor: refused on every rank before anything loads, naming it.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfix
from ckptfix.formats import resolve
from ckptfix.safety import digests
from tests import dist_harness, sharded_ranks

WORLDS = (2, 4)
FORMATS = ("safetensors", "hf-sharded", "dcp")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks forked from a forkserver")


def run_cases(rank: int, world: int, payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each rank runs (dist_harness's target)."""
    return sharded_ranks.run_cases(payload["cases"], world, {"ckptfix": ckptfix.load_into})


def _write(root: Path) -> dict[str, dict[str, Path]]:
    """format → the clean file and the damaged copy; ``bits`` → the views' file (ok) and its quantized twin."""
    plain = root / "mixed.pth"
    torch.save(sharded_ranks.full_state_dict("mixed"), plain)
    files: dict[str, dict[str, Path]] = {}
    for fmt, kwargs in {"safetensors": {}, "hf-sharded": {"max_shard_size": 64}, "dcp": {"format": "dcp"}}.items():
        clean = root / ("mixed.safetensors" if fmt == "safetensors" else f"mixed-{fmt}")
        ckptfix.convert(plain, clean, **kwargs)
        damaged = root / f"damaged-{clean.name}"
        (shutil.copytree if clean.is_dir() else shutil.copyfile)(clean, damaged)
        recorded = digests.read(str(damaged), resolve(str(damaged))[1]).digests
        assert recorded, f"{clean}: ckptfix recorded no digests"
        largest = max(recorded, key=lambda d: d.size)
        with open(largest.path, "r+b") as f:  # one byte of it flipped, the file's size and structure unchanged
            f.seek(largest.offset + largest.size // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x10]))
        files[fmt] = {"clean": clean, "damaged": damaged}
    full = sharded_ranks.full_state_dict("bits")
    stored = {"z": full["z"].conj().resolve_conj().conj(), "w": (-full["w"])._neg_view()}  # the bits: the values
    assert stored["z"].is_conj() and stored["w"].is_neg() and all(torch.equal(stored[k], full[k]) for k in full)
    torch.save(stored, root / "bits.pth")
    loaded = torch.load(root / "bits.pth", weights_only=True)  # what torch's rebuild gives: the values, bits applied
    assert loaded["z"].is_conj() and loaded["w"].is_neg() and all(torch.equal(loaded[k], full[k]) for k in full)
    with warnings.catch_warnings():  # (torch deprecates its legacy quantized tensors; files still hold them)
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_tensor(full["w"], 0.1, 0, torch.qint8)
    torch.save({**stored, "w": quantized}, root / "quantized.pth")
    files["bits"] = {"ok": root / "bits.pth", "quantized": root / "quantized.pth"}
    return files


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, list[dict[str, Any]]]]:
    """world → case id → each rank's outcome; the ranks run once per world size."""
    files = _write(tmp_path_factory.mktemp("digested"))
    runs: dict[int, Any] = {}

    def get(world: int) -> dict[str, list[dict[str, Any]]]:
        if world not in runs:
            cases = [{"id": f"{state}/{fmt}", "loader": "ckptfix", "model": "fsdp2", "path": str(paths[state]),
                      "expected": "mixed" if state == "clean" else None, "kwargs": {"check_digests": True}}
                     for fmt, paths in files.items() if fmt != "bits" for state in paths]
            cases += [{"id": f"bits/{state}", "loader": "ckptfix", "model": "dtensor-bits", "path": str(path),
                       "expected": "bits" if state == "ok" else None} for state, path in files["bits"].items()]
            try:
                per_rank = dist_harness.run(f"{__name__}:run_cases", world, tmp_path_factory.mktemp(f"w{world}"),
                                            {"cases": cases}, timeout=400)
                runs[world] = {cid: [r[cid] for r in per_rank] for cid in per_rank[0]}
            except dist_harness.RankFailure as e:
                runs[world] = e
        if isinstance(runs[world], dist_harness.RankFailure):
            pytest.fail(str(runs[world]), pytrace=False)
        return runs[world]  # type: ignore[no-any-return]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", WORLDS)
def test_a_clean_file_loads_with_its_digests_checked(outcomes: Callable[[int], Any], world: int, fmt: str) -> None:
    for rank, res in enumerate(outcomes(world)[f"clean/{fmt}"]):
        assert res["outcome"] == "ok", f"rank {rank}: {res.get('type', '')} {res['message']}\n{res['traceback']}"
        assert res["sharded"] and res["wrong"] == [], f"rank {rank}: {res['wrong']} {res['on_meta']}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", WORLDS)
def test_a_damaged_tensor_is_refused_on_every_rank_and_changes_nothing(outcomes: Callable[[int], Any], world: int,
                                                                       fmt: str) -> None:
    """One rank finds the flipped byte (the digest is in its share); every rank raises, naming the tensor's digest,
    and no rank's shards changed."""
    ranks = outcomes(world)[f"damaged/{fmt}"]
    for rank, res in enumerate(ranks):
        assert res["outcome"] == "raised", f"rank {rank} loaded it: {res.get('report')}"
        assert res["ckptfix_error"] and "does not match its recorded digest" in res["message"], (rank, res["message"])
        assert "nothing was loaded" in res["message"], res["message"]
        assert res["changed"] == [], f"rank {rank} left half-loaded: {res['changed']} changed"
    finders = [rank for rank, res in enumerate(ranks) if not res["message"].startswith("rank ")]
    assert len(finders) == 1, [r["message"][:80] for r in ranks]  # the digest was one rank's to check


@pytest.mark.parametrize("world", WORLDS)
def test_conjugate_and_negative_views_are_loaded_as_their_values(outcomes: Callable[[int], Any], world: int) -> None:
    """z (complex64, Shard(0)) stored as a conjugate view, w (float32, Shard(1): strided runs) as a negative one:
    each rank's shard is its slice of the values, bit for bit (read as bytes, the bits dropped, it was not)."""
    for rank, res in enumerate(outcomes(world)["bits/ok"]):
        assert res["outcome"] == "ok", f"rank {rank}: {res.get('type', '')} {res['message']}\n{res['traceback']}"
        assert res["sharded"] and res["wrong"] == [], f"rank {rank}: {res['wrong']} {res['on_meta']}"


@pytest.mark.parametrize("world", WORLDS)
def test_a_quantized_tensor_for_a_plain_dtensor_is_refused_on_every_rank(outcomes: Callable[[int], Any],
                                                                         world: int) -> None:
    ranks = outcomes(world)["bits/quantized"]
    for rank, res in enumerate(ranks):
        assert res["outcome"] == "raised" and res["load_error"], f"rank {rank}: {res.get('type')} {res['message']}"
        assert "w" in res["message"] and "quantized" in res["message"], res["message"]
        assert res["changed"] == [], f"rank {rank} left half-loaded: {res['changed']} changed"
