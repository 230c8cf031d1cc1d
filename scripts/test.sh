#!/usr/bin/env bash
# Sets up .venv with the test tools and runs the whole CPU test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -q -m "not gpu" "$@"
