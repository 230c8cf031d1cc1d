"""ITL target: the step-cost model and the chunk it allows, against the fake clock's true
costs (a + b * decode rows + c * prefill tokens, set by the test)."""

from __future__ import annotations

import math
import statistics

import pytest
from sched_fakes import FakeClock, greedy, make_core, prompt_of, reference_tokens, req, run_all

from engine.scheduler.policies.itl_target import NO_PREFILL, ItlTarget, StepCostModel

A, B, C = 2e-3, 1e-3, 5e-5  # the fake runner's default costs


def test_model_recovers_true_costs() -> None:
    model = StepCostModel()
    for rows, tokens in [(0, 512), (4, 0), (2, 100), (8, 300), (1, 0), (3, 64)] * 3:
        model.observe(rows, tokens, A + B * rows + C * tokens)
    a, b, c, d = model.coefficients()
    assert a == pytest.approx(A, rel=1e-3) and b == pytest.approx(B, rel=1e-3)
    assert c == pytest.approx(C, rel=1e-3) and abs(d) < 1e-9


def test_model_learns_the_attention_term_and_cuts_deep_chunks() -> None:
    """A chunk deep in a long prompt attends to everything before it: the model learns
    the per-key cost and allows a smaller chunk there than at the start."""
    D = 2e-8  # seconds per attended key
    policy = ItlTarget(20e-3, min_chunk=16)

    def cost(rows: int, n: int, start: int) -> float:
        return A + B * rows + C * n + D * n * (start + n / 2)

    for rows, n, start in [(0, 512, 0), (4, 0, 0), (2, 100, 3000), (8, 300, 1000),
                           (4, 64, 8000), (1, 256, 500)] * 4:
        policy.observe(rows, n, cost(rows, n, start), start)
    assert policy.model.coefficients()[3] == pytest.approx(D, rel=1e-2)
    near, _ = policy.chunk_limit(4, 512, 0)
    deep, why = policy.chunk_limit(4, 512, 20000)
    assert deep < near and why
    assert cost(4, deep, 20000) <= 20e-3 < cost(4, deep + 1, 20000)


def test_model_follows_a_slower_device_and_keeps_unexercised_terms() -> None:
    model = StepCostModel()
    for rows, tokens in [(0, 512), (4, 0), (2, 100), (8, 300)] * 3:
        model.observe(rows, tokens, A + B * rows + C * tokens)
    for rows, tokens in [(0, 512), (4, 0), (2, 100), (8, 300)] * 30:  # 2x slower now
        model.observe(rows, tokens, 2 * (A + B * rows + C * tokens))
    assert model.predict(4, 200) == pytest.approx(2 * (A + 4 * B + 200 * C), rel=1e-2)
    for _ in range(500):  # a long decode-only stretch says nothing about c
        model.observe(4, 0, 2 * (A + 4 * B))
    assert model.coefficients()[2] == pytest.approx(2 * C, rel=0.05)


def test_chunk_limit() -> None:
    policy = ItlTarget(None, min_chunk=16)
    assert policy.chunk_limit(4, 512) == (512, None)  # off
    policy.target_s = 10e-3
    assert policy.chunk_limit(4, 512)[0] == 64  # nothing measured yet: a probe chunk
    for rows, tokens in [(0, 512), (4, 0), (2, 100), (8, 300)] * 3:
        policy.observe(rows, tokens, A + B * rows + C * tokens)
    chunk, why = policy.chunk_limit(4, 512)
    assert chunk == math.floor((10e-3 - A - 4 * B) / C) and why  # 80
    policy.target_s = 3e-3  # the decoders alone take 6 ms: the minimum chunk still runs
    assert policy.chunk_limit(4, 512)[0] == 16
    policy.target_s = 1.0
    assert policy.chunk_limit(4, 512) == (512, None)


