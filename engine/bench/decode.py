"""`mbufo bench decode`: throughput and smoothness of N concurrent decodes.

At each concurrency level N, N short distinct prompts are sent at once, each for exactly
`tokens` tokens (greedy, ignore_eos). Reported per level: total tok/s (all completion
tokens over the wall time from the first send to the last token), per-session tok/s
(the mean over requests of (tokens - 1) / (last token - first token): the rate one user
sees), ITL mean/p95/max over every request's inter-token intervals, and TTFT mean/max.
A serial target (llama-cpp-python) runs the same requests one after another.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from engine.bench.prompts import PromptFactory
from engine.bench.report import format_table, latency_ms, mean, ms
from engine.bench.target import RequestResult, Target

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
Progress = Callable[[str], None]


def summarize_level(concurrency: int, results: Sequence[RequestResult],
                    start: float) -> dict[str, Any]:
    """One level's figures from its requests; `start` is when the first one was sent."""
    end = max(r.last_token_time for r in results)
    completion = sum(r.completion_tokens for r in results)
    rates = [(len(r.token_times) - 1) / (r.last_token_time - r.first_token_time)
             for r in results if len(r.token_times) > 1 and r.last_token_time > r.first_token_time]
    itls = [itl for r in results for itl in r.itls_s()]
    return {
        "concurrency": concurrency,
        "completion_tokens": completion,
        "wall_s": round(end - start, 4),
        "total_tok_s": round(completion / (end - start), 2),
        "per_session_tok_s": round(mean(rates), 2) if rates else None,
        "itl_ms": latency_ms(itls),
        "ttft_ms": {"mean": ms(mean([r.ttft_s for r in results])),
                    "max": ms(max(r.ttft_s for r in results))},
        "finish_reasons": dict(Counter(r.finish_reason or "none" for r in results)),
    }


async def run_decode(target: Target, factory: PromptFactory,
                     concurrency: Sequence[int] = DEFAULT_CONCURRENCY, tokens: int = 64,
                     prompt_tokens: int = 24,
                     progress: Progress = log.info) -> list[dict[str, Any]]:
    """One summary per level, in the order given. A short warm-up request runs first."""
    await target.complete(factory.make(prompt_tokens), 4, client="warmup")
    levels = []
    for n in concurrency:
        progress(f"decode [{target.name}] concurrency {n}: {n} x {tokens} tokens")
        prompts = [factory.make(prompt_tokens) for _ in range(n)]
        tasks = [target.complete(p, tokens, client=f"decode-{i}") for i, p in enumerate(prompts)]
        results = await asyncio.gather(*tasks)
        level = summarize_level(n, results, min(r.sent for r in results))
        if level["completion_tokens"] < n * tokens:
            progress(f"  only {level['completion_tokens']} of {n * tokens} tokens came back "
                     f"(finish reasons {level['finish_reasons']}): the target ignores "
                     "ignore_eos or cut requests off")
        progress(f"  {level['total_tok_s']} tok/s total, {level['per_session_tok_s']} per "
                 f"session, ITL mean {level['itl_ms']['mean']} ms")
        levels.append(level)
    return levels


def decode_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """results: target name -> levels."""
    headers = ["target", "conc", "total tok/s", "tok/s/session", "ITL mean ms", "ITL p95 ms",
               "ITL max ms", "TTFT mean ms"]
    rows = []
    for name, levels in results.items():
        for lv in levels:
            rows.append([name, lv["concurrency"], lv["total_tok_s"], lv["per_session_tok_s"],
                         lv["itl_ms"]["mean"], lv["itl_ms"]["p95"], lv["itl_ms"]["max"],
                         lv["ttft_ms"]["mean"]])
    return format_table(headers, rows)
