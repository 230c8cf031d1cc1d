#!/usr/bin/env bash
# Creates .venv and installs mbufo into it. `--test` adds the test tools and the parity
# reference (llama-cpp-python, built from its sdist: about 4 minutes on 2 cores).
# MBUFO_TORCH overrides the torch requirement (the appliance installer uses the ROCm build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || {
    echo "python3 -m venv failed: on Debian/Ubuntu run 'sudo apt-get install -y python3-venv'" >&2
    exit 1
  }
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "${MBUFO_TORCH:-torch==2.13.0}"
extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test,parity]"
  # llama-cpp-python builds for the building CPU (-march=native) by default; on a Xeon with
  # AMX and AVX-512 under a VM that build crashed in llama_decode (SIGSEGV), so on x86-64 the
  # reference is built for AVX2, unless CMAKE_ARGS says otherwise.
  if [ "$(uname -m)" = "x86_64" ] && [ -z "${CMAKE_ARGS:-}" ]; then
    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  fi
fi
pip install -e ".${extras}"
