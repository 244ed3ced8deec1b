#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (the `device` tool's `run`, a few minutes): the gpu-marked
# tests and bench/load_gpu.py (issue 29 item 3: the loads against the roofline measured in the same run).
#
#     run(command="bash tools/gpu_check.sh", timeout_s=420)
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
(nvidia-smi || true) > "$OUT/nvidia-smi.txt" 2>&1
$PY -c 'import torch, sys; print(torch.__version__, torch.cuda.is_available(), sys.version)' > "$OUT/versions.txt" 2>&1
$PY setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || echo "the kernels did not build (numpy checks)" >> "$OUT/build.txt"
timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/core/test_fill_staged.py tests/ops/test_load_into_engine.py tests/ops/test_load_into.py \
    tests/core/test_devices.py tests/model/test_verify.py > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests: rc=$?" | tee -a "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"
timeout 200 $PY bench/load_gpu.py --size-mib 1024 --runs 5 --json "$OUT/load_gpu.json" > "$OUT/load_gpu.txt" 2>&1
echo "bench: rc=$?"
cat "$OUT/load_gpu.txt"
