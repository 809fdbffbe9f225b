#!/usr/bin/env bash
# Device call 1 (carry .gpu/whl .gpu/model.00): wheels installed, first model part kept, the engine's CUDA tests.
set -o pipefail
mkdir -p /root/gpu && cp .gpu/model.00 /root/gpu/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|Flags"
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
OMP_NUM_THREADS=2 timeout "${1:-170}" python3 -m pytest -q -p no:cacheprovider -n 8 -k cuda tests/test_engine.py -rfE \
  2>&1 | tee "$OUT/cuda_tests.log" | tail -40
