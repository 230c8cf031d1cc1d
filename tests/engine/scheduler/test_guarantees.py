"""The scheduler's six guarantees (DESIGN.md), one test each, on the KV-checking fake runner."""

from __future__ import annotations

import math

import pytest
from sched_fakes import (
    greedy,
    make_core,
    plan_rows,
    prompt_of,
    reference_tokens,
    req,
    run_all,
    tokens_of,
)

from engine.errors import ClientQuotaExceeded


def _start_decoders(core, num: int, max_tokens: int = 200) -> list[str]:
    ids = [f"d{i}" for i in range(num)]
    for i, rid in enumerate(ids):
        core.add(req(rid, prompt_of(i, 6), greedy(max_tokens)))
    while {r for r, k, _ in plan_rows_or_empty(core) if k == "decode"} != set(ids):
        core.step()
    return ids


def plan_rows_or_empty(core):
    return plan_rows(core) if core.scheduler.last_plan else []


def test_guarantee_1_due_decoder_never_waits_behind_prefill() -> None:
    core, runner = make_core(num_pages=1024, prefill_chunk=64, max_sessions=4)
    decoders = _start_decoders(core, 3)
    core.add(req("long", prompt_of(9, 1000), greedy(2)))
    prefill_steps = 0
    while "long" in core.scheduler.seqs and core.scheduler.seqs["long"].num_output == 0:
        before = {d: core.scheduler.seqs[d].num_output for d in decoders}
        core.step()
        rows = plan_rows(core)
        prefill = [r for r in rows if r[1] == "prefill"]
        assert len(prefill) <= 1
        prefill_steps += bool(prefill)
        # Every decoder ran in the very step that carried the prefill chunk.
        assert {r for r, k, _ in rows if k == "decode"} == set(decoders)
        assert all(core.scheduler.seqs[d].num_output == before[d] + 1 for d in decoders)
        # ... and in the same forward: one batch holds every row.
        spans = runner.batches[-1].spans
        assert len(spans) == len(rows) and sorted(len(t) for t, _ in spans)[:3] == [1, 1, 1]
    assert prefill_steps == math.ceil(1000 / 64)


@pytest.mark.parametrize("mixed", [True, False])
def test_guarantee_2_decoders_due_again_after_every_prefill_step(mixed: bool) -> None:
    core, _ = make_core(prefill_chunk=32, max_sessions=4, mixed_batch=mixed)
    decoders = _start_decoders(core, 2)
    core.add(req("p1", prompt_of(7, 150), greedy(3)))
    core.add(req("p2", prompt_of(8, 90), greedy(3)))
    history = []
    for _ in range(40):
        core.step()
        history.append(plan_rows(core))
    prefill_steps = 0
    for rows, next_rows in zip(history, history[1:], strict=False):
        if any(k == "prefill" for _, k, _ in rows):
            prefill_steps += 1
            assert set(decoders) <= {r for r, k, _ in next_rows if k == "decode"}
            # one step's prefill (one or several prompts) stays within the chunk budget
            assert sum(n for _, k, n in rows if k == "prefill") <= 32
            if not mixed:  # plain alternation: a prefill step carries no decode row
                assert all(k == "prefill" for _, k, _ in rows)
    assert prefill_steps >= math.ceil(150 / 32) + math.ceil(90 / 32)


def test_guarantee_3_chunk_is_bounded() -> None:
    core, runner = make_core(prefill_chunk=32)
    core.add(req("a", prompt_of(1, 300), greedy(2)))
    core.add(req("b", prompt_of(2, 70), greedy(2)))
    out = run_all(core)
    prefill = [len(t) for b in runner.batches for t, _ in b.spans if len(t) > 1]
    assert max(prefill) <= 32
    assert sum(prefill) == 370 and len(prefill) == math.ceil(300 / 32) + math.ceil(70 / 32)
    assert all(len(b.spans) <= 2 for b in runner.batches)  # one chunk + at most one decoder
    assert tokens_of(out["a"]) == reference_tokens(prompt_of(1, 300), greedy(2), 2)


def test_guarantee_4_decode_queue_rotates() -> None:
    core, _ = make_core(max_sessions=3, max_decode_rows=2)
    for i in range(3):
        core.add(req(f"s{i}", prompt_of(i, 4), greedy(100)))
    while len(core.scheduler.decode_queue) < 3:
        core.step()
    counts = dict.fromkeys(["s0", "s1", "s2"], 0)
    heads = []
    for _ in range(30):
        core.step()
        rows = plan_rows(core)
        assert len(rows) == 2
        heads.append(rows[0][0])
        for rid, _, _ in rows:
            counts[rid] += 1
    assert set(counts.values()) == {20}  # 60 rows shared equally
    assert all(a != b for a, b in zip(heads, heads[1:], strict=False))  # no fixed head
    assert set(heads) == {"s0", "s1", "s2"}


def test_guarantee_5_client_quota_and_admission_rotates() -> None:
    core, _ = make_core(max_sessions=1, max_pending_per_client=20)
    for i in range(20):
        core.add(req(f"h{i}", prompt_of(i, 4), greedy(2), client="heavy"))
    with pytest.raises(ClientQuotaExceeded) as err:
        core.add(req("h20", prompt_of(20, 4), greedy(2), client="heavy"))
    assert err.value.code == "client_quota" and "20" in str(err.value)
    for name in ("l0", "l1", "l2"):
        core.add(req(name, prompt_of(50, 4), greedy(2), client=name))  # other clients: fine
    admitted = []
    while core.has_work():
        core.step()
        admitted += core.scheduler.last_plan.admitted
    assert set(admitted[:4]) == {"h0", "l0", "l1", "l2"}
    assert admitted[4:] == [f"h{i}" for i in range(1, 20)]  # FIFO within a client
    core.add(req("h20", prompt_of(20, 4), greedy(2), client="heavy"))  # room again


class _Oracle:
    """Proposes what the fake model will say (right drafts), or garbage, or fails."""

    def __init__(self, mode: str) -> None:
        self.mode, self.calls = mode, 0

    def propose(self, token_ids, max_tokens):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("draft model crashed")
        if self.mode == "wrong":
            right = reference_tokens(token_ids, greedy(max_tokens), max_tokens)
            return [(t + 1) % 64 for t in right]
        if self.mode == "out_of_vocab":
            return [10_000]
        # The model's own continuation; the oracle works on prompt + output, like a
        # real draft source, and is right only as far as the greedy path goes.
        return reference_tokens(token_ids, greedy(max_tokens), max_tokens)


@pytest.mark.parametrize("mode", ["right", "wrong", "raise", "out_of_vocab"])
def test_guarantee_6_verify_rows_degrade_on_their_own(mode: str) -> None:
    oracle = _Oracle(mode)
    core, runner = make_core(max_sessions=3, draft_source=oracle)
    prompts = {f"r{i}": prompt_of(30 + i, 5 + 3 * i) for i in range(3)}
    for rid, p in prompts.items():
        core.add(req(rid, p, greedy(17)))
    out = run_all(core)
    for rid, p in prompts.items():
        assert tokens_of(out[rid]) == reference_tokens(p, greedy(17), 17)
        assert out[rid][-1].completion_tokens == 17
    assert oracle.calls > 0
    verify_spans = [len(t) for b in runner.batches[3:] for t, _ in b.spans]
    if mode == "right":  # up to 5 tokens per step: far fewer steps than tokens
        assert len(runner.batches) < 17 and 5 in verify_spans
    else:  # every row fell back to (or was rejected down to) one token a step
        assert len(runner.batches) >= 17
        assert (5 in verify_spans) == (mode == "wrong")  # rejected rows still ran
