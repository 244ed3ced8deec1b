#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (the `device` tool's `run`, a few minutes): the gpu-marked
# tests (the public corpora's files onto the GPU too: read_onto against torch.load, staged reads against
# safetensors.load_file) and bench/load_gpu.py (issue 29 item 3: the loads against the roofline measured in the same run).
#
#     run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=300)    (about 130 s there, wave 10)
#
# That machine's python3 holds torch, safetensors, click, numpy, pytest and hypothesis (.library/device/KINDS.md);
# ckptfix runs from this checkout (PYTHONPATH), its compiled kernels built in place first. Everything goes under
# $OUT (the tool brings it back): nvidia-smi, the tests' output, the bench's table and JSON. Runs here without a GPU
# too: the tests skip ("needs CUDA") and the bench says so.
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Wheels carried in .whl (zlib-ng, which that machine lacks: the digests' CRC-32 at full speed; without it, zlib's),
# fetched here first: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl zlib-ng==1.1.0
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
(nvidia-smi || true) > "$OUT/nvidia-smi.txt" 2>&1
$PY -c 'import torch, sys, os; print(torch.__version__, torch.cuda.is_available(), sys.version, os.cpu_count(),
    torch.get_num_threads())' > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
# (bytecode compiled first, as pip does on install: the fresh-process rows time ckptfix's imports, not their compiling)
$PY -m compileall -q ckptfix > /dev/null 2>&1
$PY setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || echo "the kernels did not build (numpy checks)" >> "$OUT/build.txt"
$PY -c 'from ckptfix.core import tensorcopy; print("kernels:", tensorcopy.native() is not None)' >> "$OUT/build.txt" 2>&1
tail -1 "$OUT/build.txt"
$PY -c 'import torch  # (a NaN cast on each device: its bits)
for s, w in [(torch.float32, torch.bfloat16), (torch.float16, torch.float64), (torch.float32, torch.float16)]:
    x = torch.tensor([float("nan"), -float("nan")], dtype=s)
    for d in ("cpu", "cuda"):
        print(s, "->", w, d, x.to(d).to(w).cpu().view(torch.uint8).tolist())' > "$OUT/nan-casts.txt" 2>&1
cat "$OUT/nan-casts.txt"
$PY -c 'import pytest_timeout' 2> /dev/null && PER_TEST="--timeout 60" || PER_TEST=""
timeout 200 $PY -m pytest -v -p no:cacheprovider -m gpu -rs $PER_TEST \
    tests/core/test_fill_staged.py tests/ops/test_load_into_engine.py tests/ops/test_load_into.py \
    tests/core/test_devices.py tests/model/test_verify.py \
    tests/parse/test_readers_agree.py tests/formats/test_public_safetensors_corpus.py > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests: rc=$?" | tee -a "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"
timeout 180 $PY bench/load_gpu.py --size-mib 1024 --runs 5 --sweep --busy --cold 3 --breakdown --json "$OUT/load_gpu.json" > "$OUT/load_gpu.txt" 2>&1
echo "bench: rc=$?"
cat "$OUT/load_gpu.txt"
