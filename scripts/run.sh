#!/usr/bin/env bash
# Sets up .venv, shows the embedded default model (Gemma 3 270M Q4_K_M) generating text,
# then serves it: OpenAI-compatible API, admin API and metrics on http://127.0.0.1:8080.
# The first start prints the admin API key once. Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mbufo generate default --prompt "${MBUFO_DEMO_PROMPT:-The three primary colors are}" \
  --max-tokens 24
exec .venv/bin/mbufo serve "$@"
