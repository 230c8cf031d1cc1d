"""EngineStats.slow_steps: the steps with decode rows that took longer than the ITL target
(what every stream in them waited for), with how the step ran, against the fake clock's
true costs (a + b * decode rows + c * prefill tokens, a capture's cost on top)."""

from __future__ import annotations

import pytest
from sched_fakes import FakeClock, greedy, make_core, prompt_of, req, run_all

from engine.core import SLOW_STEPS_KEPT


def test_slow_steps_name_the_stalls_of_decoding_streams() -> None:
    clock = FakeClock()
    core, runner = make_core(2048, clock=clock, itl_target_ms=10.0, prefill_chunk=512,
                             context=8192)
    runner.costs = (2e-3, 1e-3, 5e-5)  # 3 streams decode in 5 ms; 512 tokens take 25.6 ms
    for i in range(3):
        core.add(req(f"s{i}", prompt_of(i, 8), greedy(40)))
    for _ in range(6):
        core.step()  # the streams' prompts, then decode steps well under the target
    assert core.stats().slow_steps == ()
    runner.capture_steps = {len(runner.batches) + 1}  # the next step captures a graph
    core.step()
    core.add(req("long", prompt_of(9, 4000), greedy(1)))
    run_all(core)
    slow = core.stats().slow_steps
    assert slow[0].path == "capture" and slow[0].decode_rows == 3
    assert slow[0].prefill_tokens == 0 and slow[0].ms == pytest.approx(105.0)
    assert slow[0].target_ms == pytest.approx(10.0)
    # the long prompt's chunks: the ITL target keeps most steps beside the streams under
    # it, and a step over it has decode rows and prefill tokens, eager
    for step in slow[1:]:
        assert step.path == "eager" and step.decode_rows > 0 and step.prefill_tokens > 0
        assert step.ms > step.target_ms
    assert [s.at_s for s in slow] == sorted(s.at_s for s in slow)


def test_a_prefill_alone_over_the_target_is_no_stall() -> None:
    """A step without decode rows keeps nobody waiting: not a slow step; the list holds
    the latest SLOW_STEPS_KEPT."""
    clock = FakeClock()
    core, runner = make_core(2048, clock=clock, itl_target_ms=1.0, prefill_chunk=512,
                             context=8192)
    core.add(req("long", prompt_of(1, 3000), greedy(1)))
    run_all(core)
    assert core.stats().slow_steps == ()  # 6 chunks of 25 ms, no stream waiting
    core.add(req("s", prompt_of(2, 4), greedy(SLOW_STEPS_KEPT + 20)))
    run_all(core)  # every decode step (3 ms) is over the 1 ms target
    slow = core.stats().slow_steps
    assert len(slow) == SLOW_STEPS_KEPT and {s.path for s in slow} == {"eager"}
    assert all(s.decode_rows == 1 and s.ms == pytest.approx(3.0) for s in slow)
