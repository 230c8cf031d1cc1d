"""The serving engine on the real default model: batch invariance, greedy determinism,
prefix cache, memory pressure and the scheduler's step shapes under a long prefill."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.batch import ForwardBatch
from engine.build import EngineOptions, build_engine
from engine.kv.pool import SeqPages
from engine.llm import LLM
from engine.loader import load
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.scheduler.request import Request

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load("default")


def _tables(seqs: list[SeqPages], groups) -> dict[str, list[list[int]]]:
    return {g: [s.table(g) for s in seqs] for g in groups}


@pytest.mark.parametrize("kv_quant", ["f16", "q8"])
def test_row_logits_are_bit_equal_whatever_shares_the_batch(loaded, kv_quant):
    runner = ModelRunner(loaded.model, 64, 16, kv_quant)
    groups = list(runner.pool.groups)
    tok = loaded.tokenizer
    a_ids = tok.encode("The lighthouse keeper climbed the stairs and")
    b_ids = tok.encode("Water boils at")
    c_ids = tok.encode("A long prompt that is being prefilled in chunks " * 6)
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    for seq, ids in zip(seqs[:2], (a_ids, b_ids), strict=True):
        seq.ensure(len(ids) + 1)
        runner.forward(ForwardBatch.build([(ids, 0)], _tables([seq], groups)))
    seqs[2].ensure(len(c_ids))
    a_next, b_next = 1234, 5678
    alone = runner.forward(ForwardBatch.build([([a_next], len(a_ids))],
                                              _tables(seqs[:1], groups)))
    # a decode row beside another decode and a prefill chunk (all rows' logits requested)
    mixed = ForwardBatch.build(
        [([b_next], len(b_ids)), (c_ids, 0), ([a_next], len(a_ids))],
        _tables([seqs[1], seqs[2], seqs[0]], groups),
        logits_rows=[0, len(c_ids), len(c_ids) + 1])
    together = runner.forward(mixed)
    assert torch.equal(alone[0], together[2])
    two = runner.forward(ForwardBatch.build([([a_next], len(a_ids)), ([b_next], len(b_ids))],
                                            _tables(seqs[:2], groups)))
    assert torch.equal(alone[0], two[0])
    assert torch.equal(together[0], two[1])


def test_greedy_tokens_identical_alone_and_among_others(loaded):
    engine = build_engine("default", EngineOptions(sessions=4, context=512), loaded=loaded)
    try:
        prompts = ["The capital of France is", "def add(a, b):", "Once upon a time",
                   "The three primary colors are"]
        ids = [tuple(loaded.tokenizer.encode(p)) for p in prompts]
        solo = [_collect(engine, Request(f"solo{i}", p, GREEDY)) for i, p in enumerate(ids)]
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = _collect(engine, Request(f"batch{i}", ids[i], GREEDY))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert [results[i] for i in range(len(ids))] == solo
    finally:
        engine.stop()


def _collect(engine, request: Request) -> list[int]:
    out: list[int] = []
    for chunk in engine.stream(request, timeout=600):
        out.extend(chunk.token_ids)
    return out


def test_second_turn_hits_prefix_cache(loaded):
    engine = build_engine("default", EngineOptions(sessions=2, context=1024), loaded=loaded)
    try:
        tpl = loaded.chat_template
        turn1 = [{"role": "user", "content": "Tell me about lighthouses and their keepers. " * 8}]
        ids1 = loaded.tokenizer.encode(tpl.render(turn1), add_special=False)
        reply: list[int] = []
        for chunk in engine.stream(Request("t1", tuple(ids1), GREEDY), timeout=600):
            reply.extend(chunk.token_ids)
        ids2 = list(ids1) + reply + loaded.tokenizer.encode(
            "<end_of_turn>\n<start_of_turn>user\nAnd who was Fresnel?<end_of_turn>\n"
            "<start_of_turn>model\n", add_special=False, parse_special=True)
        chunks = list(engine.stream(Request("t2", tuple(ids2), GREEDY), timeout=600))
        shared = len(ids1) + len(reply)
        assert chunks[-1].cached_tokens >= 0.9 * shared - 16, (chunks[-1].cached_tokens, shared)
        assert chunks[-1].prompt_tokens == len(ids2)
    finally:
        engine.stop()


def test_memory_pressure_evicts_and_recomputes(loaded):
    """A pool far smaller than the sessions need: every request completes, output equal to
    the request run alone (evict-and-recompute, not failure)."""
    llm_solo = {}
    prompts = [f"Story number {i}: the fox and the" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True)
    engine = build_engine("default", EngineOptions(sessions=4, context=128,
                                                   prefix_cache_fraction=-0.5),
                          loaded=loaded)
    try:
        full = engine.core.pool.groups["full"].num_pages
        assert full < 4 * 5  # 4 sessions of ~65 tokens need 5 pages each
        for i, p in enumerate(prompts):
            llm_solo[i] = _collect(engine, Request(f"s{i}", tuple(loaded.tokenizer.encode(p)),
                                                   params))
        engine.core.radix.reset()  # idle engine: the batch below must recompute, not hit
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = _collect(engine, Request(
                f"p{i}", tuple(loaded.tokenizer.encode(prompts[i])), params))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        assert results == llm_solo
        assert engine.core.stats().num_preemptions > 0
    finally:
        engine.stop()


def test_llm_driver_matches_engine(loaded):
    llm = LLM.__new__(LLM)  # reuse the loaded weights through the public driver path
    llm.loaded, llm.context, llm.prefill_chunk = loaded, 512, 512
    llm.runner = ModelRunner(loaded.model, 32)
    from engine.sampler import Sampler

    llm.sampler = Sampler()
    ids = loaded.tokenizer.encode("The capital of France is")
    via_llm = [s.token_id for s in llm.generate(ids, GREEDY)]
    engine = build_engine("default", EngineOptions(sessions=1, context=512), loaded=loaded)
    try:
        assert _collect(engine, Request("x", tuple(ids), GREEDY)) == via_llm
    finally:
        engine.stop()
