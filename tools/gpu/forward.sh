#!/usr/bin/env bash
# The GPU forward check in one call (carry .gpu/whl): the wheels the machine lacks into /tmp/site, then
# tools/gpu/forward_check.py (the fused Triton layer against the reference, old against new: $OUT/forward_check.*),
# the engine's CUDA tests with the default execution (fused kernels, whole forwards captured at build), the kernel
# tests on the device, and compute-sanitizer's racecheck over a short speculative run. Arguments: seconds for the
# check's parts (no part starts after them), seconds for the tests.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECBATCH_CACHE=/root/sbcache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  git log -1 --format='%H %cs' 2>/dev/null; date -u; } 2>&1 | tee "$OUT/env.txt"
timeout "$((${1:-200} + 80))" python3 -m tools.gpu.forward_check --output "$OUT" --budget "${1:-200}" \
  > "$OUT/forward_check.log" 2>&1; tail -4 "$OUT/forward_check.log"; cat "$OUT/forward_check.md" | head -40
OMP_NUM_THREADS=2 timeout "${2:-100}" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --timeout 90 \
  -k "cuda or triton" tests/test_engine.py tests/test_triton_kernels.py tests/test_forward.py \
  > "$OUT/cuda_tests.log" 2>&1; grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests.log" | tail -15
timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 20 \
  python3 -m tools.gpu.forward_check --parts race --output "$OUT/race" > "$OUT/racecheck.log" 2>&1
echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|hazard|ERROR" "$OUT/racecheck.log" | head -8
