#!/usr/bin/env bash
# Sets up .venv with the test tools and runs the whole CPU test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check .
# two worker processes (MBUFO_TEST_WORKERS; 0: one process): on a 2-core machine the suite
# takes about 18 minutes instead of 31. A `-n` in "$@" comes later and wins.
exec .venv/bin/python -m pytest -q -m "not gpu" -n "${MBUFO_TEST_WORKERS:-2}" "$@"
