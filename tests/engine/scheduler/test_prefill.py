"""Prefill packing: several prompts share one step's token budget, on the KV-checking fake
runner (a wrong page table or position in a packed forward changes the tokens)."""

from __future__ import annotations

import random

import pytest
from sched_fakes import (
    FakeClock,
    greedy,
    make_core,
    plan_rows,
    prompt_of,
    reference_tokens,
    req,
    run_all,
    tokens_of,
)

from engine.scheduler.policies.client_rr import interleave


def first_tokens(chunks, rid: str) -> tuple[int, ...]:
    (chunk,) = [c for c in chunks if c.request_id == rid]
    return chunk.token_ids


def _prefills(core) -> list[tuple[str, int]]:
    return [(rid, n) for rid, kind, n in plan_rows(core) if kind == "prefill"]


def test_four_clients_short_prompts_prefill_in_one_step() -> None:
    core, runner = make_core(max_sessions=8, prefill_chunk=64)
    prompts = {f"light{i}": prompt_of(10 + i, 12 + i) for i in range(4)}  # 54 tokens in all
    for rid, p in prompts.items():
        core.add(req(rid, p, greedy(5), client=rid))
    first = core.step()
    assert sorted(_prefills(core)) == sorted((rid, len(p)) for rid, p in prompts.items())
    assert len(runner.batches) == 1 and len(runner.batches[0].spans) == 4  # one forward
    # Every prompt's first token came out of that one forward, and each is right.
    assert {c.request_id: c.token_ids for c in first} == {
        rid: tuple(reference_tokens(p, greedy(5), 1)) for rid, p in prompts.items()}

    out = run_all(core)
    for rid, p in prompts.items():
        assert list(first_tokens(first, rid)) + tokens_of(out[rid]) == \
            reference_tokens(p, greedy(5), 5)


def test_light_prompts_prefill_together_beside_a_heavy_clients_streams() -> None:
    core, runner = make_core(max_sessions=8, prefill_chunk=128)
    for i in range(4):
        core.add(req(f"h{i}", prompt_of(i, 6), greedy(40), client="heavy"))
    while len(core.scheduler.decode_queue) < 4:
        core.step()
    prompts = {f"l{i}": prompt_of(20 + i, 30) for i in range(4)}  # 120 of the 128 tokens
    for rid, p in prompts.items():
        core.add(req(rid, p, greedy(3), client=rid))
    chunks = core.step()
    rows = plan_rows(core)
    assert sorted(r for r, k, _ in rows if k == "decode") == [f"h{i}" for i in range(4)]
    assert sorted(_prefills(core)) == [(rid, 30) for rid in prompts]
    assert len(runner.batches[-1].spans) == 8  # decoders and all four prompts: one forward
    out = run_all(core)
    for rid, p in prompts.items():  # their first tokens came from the packed forward
        assert list(first_tokens(chunks, rid)) + tokens_of(out[rid]) == \
            reference_tokens(p, greedy(3), 3)
    for i in range(4):
        assert tokens_of(out[f"h{i}"])[-1] == \
            reference_tokens(prompt_of(i, 6), greedy(40), 40)[-1]


def test_budget_shared_short_first_then_the_long_ones_chunk() -> None:
    core, _ = make_core(num_pages=1024, max_sessions=8, prefill_chunk=64)
    core.add(req("long", prompt_of(1, 300), greedy(1), client="a"))
    core.add(req("s1", prompt_of(2, 20), greedy(1), client="b"))
    core.add(req("s2", prompt_of(3, 30), greedy(1), client="c"))
    core.step()
    # The short prompts whole, then what is left of the budget for the long one.
    assert _prefills(core) == [("s1", 20), ("s2", 30), ("long", 14)]
    core.step()
    assert _prefills(core) == [("long", 64)]


