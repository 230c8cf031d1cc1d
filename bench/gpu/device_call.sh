#!/usr/bin/env bash
# One call on a lent GPU machine: the offline kit set up, then the named plans in order.
#   here:   bash bench/gpu/offline_kit.sh .devdata --peer   (once; carry .devdata along)
#   there:  MBUFO_COMMIT=<sha> bash bench/gpu/device_call.sh PLAN [PLAN ...]
# Each plan writes under $OUT/PLAN (OUT: default ./out) and its log to $OUT/PLAN.log; a
# failed plan does not stop the next (the exit status is the count of failed plans).
#   tests   every gpu-marked test (FILES: other test paths; T: pytest's timeout, 900 s)
#   engine  engine_bench at 1/16/64 streams, pp512 and pp4096, then llama.cpp on the same
#           file (bench/gpu/llama_cpp_peer.sh run; needs the kit's llama-src.tgz)
#   long    one stream at long prompts (PROMPTS, default "16384 32768"), f16 KV
#   attn    the attention alone: one decode row at 16K and 32K keys in 256-1024-key
#           splits; a 128-token chunk (8 query blocks of 16 tokens x 4 heads) at 32K and
#           128K keys with its items whole (fill 0) and cut as the engine cuts them on the
#           H200 (fill 33); ATTN_BUDGET: seconds a bench (150)
#   fair    `mbufo bench fairness`: STREAMS (16) streams, a LONG-token (32768) prompt
#           injected, q8 weights; with long chunks' items whole (MBUFO_PREFILL_CUT=0), then cut;
#           FAIR_ARGS: more flags (e.g. a fixed --itl-target-ms and --stream-tokens, so
#           that both runs ask the same)
#   capture the fairness run (cut, FAIR_ARGS) once for each AT[:WHEN] in CAPTURES (default
#           "2 2:step off"): mixed steps' graphs due at a key's AT-th sighting (or `off`:
#           none), captured when the engine is idle (WHEN idle, the default), in the step
#           (step), or idle unless the key keeps coming (busy: in its step 8 sightings later)
#   busy    `mbufo bench clients` on a box that is never idle: 16 heavy streams of 1024
#           tokens, 8 light clients arriving 0.3 s apart, q8; once for each AT[:WHEN] in
#           CAPTURES (light TTFT against solo: what eager mixed steps cost under load)
#   moe     engine_bench on the synthetic Qwen3-30B-A3B Q4_K_M (MoE: 128 experts, 8 a
#           token) at 1/16/64 streams and pp512, q8 + graphs
#   moe_peer llama.cpp on that file (written here too: a fresh machine has none), its
#           build beside the file's writing
#   moe_both moe with llama.cpp built beside it (nice 19, 12 jobs), then llama.cpp on
#           the file moe wrote
#   oss     engine_bench on the synthetic gpt-oss-20b (MXFP4 experts, BF16 elsewhere) at
#           1/16/64 streams and pp512 with the one-stream timeline, then llama.cpp on it
#   kvq     engine_bench at 1 and 16 streams and pp512, q8 + graphs, once for each KV format in
#           KVQ (default "f16 k8v4"), each with the one-stream step's kernel timeline
#   floats  qmatmul_bench on BF16 weights (the kernels F16/BF16/F32 matrices run) beside
#           torch's bf16 matmul, at gpt-oss-20b's attention and head shapes and Llama's 4096^2
#   moe_ab  moe at 1 and 16 streams and pp512 once for each ROUTE:ACT in MOE_AB (default
#           "0:0 1:0 1:1": MBUFO_MOE_FUSED_ROUTE and MBUFO_MOE_FUSED_ACT, the MoE block's
#           routing and activation launched separately (0) or fused (1)), each with the
#           one-stream step's kernel timeline (--graph-profile 1)
# DIR (default .devdata) is the kit; DRY=1 prints the commands instead of running them.
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=${DIR:-.devdata}
OUT=${OUT:-$PWD/out}
SYN="--synthetic llama-3.1-8b:Q4_K_M --variants q8+graphs --consumers asyncio"
VOCAB=$DIR/cache/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf
QWEN_VOCAB=${VOCAB%/*}/ggml-vocab-qwen2.gguf
MOE=qwen3-30b-a3b:Q4_K_M
OSS=gpt-oss-20b:MXFP4
GPU_TESTS="tests/kernels tests/engine/test_gpu_parity.py tests/engine/test_tile_tune.py
  tests/engine/test_sampler.py tests/engine/test_gpu_paths.py"

run() {  # NAME COMMAND...: the command's output to $OUT/NAME.log
  local name=$1; shift
  if [ -n "${DRY:-}" ]; then echo "$name: $*"; return 0; fi
  echo "== $name: $*"
  local start=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s"; tail -n 25 "$OUT/$name.log"
  return $rc
}

fairness() {  # NAME VAR=VALUE...: one `mbufo bench fairness` run in that environment
  local name=$1; shift
  # shellcheck disable=SC2086
  run "$name" env "$@" python3 -m appliance.cli.main bench fairness --synthetic \
    llama-3.1-8b:Q4_K_M --vocab "$VOCAB" --streams "${STREAMS:-16}" \
    --long-tokens "${LONG:-32768}" --weights q8 --json ${FAIR_ARGS:-}
}

plan() {
  case $1 in
  tests)
    # shellcheck disable=SC2086
    run tests timeout "${T:-900}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      ${FILES:-$GPU_TESTS} ;;
  engine)
    run engine python3 bench/gpu/engine_bench.py $SYN --vocab "$VOCAB" --concurrency 1,16,64 \
      --tokens 64 --prefill 512,4096 --forward-context 96 --out "$OUT/engine" &&
    run peer bash bench/gpu/llama_cpp_peer.sh run "$DIR/llama-src.tgz" \
      /tmp/llama-3.1-8b_Q4_K_M.gguf "$OUT/peer" ;;
  long)
    local failed=0 n
    for n in ${PROMPTS:-16384 32768}; do
      run "long$n" python3 bench/gpu/engine_bench.py $SYN --vocab "$VOCAB" --concurrency 1 \
        --tokens 64 --prompt "$n" --prefill 512 --forward-context 96 --no-profile \
        --out "$OUT/long$n" || failed=1
    done
    return $failed ;;
  attn)
    local budget=${ATTN_BUDGET:-150}
    run attn_decode python3 bench/gpu/attn_bench.py --rows 1 --contexts 16384,32768 \
      --kv f16,q8 --configs 16x128x256,16x128x512,16x128x1024 --budget-s "$budget" \
      --out "$OUT/attn_decode" &&
    run attn_chunk python3 bench/gpu/attn_bench.py --rows 1 --chunk 128 \
      --contexts 32768,131072 --kv f16,q8 --configs 64x64x256 --fill 0,33 --budget-s "$budget" \
      --out "$OUT/attn_chunk" ;;
  fair)
    local failed=0 cut
    for cut in 0 1; do
      fairness "fair_cut$cut" MBUFO_PREFILL_CUT=$cut || failed=1
    done
    return $failed ;;
  capture|busy)
    local failed=0 item at when
    for item in ${CAPTURES:-2 2:step off}; do
      at=${item%%:*}; when=idle; [ "$item" = "$at" ] || when=${item#*:}
      if [ "$1" = capture ]; then
        fairness "capture_${at}_$when" MBUFO_MIXED_CAPTURE_AT="$at" \
          MBUFO_MIXED_CAPTURE_WHEN="$when" || failed=1
      else
        run "busy_${at}_$when" env MBUFO_MIXED_CAPTURE_AT="$at" \
          MBUFO_MIXED_CAPTURE_WHEN="$when" python3 -m appliance.cli.main bench clients \
          --synthetic llama-3.1-8b:Q4_K_M --vocab "$VOCAB" --weights q8 --sessions 24 \
          --heavy-requests 16 --heavy-tokens 1024 --light-clients 8 --light-gap-s 0.3 \
          --json || failed=1
      fi
    done
    return $failed ;;
  moe)
    run moe python3 bench/gpu/engine_bench.py --synthetic "$MOE" --variants q8+graphs \
      --consumers asyncio --vocab "$QWEN_VOCAB" --concurrency 1,16,64 --tokens 64 \
      --prefill 512 --forward-context 96 --no-profile --out "$OUT/moe" ;;
  moe_ab)
    local failed=0 item route act
    for item in ${MOE_AB:-0:0 1:0 1:1}; do  # ROUTE:ACT, each fused (1) or separate (0)
      route=${item%%:*}; act=${item#*:}
      run "moe_route${route}_act$act" env MBUFO_MOE_FUSED_ROUTE="$route" \
        MBUFO_MOE_FUSED_ACT="$act" python3 bench/gpu/engine_bench.py --synthetic "$MOE" \
        --variants q8+graphs --consumers asyncio --vocab "$QWEN_VOCAB" --concurrency 1,16 \
        --tokens 64 --prefill 512 --forward-context 96 --no-profile --graph-profile 1 \
        --out "$OUT/moe_route${route}_act$act" || failed=1
    done
    return $failed ;;
  oss)
    run oss python3 bench/gpu/engine_bench.py --synthetic "$OSS" --variants auto+graphs \
      --consumers asyncio --vocab "$QWEN_VOCAB" --concurrency 1,16,64 --tokens 64 \
      --prefill 512 --forward-context 96 --no-profile --graph-profile 1 --out "$OUT/oss" &&
    run oss_peer bash bench/gpu/llama_cpp_peer.sh run "$DIR/llama-src.tgz" \
      /tmp/gpt-oss-20b_MXFP4.gguf "$OUT/oss_peer" ;;
  kvq)
    local failed=0 q
    for q in ${KVQ:-f16 k8v4}; do
      run "kv_$q" python3 bench/gpu/engine_bench.py $SYN --vocab "$VOCAB" --concurrency 1,16 \
        --tokens 64 --prefill 512 --forward-context 96 --no-profile --graph-profile 1 \
        --kv-quant "$q" --out "$OUT/kv_$q" || failed=1
    done
    return $failed ;;
  floats)
    run floats python3 bench/gpu/qmatmul_bench.py --types BF16 --budget-s 240 \
      --shapes 5120:2880,2880:4096,201088:2880,4096:4096 --out "$OUT/floats" ;;
  moe_peer)
    local writer=0
    if [ -z "${DRY:-}" ]; then
      python3 -c "import sys; from engine.synthetic import ensure_synthetic as e
print(e(sys.argv[1], sys.argv[2], '/tmp'))" "$MOE" "$QWEN_VOCAB" > "$OUT/moe_file.log" 2>&1 &
      writer=$!
    fi
    run moe_peer env WAIT_PID=$writer bash bench/gpu/llama_cpp_peer.sh run "$DIR/llama-src.tgz" \
      /tmp/qwen3-30b-a3b_Q4_K_M.gguf "$OUT/moe_peer" ;;
  moe_both)
    local build=/tmp/peer_build rc=0
    if [ -z "${DRY:-}" ]; then
      (JOBS=12 nice -n 19 bash bench/gpu/llama_cpp_peer.sh build "$DIR/llama-src.tgz" \
        "$build" > "$OUT/peer_build.log" 2>&1; touch "$build/done") &
    fi
    plan moe || rc=1
    PEER_BUILD="$build" plan moe_peer || rc=1  # its writer finds moe's file written
    return $rc ;;
  *) echo "unknown plan $1 (tests, engine, long, attn, fair, capture, busy, moe, moe_peer," \
       "moe_both, moe_ab, oss, kvq, floats)" >&2
     return 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^# DIR/p' "$0"; exit 2; }
if [ -z "${DRY:-}" ]; then
  [ -n "${MBUFO_COMMIT:-}" ] || { echo "MBUFO_COMMIT is not set" >&2; exit 2; }
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$DIR"/wheels/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD MBUFO_TEST_CACHE=$PWD/$DIR/cache PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
fi
failed=0
for p in "$@"; do plan "$p" || failed=$((failed + 1)); done
exit $failed
