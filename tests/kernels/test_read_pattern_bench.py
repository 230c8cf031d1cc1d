"""bench/gpu/read_pattern_bench.py in the interpreter (a tiny shape, --smoke): every
pattern, the engine's one-row programs with their splits in one program among them, reads
each weight word exactly once (their xors against numpy's)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "read_pattern_bench.py"


def test_smoke_every_pattern_reads_every_word_once(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--warps", "2", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "read_pattern_bench.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["split"] == 2, rows  # 2 super-blocks a split
    row = rows[0]
    for pattern in ("rows_w2", "tiles_w2", "cta_rows_w2", "cta_steps_w2", "flat_2048x8",
                    "flat_1024x4"):
        assert row[pattern]["us"] > 0, (pattern, row)
    assert row["sums_agree"] is True, row
