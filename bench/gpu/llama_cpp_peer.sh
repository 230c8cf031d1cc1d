#!/usr/bin/env bash
# llama.cpp measured as the peer on the engine's synthetic file (bench/RESULTS.md).
#   here:   bash bench/gpu/llama_cpp_peer.sh pack OUT.tgz
#           the llama-cpp-python sdist's llama.cpp (the parity extra's version), trimmed
#           to what a CUDA or ROCm build needs (~5 MB), for a device machine with no network
#   there:  bash bench/gpu/llama_cpp_peer.sh run SRC.tgz MODEL.gguf OUTDIR [cuda|hip] [ARCH]
#           builds llama-bench and llama-batched-bench (CUDA arch 90 by default; hip:
#           ARCH e.g. gfx1151), runs them and writes OUTDIR/peer.json (llama_cpp_peer.py);
#           WAIT_PID: a process writing MODEL meanwhile, awaited after the build;
#           PEER_BUILD: the build of `build SRC.tgz DIR` (DIR/done marks it finished)
#   there:  bash bench/gpu/llama_cpp_peer.sh build SRC.tgz DIR [cuda|hip] [ARCH]
#           the build alone (JOBS: its parallel jobs), to run beside other work
set -euo pipefail
VER=0.3.36
case "${1:-}" in
pack)
  out=$(realpath -m "$2"); tmp=$(mktemp -d)
  (cd "$tmp" && python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d . \
    && tar xzf "llama_cpp_python-$VER.tar.gz")
  src="$tmp/llama_cpp_python-$VER/vendor/llama.cpp"
  ex=(docs models media tests tools/ui tools/server examples benches gguf-py conversion)
  for b in vulkan sycl opencl hexagon et metal webgpu openvino cann virtgpu; do ex+=("ggml/src/ggml-$b"); done
  tar czf "$out" -C "$src" "${ex[@]/#/--exclude=./}" .
  rm -rf "$tmp"; ls -la "$out" ;;
build)  # SRC.tgz DIR [cuda|hip] [ARCH]: the two tools under DIR/b/bin (for PEER_BUILD)
  src=$2 build=$3 backend=${4:-cuda} arch=${5:-}
  mkdir -p "$build/src" && tar xzf "$src" -C "$build/src"
  flags=(-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
         -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release)
  if [ "$backend" = hip ]; then flags+=(-DGGML_HIP=ON -DAMDGPU_TARGETS="${arch:-gfx1151}")
  else flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}"); fi
  cmake -S "$build/src" -B "$build/b" -G Ninja "${flags[@]}"
  cmake --build "$build/b" -j"${JOBS:-$(nproc)}" --target llama-bench llama-batched-bench ;;
run)
  src=$2 model=$3 outdir=$4 backend=${5:-cuda} arch=${6:-}
  here=$(cd "$(dirname "$0")" && pwd); build=${PEER_BUILD:-$(mktemp -d)}
  mkdir -p "$outdir"
  # PEER_BUILD: a `build` made beforehand (or still under way: its bench awaited)
  while [ -n "${PEER_BUILD:-}" ] && [ ! -e "$build/done" ]; do sleep 2; done
  [ -x "$build/b/bin/llama-bench" ] || bash "$0" build "$src" "$build" "$backend" "$arch" \
    > "$outdir/build.log" 2>&1
  bin=$build/b/bin
  # WAIT_PID: a process still writing the model (built beside it); wait for it to end
  while [ "${WAIT_PID:-0}" != 0 ] && kill -0 "$WAIT_PID" 2>/dev/null; do sleep 2; done
  "$bin/llama-bench" -m "$model" -ngl 99 -p 512,4096 -n 128 -r 2 -o json > "$outdir/llama_bench.json"
  "$bin/llama-batched-bench" -m "$model" -ngl 99 -c 20480 -b 2048 -ub 512 -npp 128 -ntg 128 \
    -npl 1,16,64 2>&1 | grep -E '^\|' > "$outdir/llama_batched.txt"
  python3 "$here/llama_cpp_peer.py" --bench-json "$outdir/llama_bench.json" \
    --batched-txt "$outdir/llama_batched.txt" --out "$outdir/peer.json" ;;
*) sed -n 2,9p "$0"; exit 2 ;;
esac