def test_chunk_limit_beside_rows_already_in_the_step() -> None:
    """Packed rows: each further row gets what still fits beside the ones before it (their
    tokens and attended keys add up); the first row alone is clamped up to min_chunk."""
    D = 2e-8

    def cost(rows: int, spans: list[tuple[int, int]]) -> float:  # spans: (tokens, start)
        return A + B * rows + sum(C * n + D * n * (s + n / 2) for n, s in spans)

    policy = ItlTarget(20e-3, min_chunk=16)
    for rows, n, start in [(0, 512, 0), (4, 0, 0), (2, 100, 3000), (8, 300, 1000),
                           (4, 64, 8000), (1, 256, 500)] * 4:
        policy.observe(rows, n, cost(rows, [(n, start)]), start)
    load = NO_PREFILL.plus(100, 0).plus(50, 2000)  # two rows already in the step
    n, why = policy.chunk_limit(4, 512, 6000, load)
    spans = [(100, 0), (50, 2000)]
    assert why and cost(4, [*spans, (n, 6000)]) <= 20e-3 < cost(4, [*spans, (n + 1, 6000)])
    full = NO_PREFILL.plus(300, 0)  # ~21.9 ms: no room for another row of any size
    assert cost(4, [(300, 0)]) > 20e-3
    assert policy.chunk_limit(4, 512, 4000, full)[0] == 0
    assert policy.chunk_limit(4, 512, 4000)[0] >= 16  # alone it still progresses


@pytest.mark.parametrize("target_ms", [10.0, 3.0])
def test_itl_target_keeps_modelled_step_under_target_while_prefill_progresses(
        target_ms: float) -> None:
    clock = FakeClock()
    core, runner = make_core(num_pages=1024, clock=clock, max_sessions=5, prefill_chunk=512,
                             itl_target_ms=target_ms)
    for i in range(4):  # one at a time: the model sees steps of 0..4 decode rows
        core.add(req(f"d{i}", prompt_of(i, 4), greedy(100)))
        core.step()
    core.add(req("long", prompt_of(9, 1000), greedy(1)))
    out = run_all(core)
    assert out["long"][0].token_ids == tuple(reference_tokens(prompt_of(9, 1000), greedy(1), 1))
    mixed = [b for b in runner.batches if sum(len(t) > 1 for t, _ in b.spans)
             and sum(len(t) == 1 for t, _ in b.spans) == 4]
    chunks = [max(len(t) for t, _ in b.spans) for b in mixed]
    steps_ms = [(A + 4 * B + C * n) * 1e3 for n in chunks]
    assert sum(chunks) >= 1000 - 64
    if target_ms == 10.0:
        # Only 4-token prefills measured so far: the first chunk is a probe of 64 (at most
        # 2x the most measured), not the whole 512-token budget (a 3x stall).
        assert chunks[0] == 64
        assert all(ms <= target_ms * 1.01 for ms in steps_ms)  # 2nd: fitted on one probe
        assert all(ms <= target_ms + 1e-9 for ms in steps_ms[2:])
        assert 76 <= max(chunks[2:]) <= 80  # uses the room it has (80 = exact fit)
    else:
        assert set(chunks[1:-1]) == {16}  # impossible target: minimum chunk, still moving


def test_auto_target_is_three_decode_only_steps() -> None:
    clock = FakeClock()
    core, runner = make_core(num_pages=1024, clock=clock, max_sessions=5, itl_target_ms="auto")
    core.add(req("d0", prompt_of(0, 4), greedy(100)))
    core.step()
    assert core.stats().itl_target_ms is None  # no decode-only step measured yet
    for i in range(1, 4):
        core.add(req(f"d{i}", prompt_of(i, 4), greedy(100)))
    while len(core.scheduler.decode_queue) < 4:
        core.step()
    for _ in range(5):
        core.step()
    core.add(req("long", prompt_of(9, 2000), greedy(1)))
    run_all(core)
    # Decode-only steps with 4 rows take A + 4B = 6 ms; the median is one of them.
    assert core.stats().itl_target_ms == pytest.approx(3 * (A + 4 * B) * 1e3)
    chunks = [max(len(t) for t, _ in b.spans) for b in runner.batches
              if sum(len(t) == 1 for t, _ in b.spans) == 4 and any(len(t) > 1 for t, _ in b.spans)]
    fit = math.floor((18e-3 - A - 4 * B) / C)  # 240
    assert 0.95 * fit <= max(chunks[1:]) <= fit


