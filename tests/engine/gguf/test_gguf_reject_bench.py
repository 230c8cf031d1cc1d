"""The rejection benchmark runs every crafted case and reports sane figures."""

from __future__ import annotations

from engine.bench.gguf_cases import bad_cases
from engine.bench.gguf_reject import run_gguf_reject_bench


def test_bench_rejects_every_case_quickly() -> None:
    result = run_gguf_reject_bench(repeats=1)
    assert result["failures"] == {}
    assert result["num_cases"] == result["num_rejected"] == len(bad_cases())
    assert 0 < result["median_ms"] <= result["max_ms"] < 1000
    assert result["slowest_case"] in dict(bad_cases())
    # A rejection allocates nothing in proportion to the counts it was lied to about.
    assert 0 < result["max_alloc_peak_kib"] < 1024
    assert result["peak_rss_growth_kib"] < 64 * 1024
