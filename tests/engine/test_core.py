"""EngineCore: validation, streaming, stop handling, logprobs, abort, prefix cache, stats.

Outputs are checked against `reference_tokens`, which decodes one token at a time straight
from the fake model's logits (no engine, no batching, no pages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_HELPERS = str(Path(__file__).with_name("scheduler"))  # sched_fakes.py, in any import mode
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
from sched_fakes import (  # noqa: E402
    EOS,
    FakeClock,
    greedy,
    hash_of_context,
    logits_of,
    make_core,
    prompt_of,
    reference_tokens,
    req,
    run_all,
    tokens_of,
)

from engine.errors import ContextOverflow, InvalidRequest, OutOfKVPages  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402


def _idle(core) -> bool:
    core.radix.evict(10**9)
    unlocked = all(n.lock_ref == 0 for n in core.radix._nodes())
    return unlocked and all(p.num_free == p.num_pages for p in core.pool.groups.values())


def test_add_validates() -> None:
    core, _ = make_core(context=64)
    bad = [
        req("empty", []),
        req("vocab", [1, 2, 999]),
        req("n", [1, 2], SamplingParams(n=2)),
        req("temp", [1, 2], SamplingParams(temperature=-1.0)),
        req("zero", [1, 2], SamplingParams(max_tokens=0)),
    ]
    for r in bad:
        with pytest.raises(InvalidRequest):
            core.add(r)
    with pytest.raises(ContextOverflow) as err:
        core.add(req("long", prompt_of(1, 50), greedy(20)))
    assert err.value.code == "context_length_exceeded"
    assert all(str(n) in str(err.value) for n in (50, 20, 64))
    core.add(req("ok", prompt_of(1, 50), SamplingParams(temperature=0.0, ignore_eos=True)))
    with pytest.raises(InvalidRequest):
        core.add(req("ok", prompt_of(2, 5)))  # id in use
    out = run_all(core)
    assert out["ok"][-1].completion_tokens == 64 - 50  # default max_tokens: the context


def test_batch_streams_the_reference_output() -> None:
    core, _ = make_core(max_sessions=3, prefill_chunk=8)
    prompts = {f"r{i}": prompt_of(i, 3 + 7 * i) for i in range(5)}
    for rid, p in prompts.items():
        core.add(req(rid, p, greedy(9)))
    out = run_all(core)
    for rid, p in prompts.items():
        expect = reference_tokens(p, greedy(9), 9)
        assert [c.token_ids for c in out[rid]] == [(t,) for t in expect]  # one per step
        assert "".join(c.text for c in out[rid]) == "".join(f"<{t}>" for t in expect)
        assert [c.finish_reason for c in out[rid]] == [None] * 8 + ["length"]
        assert {(c.prompt_tokens, c.cached_tokens) for c in out[rid]} == {(len(p), 0)}


def test_eos_and_stop_ids_finish_with_stop() -> None:
    core, _ = make_core()
    found = {}
    for seed in range(200):  # prompts whose reference output hits EOS / a stop id early
        toks = reference_tokens(prompt_of(seed, 5), greedy(30), 30)
        if EOS in toks[1:] and "eos" not in found:
            found["eos"] = (seed, toks.index(EOS))
        elif "stop" not in found and len(set(toks)) > 3:
            found["stop"] = (seed, toks.index(toks[2]))
        if len(found) == 2:
            break
    (eos_seed, eos_at), (stop_seed, stop_at) = found["eos"], found["stop"]
    core.add(req("eos", prompt_of(eos_seed, 5), greedy(30, ignore_eos=False)))
    stop_id = reference_tokens(prompt_of(stop_seed, 5), greedy(30), 30)[stop_at]
    core.add(req("stop", prompt_of(stop_seed, 5), greedy(30, stop_token_ids=(stop_id,))))
    out = run_all(core)
    for rid, seed, at in [("eos", eos_seed, eos_at), ("stop", stop_seed, stop_at)]:
        expect = reference_tokens(prompt_of(seed, 5), greedy(30), 30)
        assert tokens_of(out[rid]) == expect[:at + 1]  # the stop token is counted...
        assert out[rid][-1].finish_reason == "stop"
        assert f"<{expect[at]}>" not in out[rid][-1].text  # ...but its text is not shown


def test_logprobs_are_the_model_distribution() -> None:
    core, _ = make_core()
    prompt = prompt_of(3, 6)
    core.add(req("lp", prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)))
    out = run_all(core)
    context = list(prompt)
    for chunk in out["lp"]:
        (lp,) = chunk.logprobs
        ref = torch.log_softmax(logits_of(hash_of_context(context, {})).double(), -1)
        assert lp.token_id == chunk.token_ids[0] == int(ref.argmax())
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-5)
        assert [t for t, _ in lp.top] == ref.topk(2).indices.tolist()
        context.append(lp.token_id)


def test_prompt_logprobs_cover_every_prompt_token() -> None:
    """Each prompt token's logprob given the ones before it (the fake model's distribution
    at the position before), over several chunks, beside a decoding stream, for a prompt
    the prefix cache holds: it is computed again, and the output is what it was."""
    core, _ = make_core(prefill_chunk=8)
    prompt = prompt_of(5, 30)
    core.add(req("warm", prompt, greedy(3)))
    warm = run_all(core)
    core.add(req("beside", prompt_of(6, 5), greedy(40)))
    core.step()
    core.add(req("lp", prompt, greedy(3, prompt_logprobs=2)))
    out = run_all(core)
    assert tokens_of(out["lp"]) == tokens_of(warm["warm"])
    core.add(req("again", prompt, greedy(3)))
    assert run_all(core)["again"][-1].cached_tokens > 0  # the cache holds the prompt...
    assert out["lp"][-1].cached_tokens == 0  # ...which the logprobs' prefill did not use
    firsts = [c for c in out["lp"] if c.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0] is out["lp"][0]
    entries = firsts[0].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        ref = torch.log_softmax(logits_of(hash_of_context(prompt[:p], {})).double(), -1)
        assert entries[p].token_id == prompt[p]
        assert entries[p].logprob == pytest.approx(float(ref[prompt[p]]), abs=1e-5)
        assert [t for t, _ in entries[p].top] == ref.topk(2).indices.tolist()
    assert all(c.prompt_logprobs is None for c in out["beside"])


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_frees_all_pages(when: str) -> None:
    core, _ = make_core(num_pages=64, max_sessions=1, prefill_chunk=8)
    core.add(req("other", prompt_of(1, 10), greedy(6)))
    core.add(req("victim", prompt_of(2, 40), greedy(20)))
    steps = {"waiting": 1, "mid_prefill": 9, "decoding": 14}[when]
    out: dict = {}
    for _ in range(steps):
        for c in core.step():
            out.setdefault(c.request_id, []).append(c)
    seq = core.scheduler.seqs["victim"]
    assert seq.phase.value == {"waiting": "waiting", "mid_prefill": "prefill",
                               "decoding": "decode"}[when]
    core.abort("victim")
    core.abort("no-such-request")  # ignored
    for c in core.step():
        out.setdefault(c.request_id, []).append(c)
    assert out["victim"][-1].finish_reason == "abort"
    assert "victim" not in core.scheduler.seqs
    for rid, c in run_all(core).items():
        out.setdefault(rid, []).extend(c)
    assert tokens_of(out["other"]) == reference_tokens(prompt_of(1, 10), greedy(6), 6)
    assert _idle(core)


def test_prefix_cache_second_request_computes_only_the_rest() -> None:
    core, runner = make_core(page_size=4)
    first = prompt_of(1, 40)
    core.add(req("first", first, greedy(3)))
    run_all(core)
    second = first[:34] + prompt_of(2, 8)
    core.add(req("second", second, greedy(5)))
    num_batches = len(runner.batches)
    out = run_all(core)
    assert {c.cached_tokens for c in out["second"]} == {32}  # whole pages only
    assert runner.batches[num_batches].spans == [(tuple(second[32:]), 32)]
    assert tokens_of(out["second"]) == reference_tokens(second, greedy(5), 5)
    core.add(req("same", first, greedy(2)))  # all cached but the last token
    out = run_all(core)
    assert out["same"][0].cached_tokens == 36 and runner.batches[-2].spans[0][1] == 39 - 3
    assert tokens_of(out["same"]) == reference_tokens(first, greedy(2), 2)


def test_sliding_window_pages_are_released() -> None:
    core, _ = make_core(page_size=4, windows={"local": 8}, prefill_chunk=8)
    prompt = prompt_of(5, 30)
    core.add(req("s", prompt, greedy(40)))
    used = []
    out: dict = {}
    while core.has_work():
        for c in core.step():
            out.setdefault(c.request_id, []).append(c)
        local = core.pool.groups["local"]
        used.append(local.num_pages - local.num_free)
    assert max(used[:-1]) <= 8 // 4 + 2 + 2  # window + boundary page + chunk pages
    assert tokens_of(out["s"]) == reference_tokens(prompt, greedy(40), 40, {"local": 8})


def test_stats_for_the_dashboard() -> None:
    clock = FakeClock()
    core, _ = make_core(num_pages=100, clock=clock, max_sessions=1, prefill_chunk=8)
    core.add(req("a", prompt_of(1, 12), greedy(5), client="alice"))
    clock.now = 1.0
    core.add(req("b", prompt_of(2, 4), greedy(5), client="bob"))
    clock.now = 3.0
    core.step()  # a: first chunk (costs 2 ms + 8 * 50 us on the fake clock)
    core.step()  # a: last chunk + first token
    stats = core.stats()
    (a, b) = stats.sessions
    assert (a.request_id, a.phase, a.computed_tokens, a.generated_tokens) == ("a", "decode",
                                                                              12, 1)
    assert a.ttft_ms == pytest.approx((3.0 + 2 * 2e-3 + 12 * 5e-5) * 1e3)
    assert (b.phase, b.ttft_ms) == ("waiting", None)
    assert stats.num_waiting == 1
    ((client, waiting, oldest),) = [tuple(c) for c in
                                    ((q.client_id, q.num_waiting, q.oldest_wait_s)
                                     for q in stats.clients)]
    assert (client, waiting) == ("bob", 1) and oldest == pytest.approx(2.0 + 4e-3 + 6e-4)
    (kv,) = stats.kv
    # 12 computed positions = 3 pages of 4; the sampled token gets its page when it runs.
    assert (kv.num_used, kv.num_free) == (3, 97)
    assert stats.last_plan.rows[0] == ("a", "prefill", 4) and stats.num_steps == 2


def test_prompt_is_cached_when_its_prefill_ends() -> None:
    # A request sharing the prompt hits while the first one still decodes, and with a
    # sliding group the same prompt is still matchable (the window before its boundary).
    core, runner = make_core(page_size=4, windows={"local": 6}, prefill_chunk=8)
    prompt = prompt_of(4, 30)
    core.add(req("first", prompt, greedy(30)))
    while core.scheduler.seqs["first"].num_output < 3:
        core.step()
    core.add(req("again", prompt, greedy(4)))
    out = run_all(core)
    assert out["again"][0].cached_tokens == 28  # (30 - 1) // 4 whole pages
    assert tokens_of(out["again"]) == reference_tokens(prompt, greedy(4), 4, {"local": 6})
    rest = reference_tokens(prompt, greedy(30), 30, {"local": 6})[3:]  # 3 streamed before
    assert tokens_of(out["first"]) == rest


def test_default_max_tokens_is_bounded_by_the_pool() -> None:
    core, _ = make_core(num_pages=10, page_size=4, context=4096)
    core.add(req("a", prompt_of(1, 30), SamplingParams(temperature=0.0, ignore_eos=True)))
    out = run_all(core)
    assert out["a"][-1].completion_tokens == 40 - 30  # 10 pages of 4 tokens
    assert out["a"][-1].finish_reason == "length"
    with pytest.raises(OutOfKVPages):  # a prompt the pool cannot hold: this request fails
        core.add(req("b", prompt_of(2, 45), SamplingParams(temperature=0.0)))