def test_no_cap_without_decoders() -> None:
    clock = FakeClock()
    core, runner = make_core(num_pages=1024, clock=clock, prefill_chunk=256, itl_target_ms=3.0)
    core.add(req("d", prompt_of(1, 4), greedy(40)))
    while "d" in core.scheduler.seqs:
        core.step()
    core.add(req("p", prompt_of(2, 300), greedy(40)))  # the model says 6 ms > 3 ms
    core.add(req("d2", prompt_of(3, 300), greedy(1)))
    core.step()
    assert runner.batches[-1].spans == [(tuple(prompt_of(2, 300)[:256]), 0)]  # nobody streams
    core.step()
    core.step()  # p decodes now: d2's chunk is capped to the minimum
    assert [len(t) for t, _ in runner.batches[-1].spans] == [1, 16]


# Step times scatter around the model's mean: 1 step in 10 is 30% slower, 1 in 10 is 20%.
SCATTER = (1.0, 0.92, 1.05, 1.3, 0.95, 1.0, 0.9, 1.2, 0.97, 0.98)


@pytest.mark.parametrize("max_margin", [2.0, 1.0])  # 1.0: the margin disabled (control)
def test_margin_keeps_scattered_steps_within_target(max_margin: float) -> None:
    """A chunk sized to the modelled mean overshoots the target on the slow steps; the
    margin (the 98th percentile of measured/modelled) keeps 95% of them within it."""
    clock = FakeClock()
    core, runner = make_core(num_pages=4096, clock=clock, max_sessions=5, prefill_chunk=512,
                             itl_target_ms=10.0, context=8192)
    runner.noise = lambda step: SCATTER[step % len(SCATTER)]
    core.scheduler.itl.max_margin = max_margin
    for i in range(4):
        core.add(req(f"d{i}", prompt_of(i, 4), greedy(400)))
        core.step()
    core.add(req("long", prompt_of(9, 6000), greedy(1)))
    mixed_ms = []
    while core.has_work():
        before, batches = clock.now, len(runner.batches)
        core.step()
        spans = runner.batches[batches].spans if len(runner.batches) > batches else []
        if sum(len(t) == 1 for t, _ in spans) == 4 and any(len(t) > 1 for t, _ in spans):
            mixed_ms.append((clock.now - before) * 1e3)
    later = mixed_ms[20:]  # after the probe and the first fits
    assert len(later) >= 40
    over = sum(ms > 10.0 + 1e-9 for ms in later) / len(later)
    if max_margin > 1.0:
        assert over <= 0.05, over
        assert core.scheduler.itl.margin() == pytest.approx(1.3, rel=0.05)
        assert statistics.fmean(later) >= 0.7 * 10.0  # still uses most of the target
    else:
        assert over >= 0.15, over  # the control: the slow steps overshoot


def test_prediction_never_falls_with_more_work() -> None:
    """Steps stuck at the minimum chunk, deeper and deeper into a prompt and (noise) a
    little faster each time, fit a negative per-key cost; a long chunk must still not
    look cheaper than a short one (it ran for 2.6 s against a 226 ms target once)."""
    policy = ItlTarget(0.2, min_chunk=16)
    policy.observe(2, 256, 0.9)  # one large step, so the ceiling allows long chunks
    for i in range(200):
        policy.observe(2, 16, 0.25 - i * 2e-4, start=500 + 16 * i)
    assert min(policy.model.coefficients()) < 0  # the fit itself is off
    deep = 500 + 16 * 200
    assert policy.model.predict(2, 368, deep) > policy.model.predict(2, 16, deep)
    assert policy.chunk_limit(2, 512, deep)[0] == 16


