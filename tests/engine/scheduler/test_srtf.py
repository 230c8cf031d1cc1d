"""SRTF among prefills: a prefill with at most one chunk left goes first, FIFO among equals."""

from __future__ import annotations

from sched_fakes import greedy, make_core, plan_rows, prompt_of, reference_tokens, req, run_all

from engine.scheduler.policies.srtf import ShortestRemainingFirst


def test_order_short_first_then_fifo() -> None:
    core, _ = make_core()
    for rid, n in [("long1", 100), ("short1", 30), ("long2", 90), ("short2", 10)]:
        core.add(req(rid, prompt_of(len(rid) + n, n)))
    seqs = core.scheduler.seqs
    seqs["long1"].num_computed = 70  # 30 left: now a short one, but submitted first
    order = ShortestRemainingFirst(32).order(seqs.values())
    assert [s.request_id for s in order] == ["long1", "short1", "short2", "long2"]


def test_short_prompt_overtakes_long_prefill() -> None:
    core, _ = make_core(num_pages=1024, prefill_chunk=32)
    core.add(req("long", prompt_of(1, 600), greedy(1)))
    core.step()
    core.step()
    core.add(req("short", prompt_of(2, 20), greedy(1)))
    (chunk,) = core.step()
    # The short prompt first and whole; the long one's chunk only fills what is left.
    assert plan_rows(core) == [("short", "prefill", 20), ("long", "prefill", 12)]
    assert chunk.request_id == "short" and chunk.finish_reason == "length"
    assert chunk.token_ids == tuple(reference_tokens(prompt_of(2, 20), greedy(1), 1))
    out = run_all(core)
    assert out["long"][0].token_ids == tuple(reference_tokens(prompt_of(1, 600), greedy(1), 1))


def test_fifo_among_long_prompts() -> None:
    core, runner = make_core(num_pages=1024, prefill_chunk=32)
    core.add(req("first", prompt_of(1, 200), greedy(1)))
    core.add(req("second", prompt_of(2, 200), greedy(1)))
    order = []
    while core.has_work():
        core.step()
        order += [rid for rid, kind, _ in plan_rows(core) if kind == "prefill"]
    assert order == ["first"] * 7 + ["second"] * 7
