"""bench/gpu/attn_bench.py's logic at tiny shapes on the CPU (--smoke, interpreter): every
config of every case is checked against the float64 reference and timed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "attn_bench.py"


def test_smoke_checks_and_times_every_config(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "attn_bench.json").read_text())
    rows = report["rows"]
    assert {(r["kv"], r["config"]) for r in rows} == {
        (kv, cfg) for kv in ("f16", "q8") for cfg in ("16x32x32:4", "64x64x256:4")}
    assert all(r["ok"] and r["max_err"] < 2e-2 and r["us"] > 0 for r in rows)
    # 40 keys in 32-key splits: two items per row and KV head
    assert {r["programs"] for r in rows if r["config"].startswith("16x32x32")} == {2 * 2 * 8}
    assert not report["errors"] and not report["skipped"]


def test_smoke_chunks_with_and_without_cut_items(tmp_path):
    """Rows querying their last 12 tokens (3 query blocks of the 16x32 config) at 200
    keys: with fill 6 (least 16 keys) each block is cut in two, and the merged output is
    still the reference's."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path),
                          "--kv", "q8", "--chunk", "12", "--contexts", "200", "--fill", "0,6",
                          "--least", "16"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "attn_bench.json").read_text())
    rows = {(r["config"], r["fill"]): r for r in report["rows"]}
    assert set(rows) == {(c, f) for c in ("16x32x32:4", "64x64x256:4") for f in (0, 6)}
    assert all(r["ok"] and r["chunk"] == 12 and r["us"] > 0 for r in rows.values())
    whole, cut = rows[("16x32x32:4", 0)], rows[("16x32x32:4", 6)]
    assert whole["programs"] == 2 * 3 * 8 and whole["slots"] == 2 * 12
    assert cut["programs"] == 2 * whole["programs"] and cut["slots"] == 2 * 2 * 12
    # the 64x64 config holds the 12 tokens in one block: its 200 keys in 256-key splits
    assert rows[("64x64x256:4", 6)]["programs"] == 2 * 8
