"""bench/gpu/engine_profile.py (engine_bench.py's graph profile): the span and busy time
of kernel intervals that overlap (programmatic dependent launches), nest, and leave gaps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import engine_profile  # noqa: E402


@pytest.mark.parametrize("intervals,span,busy", [
    ([], 0.0, 0.0),
    ([(0.0, 2.0)], 2.0, 2.0),
    ([(0.0, 2.0), (3.0, 4.0)], 4.0, 3.0),  # a gap of 1
    ([(0.0, 2.0), (1.0, 3.0)], 3.0, 3.0),  # overlapping: counted once
    ([(0.0, 5.0), (1.0, 2.0), (3.0, 6.0)], 6.0, 6.0),  # nested, then overlapping
    ([(0.0, 1.0), (0.5, 1.5), (4.0, 4.5)], 4.5, 2.0),
])
def test_span_and_busy(intervals, span, busy):
    assert engine_profile.timeline(intervals) == (span, busy)


def test_last_step_is_the_final_steps_kernels_from_its_own_start():
    long = "_qint_gemv_kernel_with_a_name_longer_than_forty_characters"
    kernels = [("a", 0.0, 1.0), ("b", 0.5, 2.0),  # step 1
               ("a", 10.0, 11.25), (long, 10.5, 13.0)]  # step 2
    assert engine_profile.last_step(kernels, 2) == [["a", 0.0, 1.25], [long[:40], 0.5, 3.0]]


@pytest.mark.parametrize("kernels,steps", [([], 3), ([("a", 0.0, 1.0)], 2), ([("a", 0.0, 1.0)], 0)])
def test_last_step_of_too_few_kernels_is_empty(kernels, steps):
    assert engine_profile.last_step(kernels, steps) == []


def test_step_shares_add_up_to_the_span_after_the_first_kernel():
    """Each kernel counts from the previous kernel's end to its own: an early-launched
    kernel adds only what it runs past the one before it; per name, largest first."""
    last = [["norm", 0.0, 4.0], ["gemv", 1.0, 9.0], ["act", 8.5, 10.5], ["gemv", 9.0, 20.0],
            ["norm", 19.0, 24.0]]
    shares = engine_profile.step_shares(last)
    assert shares == [["gemv", 14.5, 2], ["norm", 4.0, 1], ["act", 1.5, 1]]
    assert sum(us for _, us, _ in shares) == last[-1][2] - last[0][2]
    assert engine_profile.step_shares([]) == [] and engine_profile.step_shares(last[:1]) == []
