#!/usr/bin/env bash
# GPU call 1 (carry .gpu/whl .gpu/model.00): the wheels the machine lacks into /tmp/site and the first model part in
# /root/gpu (both outlive the call while the machine stays warm); the engine's tests on CUDA; then the check's
# Llama-3-8B-shaped step costs, which need no model file. Arguments: seconds for the tests, seconds for the costs.
set -o pipefail
mkdir -p /root/gpu "$OUT/shape" && cp .gpu/model.00 /root/gpu/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECBATCH_CACHE=/root/sbcache
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|Flags"
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
# Arguments of 0 skip the tests and the costs (a second visit: the wheels and the model part only).
[ "${1:-150}" = 0 ] || {
# The engine's CUDA cases eagerly (SPECBATCH_CUDA_GRAPHS=off), each test's outcome in the log as it happens; then one
# greedy case per drafter with every forward graphed, CUDA_LAUNCH_BLOCKING=1 so that a failure's stack is where it
# happened.
OMP_NUM_THREADS=2 SPECBATCH_CUDA_GRAPHS=off timeout "${1:-150}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE \
  --timeout 60 -k "cuda or padded" tests/test_engine.py tests/test_forward.py > "$OUT/cuda_tests_eager.log" 2>&1
grep -cE "PASSED" "$OUT/cuda_tests_eager.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests_eager.log" | tail -12
OMP_NUM_THREADS=2 SPECBATCH_CUDA_GRAPHS=auto CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 -m pytest -q -p no:cacheprovider -x --tb=long \
  -k "cuda-ngram-1-target-heuristic-3 or cuda-draft_model-2-draft-static-3" tests/test_engine.py \
  > "$OUT/cuda_graph_case.log" 2>&1; grep -E "^E |py:[0-9]+|passed|failed" "$OUT/cuda_graph_case.log" | tail -12
}
[ "${2:-120}" = 0 ] && exit 0
timeout "$((${2:-120} + 60))" python3 -m tools.gpu.check --skip smollm2 --vocab 49152 --output "$OUT/shape" \
  --budget "${2:-120}" > "$OUT/shape/check.log" 2>&1; tail -12 "$OUT/shape/check.log"
