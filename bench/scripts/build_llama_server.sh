#!/usr/bin/env bash
# Build llama.cpp's llama-server (parallel slots, continuous batching) from the
# llama-cpp-python sdist, for peer benchmarks on a machine where no binary is published:
#   bash bench/scripts/build_llama_server.sh [DIR]      # about 25 min on 2 cores
#   DIR/build/bin/llama-server -m MODEL.gguf -c 16384 -np 4 -t 1 -tb 1 --port 8099 &
#   mbufo bench fairness --url http://127.0.0.1:8099 --json
# The web UI is left out (no npm, no download): the server embeds an empty asset table.
set -euo pipefail
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/mbufo-llama-server}
VER=0.3.36  # the llama-cpp-python version of the parity extra
mkdir -p "$DIR"
cd "$DIR"
if [ ! -f "llama_cpp_python-$VER.tar.gz" ]; then
  python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VER" -d .
fi
[ -d "llama_cpp_python-$VER" ] || tar xzf "llama_cpp_python-$VER.tar.gz"
cmake -S "llama_cpp_python-$VER/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
cmake --build build --target llama-server -j"$(nproc)"
echo "$DIR/build/bin/llama-server"
