"""bench/gpu/llama_cpp_peer.py on llama.cpp's own output from an H200 run (tests/data:
llama-bench -o json and llama-batched-bench's table, 2026-12-03, bench/RESULTS.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import llama_cpp_peer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


def test_parse_the_h200_run():
    bench = json.loads((DATA / "llama_bench_h200.json").read_text())
    table = (DATA / "llama_batched_h200.txt").read_text()
    peer = llama_cpp_peer.parse(bench, table)
    # by hand from the files: avg_ts rounded; S_TG t/s by B
    assert peer["tg"] == {"128": 272.5}
    assert peer["prefill_tps"] == {"512": 8854.2, "4096": 9783.8}
    assert peer["decode_tps"] == {"1": 272.32, "16": 2085.04, "64": 4582.23}


def test_cli_writes_the_json(tmp_path):
    out = tmp_path / "peer.json"
    assert llama_cpp_peer.main(["--bench-json", str(DATA / "llama_bench_h200.json"),
                                "--batched-txt", str(DATA / "llama_batched_h200.txt"),
                                "--out", str(out)]) == 0
    assert json.loads(out.read_text())["decode_tps"]["64"] == 4582.23


def test_a_table_without_its_columns_is_refused():
    with pytest.raises(ValueError, match="S_TG"):
        llama_cpp_peer.parse([], "| PP | TG |\n|----|----|\n| 128 | 128 |\n")
