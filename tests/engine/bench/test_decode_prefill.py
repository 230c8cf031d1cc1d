"""decode and prefill bookkeeping on scripted results, checked against hand arithmetic."""

from __future__ import annotations

import asyncio

import pytest
from bench_fakes import ScriptedTarget, result

from engine.bench.decode import decode_table, run_decode, summarize_level
from engine.bench.prefill import prefill_table, run_prefill
from engine.bench.prompts import PromptFactory
from engine.errors import EngineError


def _two_requests():
    a = result(0, [0.100, 0.110, 0.120, 0.130])
    b = result(0, [0.150, 0.170, 0.190, 0.210])
    return a, b


def test_level_summary_by_hand():
    level = summarize_level(2, _two_requests(), start=0.0)
    assert level["completion_tokens"] == 8
    assert level["wall_s"] == pytest.approx(0.21)
    assert level["total_tok_s"] == pytest.approx(8 / 0.21, abs=0.01)
    assert level["per_session_tok_s"] == pytest.approx((3 / 0.03 + 3 / 0.06) / 2, abs=0.01)
    # ITLs 10, 10, 10, 20, 20, 20 ms: p95 rank 4.75 lies between two 20s
    assert level["itl_ms"] == pytest.approx({"mean": 15.0, "p95": 20.0, "max": 20.0})
    assert level["ttft_ms"] == pytest.approx({"mean": 125.0, "max": 150.0})
    assert level["finish_reasons"] == {"length": 2}


def test_run_decode_sends_distinct_prompts_per_level():
    levels = (1, 2)
    script = {"warmup": [result(0, [0.01])], "decode-0": [], "decode-1": []}
    for n in levels:
        reqs = _two_requests()
        for i in range(n):
            script[f"decode-{i}"].append(reqs[i])
    target = ScriptedTarget(script)
    out = asyncio.run(run_decode(target, PromptFactory(3, target.tokenizer), levels,
                                 tokens=4, prompt_tokens=24, progress=lambda _m: None))
    assert [lv["concurrency"] for lv in out] == [1, 2]
    assert out[0]["completion_tokens"] == 4 and out[1]["completion_tokens"] == 8
    sent = [p for c in ("decode-0", "decode-1") for p, _ in target.calls[c]]
    assert all(len(p.ids) == 24 for p in sent) and len({p.ids for p in sent}) == 3
    assert {m for c in ("decode-0", "decode-1") for _, m in target.calls[c]} == {4}
    table = decode_table({"scripted": out})
    assert len(table.splitlines()) == 4


def test_prefill_rate_and_cache_check():
    script = {"warmup": [result(0, [0.01])],
              "prefill": [result(0, [0.25], prompt_tokens=512),
                          result(0, [0.05], prompt_tokens=128, cached=None)]}
    target = ScriptedTarget(script)
    rows = asyncio.run(run_prefill(target, PromptFactory(5, target.tokenizer), (512, 128),
                                   progress=lambda _m: None))
    assert rows[0] == {"length": 512, "prompt_tokens": 512, "ttft_ms": 250.0,
                       "tok_s": 2048.0, "cached_tokens": 0}
    assert rows[1]["tok_s"] == pytest.approx(2560.0) and rows[1]["cached_tokens"] is None
    assert [m for _, m in target.calls["prefill"]] == [1, 1]
    assert [len(p.ids) for p, _ in target.calls["prefill"]] == [512, 128]
    assert "unknown" in prefill_table({"scripted": rows})

    hit = ScriptedTarget({"warmup": [result(0, [0.01])],
                          "prefill": [result(0, [0.1], prompt_tokens=512, cached=496)]})
    with pytest.raises(EngineError, match="496 cached"):
        asyncio.run(run_prefill(hit, PromptFactory(5, hit.tokenizer), (512,),
                                progress=lambda _m: None))


class NoUsageTarget(ScriptedTarget):
    """A server that streams no usage (llama-cpp-python's) and no tokenizer here."""

    def __init__(self, script):
        super().__init__(script)
        self.tokenizer = None
        self.counted: list[str] = []

    async def count_tokens(self, text: str) -> int:
        self.counted.append(text)
        return 1 + 2 * len(text.split())


def test_prefill_asks_a_server_without_usage_for_the_count():
    target = NoUsageTarget({"warmup": [result(0, [0.01], prompt_tokens=None)],
                            "prefill": [result(0, [0.5], prompt_tokens=None, cached=None)]})
    factory = asyncio.run(PromptFactory.for_target(target, seed=4))
    assert factory.tokens_per_word == pytest.approx(801 / 400)
    (row,) = asyncio.run(run_prefill(target, factory, (300,), progress=lambda _m: None))
    ((prompt, _),) = target.calls["prefill"]
    assert target.counted[-1] == prompt.text
    words = len(prompt.text.split())
    assert words == round(300 / (801 / 400))
    assert row["prompt_tokens"] == 1 + 2 * words
    assert row["tok_s"] == pytest.approx((1 + 2 * words) / 0.5, abs=0.05)
    assert row["cached_tokens"] is None
