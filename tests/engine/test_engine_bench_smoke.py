"""bench/gpu/engine_bench.py end to end on the CPU (its --device cpu smoke run): a small
synthetic model decoded and prefilled, and one stream's share of its bandwidth bound
recorded beside the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "engine_bench.py"


def test_engine_bench_cpu_smoke_records_the_bound(tmp_path, vocab_dir):
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--vocab",
           str(vocab_dir / "ggml-vocab-llama-spm.gguf"), "--synthetic", "gemma3-270m:Q4_K_M",
           "--variants", "ggml", "--concurrency", "1", "--tokens", "2", "--prefill", "8",
           "--no-profile", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads((tmp_path / "engine_bench.json").read_text())
    bound, variant = out["bound"], out["variants"]["ggml"]
    assert bound["context"] == 32 + 2 and bound["kv_quant"] == "f16"
    assert bound["copy_gb_s"] > 0
    # both figures are rounded to 0.1: the rate's half-step (0.05 GB/s) moves the bound by
    # 0.05e9 / token_bytes, which at a CPU's ~13 GB/s is more than 0.1% of it
    assert abs(bound["bound_tok_s"] - bound["copy_gb_s"] * 1e9 / bound["token_bytes"]) <= \
        0.05 + 0.05e9 / bound["token_bytes"] + 1e-6
    one = variant["decode_tps"]["1"]
    assert one > 0 and variant["prefill_tps"]["8"] > 0
    assert abs(variant["one_stream_pct_of_bound"] - 100 * one / bound["bound_tok_s"]) < 0.06
    assert "% of its bandwidth bound" in done.stdout