def test_clients_take_turns_when_the_budget_is_tight() -> None:
    core, _ = make_core(max_sessions=8, prefill_chunk=40)
    for rid, client in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C")]:
        core.add(req(rid, prompt_of(len(rid) + ord(rid[0]), 16), greedy(1), client=client))
    core.step()
    # FIFO alone would give a1, a2 and 8 tokens of a3; turns give A, B, then C's start.
    assert _prefills(core) == [("a1", 16), ("b1", 16), ("c1", 8)]


def test_interleave_keeps_each_clients_order() -> None:
    core, _ = make_core()
    spec = [("a1", "A"), ("a2", "A"), ("b1", "B"), ("a3", "A"), ("c1", "C"), ("b2", "B")]
    for rid, client in spec:
        core.add(req(rid, prompt_of(ord(rid[0]) + int(rid[1]), 4), client=client))
    seqs = [core.scheduler.seqs[rid] for rid, _ in spec]
    assert [s.request_id for s in interleave(seqs)] == ["a1", "b1", "c1", "a2", "b2", "a3"]


@pytest.mark.parametrize("seed", range(4))
def test_budget_is_never_exceeded(seed: int) -> None:
    """Random prompts, clients, arrivals, budgets, ITL targets, small pools (preemption)
    and sliding windows: no step carries more prefill tokens than the budget, and every
    output is the reference output."""
    rng = random.Random(seed)
    budget = rng.choice([8, 24, 64])
    clock = FakeClock()
    core, _ = make_core(num_pages=rng.choice([48, 400]), clock=clock,
                        windows=rng.choice([{}, {"local": 12}]), prefill_chunk=budget,
                        max_sessions=rng.choice([2, 4, 6]), context=300,
                        itl_target_ms=rng.choice([None, 4.0, "auto"]))
    windows = dict(core.scheduler.pool.windows)
    pending = [(rng.randrange(60), f"r{i}", prompt_of(seed * 100 + i, rng.randint(1, 90)),
                greedy(rng.randint(1, 12)), f"c{rng.randrange(3)}") for i in range(14)]
    out: dict[str, list] = {}
    num_packed = 0
    for step in range(5000):
        for item in [p for p in pending if p[0] == step]:
            core.add(req(item[1], item[2], item[3], client=item[4]))
        if not core.has_work() and step > 60:
            break
        for chunk in core.step():
            out.setdefault(chunk.request_id, []).append(chunk)
        if core.scheduler.last_plan is not None and core.scheduler.last_plan.rows:
            prefill = _prefills(core)
            assert sum(n for _, n in prefill) <= budget, prefill
            num_packed += len(prefill) > 1
    for _, rid, prompt, params, _ in pending:
        expected = reference_tokens(prompt, params, params.max_tokens, windows)
        assert tokens_of(out[rid]) == expected, rid
    assert num_packed > 0  # the scenario did share steps between prompts


def test_near_done_gate_bounds_the_packed_step() -> None:
    """While a full house waits on a finishing decoder, the step's prefill stays within the
    gate's short-chunk size: two 40-token prompts go one after the other, not together."""
    core, _ = make_core(max_sessions=3, prefill_chunk=128)
    core.add(req("d", prompt_of(1, 4), greedy(30)))  # within the 64-token window
    core.step()
    core.add(req("p1", prompt_of(2, 40), greedy(2), client="a"))
    core.add(req("p2", prompt_of(3, 40), greedy(2), client="b"))
    core.add(req("w", prompt_of(4, 4), greedy(2), client="c"))  # no slot left: waits
    core.step()
    assert _prefills(core) == [("p1", 40)]
    assert any(d.policy == "near_done" for d in core.scheduler.last_plan.decisions)
    core.step()
    assert _prefills(core) == [("p2", 40)]


def test_packed_together_without_the_gate() -> None:
    core, _ = make_core(max_sessions=4, prefill_chunk=128)  # a free slot: nobody waits
    core.add(req("d", prompt_of(1, 4), greedy(30)))
    core.step()
    core.add(req("p1", prompt_of(2, 40), greedy(2), client="a"))
    core.add(req("p2", prompt_of(3, 40), greedy(2), client="b"))
    core.step()
    assert _prefills(core) == [("p1", 40), ("p2", 40)]
