#!/usr/bin/env bash
# Device call 3 (carry .gpu/ray_site.tar.xz .gpu/whl_ray): Ray, then issue 16's figures on a GPU node.
# Arguments: rows, max_tokens, seconds for pipeline_throughput, seconds for scale_out, scale_out rows.
set -o pipefail
tar -xJf .gpu/ray_site.tar.xz -C /tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl_ray/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD SPECBATCH_CACHE=/root/sbcache PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
timeout "${3:-300}" python3 -m jobs.pipeline_throughput --rows "${1:-200}" --concurrency 1 --num_gpus 1 --no-ray-idle \
  --data /root/gpu/xsum_200.jsonl --sampling.max_tokens "${2:-96}" 2>&1 | tee "$OUT/pipeline.log" | grep -E "^\||Error"
timeout "${4:-200}" python3 -m jobs.scale_out --rows "${5:-48}" --data /root/gpu/xsum_200.jsonl 2>&1 \
  | tee "$OUT/scale_out.log" | grep -E "^\||Error"
