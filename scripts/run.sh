#!/usr/bin/env bash
# Sets up .venv and generates text with the embedded default model (Gemma 3 270M Q4_K_M).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mbufo generate default --prompt "${1:-The three primary colors are}" --max-tokens 48