@pytest.mark.parametrize("replayed", [True, False])
def test_graph_replayed_steps_stay_out_of_the_cost_model(replayed: bool) -> None:
    """The model predicts eager steps; a replayed decode graph costs a fraction of one."""
    core, runner = make_core(num_pages=256, clock=FakeClock(), max_sessions=2,
                             itl_target_ms=10.0)
    runner.replay_factor = 0.3 if replayed else None
    core.add(req("d0", prompt_of(0, 4), greedy(8)))
    core.step()  # the prefill: eager
    seen = core.scheduler.itl.model.num_observations
    for _ in range(4):
        core.step()  # decode-only
    added = core.scheduler.itl.model.num_observations - seen
    assert added == (0 if replayed else 4)


def test_replayed_mixed_steps_grow_the_chunks_but_stay_out_of_the_model() -> None:
    """Mixed-step graphs: a replayed step with prefill costs a fraction of the eager step
    the model predicts, so it stays out of the model (and the margin); its chunk still
    counts toward the ceiling, so chunks beside decoders grow past the 64-token probe."""
    core, runner = make_core(num_pages=1024, clock=FakeClock(), max_sessions=5,
                             prefill_chunk=512, itl_target_ms=1000.0)  # the ceiling cuts
    runner.mixed_replay_factor = 0.5
    for i in range(4):
        core.add(req(f"d{i}", prompt_of(i, 4), greedy(100)))
        core.step()
    itl = core.scheduler.itl
    before = itl.model.num_prefill_observations
    core.add(req("long", prompt_of(9, 1000), greedy(1)))
    run_all(core)
    mixed = [b for b in runner.batches if sum(len(t) > 1 for t, _ in b.spans)
             and sum(len(t) == 1 for t, _ in b.spans) == 4]
    chunks = [max(len(t) for t, _ in b.spans) for b in mixed]
    assert chunks[:4] == [64, 128, 256, 512]  # 2x the most a recent step carried
    assert itl.model.num_prefill_observations == before and not itl.recent_steps()
    itl.note_replayed(4, 0)  # no prefill: nothing to note
    assert itl.max_recent_prefill() == 512


def test_auto_target_with_decode_graphs_counts_the_eager_step() -> None:
    """Replayed decode-only steps cost 0.3x their eager twin; steps with prefill run
    eagerly. The auto target is 3x the eager decode-only estimate (a + 4b = 6 ms -> 18 ms),
    not 3x the replay (5.4 ms, below every eager step: prefill would crawl at 16 tokens)."""
    clock = FakeClock()
    core, runner = make_core(num_pages=2048, clock=clock, max_sessions=5, prefill_chunk=512,
                             itl_target_ms="auto", context=4096)
    runner.replay_factor = 0.3
    core.add(req("calibrate", prompt_of(8, 300), greedy(1)))
    for i in range(4):
        core.add(req(f"d{i}", prompt_of(i, 4 + 40 * i), greedy(300)))
    while len(core.scheduler.decode_queue) < 4:
        core.step()
    for _ in range(5):
        core.step()
    start = len(runner.batches)
    core.add(req("long", prompt_of(9, 3000), greedy(1)))
    targets = []
    while "long" in core.scheduler.seqs:
        core.step()
        targets.append(core.scheduler.itl.target_s)
    assert targets[-1] == pytest.approx(3 * (A + 4 * B), rel=0.05)
    chunks = [max(len(t) for t, _ in b.spans) for b in runner.batches[start:]
              if sum(len(t) == 1 for t, _ in b.spans) == 4 and any(len(t) > 1 for t, _ in b.spans)]
    assert max(chunks) >= 200  # (18 - 6) ms / 0.05 ms per token = 240 at most


