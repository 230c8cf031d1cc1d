#!/usr/bin/env bash
# Prepares what the GPU benchmarks need on a machine without package registries (a lent
# GPU box with Python 3.12, torch and triton but no gguf): the few wheels it lacks and the
# vocabulary files of the reference's sdist, under DIR (default .devdata):
#   DIR/wheels/*.whl                                   gguf, msgspec, llguidance (cp312, x86-64)
#   DIR/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-{llama-bpe,llama-spm,qwen2}.gguf
# On the GPU machine (the tree with DIR copied along):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/wheels/*.whl
#   export PYTHONPATH=/tmp/site:$PWD MBUFO_TEST_CACHE=$PWD/DIR/cache
#   python3 bench/gpu/engine_bench.py --vocab $MBUFO_TEST_CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf ...
# (tests/conftest.py finds the vocabulary files under MBUFO_TEST_CACHE.) About 17 MB.
# `offline_kit.sh DIR --peer` also packs llama.cpp's source as DIR/llama-src.tgz (~5 MB;
# bench/gpu/llama_cpp_peer.sh run builds and measures it there).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.devdata}
PY=${PYTHON:-python3}
VERSION=0.3.36  # tests/conftest.py's LLAMA_CPP_VERSION
mkdir -p "$DIR/wheels" "$DIR/cache"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR/wheels" \
  "gguf>=0.17,<0.20" "msgspec>=0.18" "llguidance>=0.7"
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  -d "$sdist" "llama-cpp-python==$VERSION"
"$PY" - "$sdist/llama_cpp_python-$VERSION.tar.gz" "$DIR/cache" <<'EOF'
import sys
import tarfile

with tarfile.open(sys.argv[1]) as tar:
    names = ("ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf", "ggml-vocab-qwen2.gguf")
    members = [m for m in tar.getmembers()
               if "/vendor/llama.cpp/models/" in m.name and m.name.endswith(names)]
    if len(members) != len(names):
        sys.exit(f"offline_kit: the sdist lacks {names}")
    tar.extractall(sys.argv[2], members=members, filter="data")
EOF
if [ "${2:-}" = "--peer" ]; then
  bash bench/gpu/llama_cpp_peer.sh pack "$DIR/llama-src.tgz"
fi
ls -1 "$DIR/wheels"
du -sh "$DIR"
