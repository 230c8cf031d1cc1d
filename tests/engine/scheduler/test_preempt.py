"""Evict-and-recompute: when pages run out, cached pages go first, then the lowest-ranked
resident is preempted and recomputed later; no request fails and no output changes."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sched_fakes import greedy, make_core, prompt_of, reference_tokens, req, run_all, tokens_of

from engine.errors import OutOfKVPages
from engine.sampler import SamplingParams
from engine.scheduler.policies.preempt import EvictAndRecompute


def _sampled(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=20, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, repetition_penalty=1.1)


def _idle(core) -> bool:
    """Every page is free once the prefix cache lets go of its own."""
    if core.radix is not None:
        core.radix.evict(10**9)
    return all(p.num_free == p.num_pages for p in core.pool.groups.values())


def test_victim_is_lowest_priority_then_latest_arrival() -> None:
    core, _ = make_core()
    spec = [("old", 0, 1.0), ("new", 0, 2.0), ("vip", 5, 3.0), ("low", -1, 0.5)]
    for rid, prio, arrival in spec:
        core.add(req(rid, prompt_of(len(rid), 4), priority=prio, arrival=arrival))
    s = core.scheduler.seqs
    residents = list(s.values())
    assert EvictAndRecompute.victim(s["vip"], residents) is s["low"]
    assert EvictAndRecompute.victim(s["old"], [s["old"], s["new"], s["vip"]]) is s["new"]
    assert EvictAndRecompute.victim(s["new"], [s["old"], s["new"], s["vip"]]) is None
    assert EvictAndRecompute.victim(s["low"], residents) is None  # ranks lowest itself


def test_evict_and_recompute_outputs_equal_solo_runs() -> None:
    # 4 sessions of up to 25 + 40 tokens need 17 pages each; the pool has 24.
    core, _ = make_core(num_pages=24, page_size=4, max_sessions=4, prefill_chunk=8)
    prompts = {f"r{i}": prompt_of(100 + i, 10 + 5 * i) for i in range(4)}
    for i, (rid, p) in enumerate(prompts.items()):
        core.add(req(rid, p, _sampled(40, seed=i)))
    out = run_all(core)
    assert core.scheduler.num_preemptions > 0  # the pool really ran out
    for i, (rid, p) in enumerate(prompts.items()):
        expect = reference_tokens(p, _sampled(40, seed=i), 40)
        assert tokens_of(out[rid]) == expect
        assert "".join(c.text for c in out[rid]) == "".join(f"<{t}>" for t in expect)
        counts = [len(c.token_ids) for c in out[rid]]
        assert [c.completion_tokens for c in out[rid]] == [
            sum(counts[:i + 1]) for i in range(len(counts))]
        assert out[rid][-1].finish_reason == "length"
    assert _idle(core)


def test_higher_priority_is_never_preempted() -> None:
    core, _ = make_core(num_pages=20, page_size=4, max_sessions=3, prefill_chunk=8,
                        prefix_cache=False)
    core.add(req("low1", prompt_of(1, 12), greedy(40), arrival=1.0))
    core.add(req("vip", prompt_of(2, 12), greedy(40), priority=1, arrival=2.0))
    core.add(req("low2", prompt_of(3, 12), greedy(40), arrival=3.0))
    preempted = []
    out = {}
    while core.has_work():
        for c in core.step():
            out.setdefault(c.request_id, []).append(c)
        preempted += core.scheduler.last_plan.preempted
    assert preempted and "vip" not in preempted
    for rid, seed in [("low1", 1), ("vip", 2), ("low2", 3)]:
        assert tokens_of(out[rid]) == reference_tokens(prompt_of(seed, 12), greedy(40), 40)


def test_cached_pages_are_evicted_before_anyone_is_preempted() -> None:
    core, _ = make_core(num_pages=24, page_size=4, max_sessions=2)
    for i in range(4):  # leaves 4 x 5 whole pages in the prefix cache
        core.add(req(f"warm{i}", prompt_of(10 + i, 20), greedy(1)))
    run_all(core)
    assert core.radix.num_cached_pages("full") == 20
    core.add(req("a", prompt_of(1, 30), greedy(10)))
    core.add(req("b", prompt_of(2, 30), greedy(10)))
    out = run_all(core)
    assert core.scheduler.num_preemptions == 0
    assert tokens_of(out["a"]) == reference_tokens(prompt_of(1, 30), greedy(10), 10)


def test_request_that_cannot_fit_alone_fails_alone() -> None:
    core, _ = make_core(num_pages=8, page_size=4)
    with pytest.raises(OutOfKVPages) as err:
        core.add(req("huge", prompt_of(1, 30), greedy(10)))  # 40 tokens = 10 pages > 8
    assert "10" in str(err.value) and "8" in str(err.value)
    core.add(req("fits", prompt_of(2, 20), greedy(12)))
    out = run_all(core)
    assert tokens_of(out["fits"]) == reference_tokens(prompt_of(2, 20), greedy(12), 12)


@pytest.mark.parametrize("seed", range(6))
def test_random_pressure_with_aborts_and_sliding_windows(seed: int) -> None:
    rng = random.Random(seed)
    windows = {"local": rng.choice([6, 9, 16])} if seed % 2 else {}
    page_size = rng.choice([2, 4])
    core, _ = make_core(num_pages=rng.randint(40, 64) // page_size, page_size=page_size,
                        windows=windows,
                        max_sessions=rng.randint(2, 5), prefill_chunk=rng.choice([4, 8, 16]),
                        mixed_batch=seed % 3 != 0)
    prompts, aborted = {}, set()
    base = prompt_of(seed, 12)
    for i in range(12):
        tail = prompt_of(1000 * seed + i, rng.randint(1, 12))
        prompts[f"q{i}"] = (base[:rng.randint(0, 12)] + tail, rng.randint(1, 14))
    pending = list(prompts.items())
    out: dict = {}
    for step in range(5000):
        if pending and rng.random() < 0.3:
            rid, (p, n) = pending.pop(0)
            core.add(req(rid, p, _sampled(n, seed=step)))
            prompts[rid] = (p, n, step)
        if rng.random() < 0.03 and core.scheduler.seqs:
            rid = rng.choice(sorted(core.scheduler.seqs))
            core.abort(rid)
            aborted.add(rid)
        for c in core.step():
            out.setdefault(c.request_id, []).append(c)
        if not pending and not core.has_work():
            break
    assert not core.has_work()
    for rid, (p, n, s) in prompts.items():
        got = tokens_of(out[rid])
        expect = reference_tokens(p, _sampled(n, seed=s), n, windows)
        if rid in aborted:
            assert out[rid][-1].finish_reason == "abort" and got == expect[:len(got)]
        else:
            assert got == expect and out[rid][-1].finish_reason == "length"
    assert _idle(core)


def test_prompt_logprobs_survive_preemption() -> None:
    """Requests that want their prompt's logprobs, in a pool that runs out: each gets its
    prompt's entries once, with its first token, equal to the fake model's distribution,
    and its tokens are what a solo run gives."""
    import torch
    from sched_fakes import hash_of_context, logits_of

    core, _ = make_core(num_pages=24, page_size=4, max_sessions=4, prefill_chunk=8)
    prompts = {f"r{i}": prompt_of(200 + i, 10 + 5 * i) for i in range(4)}
    for i, (rid, p) in enumerate(prompts.items()):
        core.add(req(rid, p, replace(_sampled(40, seed=i), prompt_logprobs=1)))
    out = run_all(core)
    assert core.scheduler.num_preemptions > 0
    for i, (rid, p) in enumerate(prompts.items()):
        assert tokens_of(out[rid]) == reference_tokens(p, _sampled(40, seed=i), 40)
        sent = [c.prompt_logprobs for c in out[rid] if c.prompt_logprobs is not None]
        assert len(sent) == 1 and out[rid][0].prompt_logprobs is sent[0]
        for pos in range(1, len(p)):
            ref = torch.log_softmax(logits_of(hash_of_context(p[:pos], {})).double(), -1)
            assert sent[0][pos].logprob == pytest.approx(float(ref[p[pos]]), abs=1e-5)
    assert _idle(core)
