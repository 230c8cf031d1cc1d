"""Prefill aging: a long prompt advances under a steady stream of short prompts that
could take every step's budget."""

from __future__ import annotations

from sched_fakes import greedy, make_core, plan_rows, prompt_of, reference_tokens, req

from engine.scheduler.policies.aging import PrefillAging

CHUNK = 32
LONG = 400


def _stream(patience: int, num_steps: int) -> tuple[list[int], list[int], object]:
    """A long prompt, and every step a new 32-token prompt from a rotating client (each
    fills the whole budget). -> (steps in which the long prompt got tokens, steps in which
    a short one did, the core)."""
    core, _ = make_core(num_pages=4096, max_sessions=6, prefill_chunk=CHUNK)
    core.scheduler.aging.patience = patience
    core.add(req("long", prompt_of(1, LONG), greedy(1), client="big"))
    long_steps, short_steps = [], []
    for step in range(num_steps):
        core.add(req(f"s{step}", prompt_of(1000 + step, CHUNK), greedy(1),
                     client=f"c{step % 3}"))
        for chunk in core.step():
            if chunk.request_id == "long":
                assert chunk.token_ids == tuple(reference_tokens(prompt_of(1, LONG),
                                                                 greedy(1), 1))
        prefilled = {r for r, k, _ in plan_rows(core) if k == "prefill"}
        if "long" in prefilled:
            long_steps.append(step)
        if prefilled - {"long"}:
            short_steps.append(step)
    return long_steps, short_steps, core


def test_long_prompt_advances_under_a_stream_of_short_ones() -> None:
    patience, num_steps = 4, 90
    long_steps, short_steps, core = _stream(patience, num_steps)
    # 400 tokens in 32-token chunks: 13 chunks, one at least every patience + 1 steps.
    assert len(long_steps) >= 13 and "long" not in core.scheduler.seqs  # done
    gaps = [b - a for a, b in zip([-1, *long_steps], long_steps, strict=False)]
    assert max(gaps) <= patience + 1
    # ... and the short prompts keep every other step.
    assert len(set(long_steps) | set(short_steps)) == num_steps


def test_without_aging_the_stream_starves_the_long_prompt() -> None:
    long_steps, short_steps, core = _stream(10**9, 40)  # aging off: the control
    assert long_steps == [] and core.scheduler.seqs["long"].num_computed == 0
    assert len(short_steps) == 40


def test_order_and_record() -> None:
    core, _ = make_core()
    for rid in ("a", "b", "c"):
        core.add(req(rid, prompt_of(ord(rid), 8)))
    a, b, c = (core.scheduler.seqs[r] for r in "abc")
    aging = PrefillAging(patience=2)
    ranked = [c, b, a]  # what SRTF and the turns said
    assert aging.order(ranked) == ranked
    aging.record(ranked, served=set())  # no prefill ran: nobody was passed over
    assert aging.num_skips(a) == 0
    for _ in range(2):
        aging.record(ranked, served={"c"})
    assert aging.is_starved(a) and aging.is_starved(b) and not aging.is_starved(c)
    assert aging.order(ranked) == [a, b, c]  # starved first, oldest first
    aging.record(ranked, served={"a"})
    assert aging.num_skips(a) == 0 and aging.num_skips(b) == 3 and aging.order(ranked) == [b, c, a]
