"""Percentiles against numpy's (an independent implementation), latency summaries, tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.bench.report import flatten, format_table, latency_ms, percentile

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)),
                                                  rel=1e-9, abs=1e-6)


def test_percentile_interpolates():
    # rank (5 - 1) * 0.95 = 3.8 between 40 and 100
    assert percentile([10, 20, 30, 40, 100], 95) == pytest.approx(40 + 0.8 * 60)
    assert percentile([7], 95) == 7
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_latency_ms_summary_in_milliseconds():
    got = latency_ms([0.010, 0.020, 0.030, 0.040])
    assert got == {"mean": 25.0, "p95": pytest.approx(38.5), "max": 40.0}
    assert latency_ms([]) == {"mean": None, "p95": None, "max": None}


def test_table_and_flatten():
    table = format_table(["name", "tok/s"], [["mbufo", 1234.5], ["peer", None]])
    lines = table.splitlines()
    assert lines[0].split() == ["name", "tok/s"]
    assert "1,234.5" in lines[2] and lines[3].split() == ["peer", "-"]
    assert len({len(line) for line in lines}) == 1
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