def test_eager_estimate_is_capped_by_the_replay() -> None:
    """A cost model still fitted on steps that compiled kernels (seconds long) must not
    turn the target into seconds: at most EAGER_CAP replays count."""
    from engine.core import AUTO_ITL_FACTOR, EAGER_CAP

    core, runner = make_core(num_pages=256, clock=FakeClock(), max_sessions=2,
                             itl_target_ms="auto")
    runner.replay_factor = 0.3
    core.add(req("d0", prompt_of(0, 4), greedy(50)))
    for _ in range(10):
        core.step()
    for _ in range(30):  # as if every eager step had compiled kernels for 2 s
        core.scheduler.itl.observe(1, 64, 2.0)
    core.step()
    replay = 0.3 * (A + B)
    assert core.scheduler.itl.target_s == pytest.approx(AUTO_ITL_FACTOR * EAGER_CAP * replay,
                                                        rel=1e-6)


def test_recent_steps_are_what_the_margin_reads() -> None:
    policy = ItlTarget(0.05)
    steps = [(4, 100, 0.020), (4, 0, 0.010), (0, 300, 0.030), (2, 50, 0.015), (4, 200, 0.024)]
    for rows, tokens, seconds in steps:
        policy.observe(rows, tokens, seconds)
    recent = policy.recent_steps()  # only steps with prefill beside decoders
    assert [(r, n, t) for r, n, t, _ in recent] == [(4, 100, 0.020), (2, 50, 0.015),
                                                    (4, 200, 0.024)]
    assert all(m == pytest.approx(policy.model.predict(r, n)) for r, n, _, m in recent)
    ratios = sorted(t / m for _, _, t, m in recent)
    q = ratios[min(len(ratios) - 2, int(policy.quantile * len(ratios)))]  # not the largest
    assert policy.margin() == (1.0 if q <= 1.02 else pytest.approx(min(2.0, q)))


def _fitted(policy: ItlTarget, rounds: int = 3) -> None:
    for rows, tokens in [(0, 512), (4, 0), (2, 100), (8, 300), (4, 64), (3, 200)] * rounds:
        policy.observe(rows, tokens, A + B * rows + C * tokens)


def test_a_lone_stall_stays_out_of_the_fit_and_the_margin() -> None:
    """A step that built a kernel (1 s where 20 ms were due) says nothing about costs:
    the fit, the margin and the largest recent chunk stay as they were."""
    policy = ItlTarget(0.02)
    _fitted(policy)
    before, ceiling = policy.model.coefficients(), policy.max_recent_prefill()
    policy.observe(2, 1024, 1.0)
    assert policy.num_stalls == 1
    assert policy.model.coefficients() == before and policy.margin() == 1.0
    assert policy.max_recent_prefill() == ceiling
    policy.observe(4, 100, A + 4 * B + 100 * C)  # a normal step ends the run
    policy.observe(2, 100, 1.0)
    assert policy.num_stalls == 2 and policy.margin() == 1.0


def test_slow_steps_in_a_row_are_a_trend() -> None:
    """Costs that really rose (the third slow step in a row) are taken in."""
    policy = ItlTarget(0.02)
    _fitted(policy)
    slow = 6 * (A + 4 * B + 100 * C)
    for _ in range(3):
        policy.observe(4, 100, slow)
    assert policy.num_stalls == 2
    assert policy.model.predict(4, 100) > 1.5 * (A + 4 * B + 100 * C)


def test_one_slow_step_does_not_set_the_margin() -> None:
    """The margin reads at most the second-largest ratio: one step 1.8x slow leaves it at
    1, a second one sets it."""
    policy = ItlTarget(0.02)
    _fitted(policy)
    due = A + 4 * B + 100 * C
    policy.observe(4, 100, 1.8 * due)  # not a stall (under STALL_FACTOR)
    assert policy.num_stalls == 0 and policy.margin() == 1.0
    policy.observe(4, 100, 1.8 * due)
    assert policy.margin() > 1.3  # the fit took in part of the slowness itself
