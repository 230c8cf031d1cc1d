"""`mbufo bench prefill`: prompt processing speed by prompt length.

Each measurement is one fresh salted prompt of the given length with max_tokens 1, so the
prefix cache cannot help (checked: a reported cache hit fails the run); speed is prompt
tokens / TTFT. With `repeats` > 1 the medians over fresh prompts are taken. A server that
streams no usage (llama-cpp-python's) is asked for the prompt's token count afterwards.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from engine.bench.prompts import PromptFactory
from engine.bench.report import format_table, ms
from engine.bench.target import Prompt, RequestResult, Target
from engine.errors import EngineError

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = (128, 512, 2048)
Progress = Callable[[str], None]


def check_fresh(result: RequestResult, what: str, slack: int = 0) -> bool:
    """True if the target reported no prefix-cache hit, False if it did not say; raises if
    it did report one (beyond `slack` tokens, for token-granular caches that count the BOS
    and a shared leading sub-word of otherwise unrelated prompts)."""
    if result.cached_tokens is None:
        return False
    if result.cached_tokens > slack:
        raise EngineError(
            f"{what}: the target reports {result.cached_tokens} cached prompt tokens for a "
            f"fresh prompt of {result.prompt_tokens}; the measurement would be meaningless")
    return True


async def prompt_tokens(target: Target, prompt: Prompt, result: RequestResult) -> int:
    """What the target counted; a server that streams no usage is asked afterwards."""
    if result.prompt_tokens is not None:
        return result.prompt_tokens
    if prompt.ids is not None:
        return len(prompt.ids)
    result.prompt_tokens = await target.count_tokens(prompt.text)
    return result.prompt_tokens


async def run_prefill(target: Target, factory: PromptFactory,
                      lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 1,
                      progress: Progress = log.info) -> list[dict[str, Any]]:
    slack = target.cache_slack
    await target.complete(factory.make(min(64, min(lengths))), 1, client="warmup")
    rows = []
    for length in lengths:
        runs = []
        for _ in range(repeats):
            prompt = factory.make(length)
            result = await target.complete(prompt, 1, client="prefill")
            await prompt_tokens(target, prompt, result)
            runs.append(result)
        known = [check_fresh(r, f"prefill {length}", slack) for r in runs]
        ttft = statistics.median(r.ttft_s for r in runs)
        tokens = round(statistics.median(r.prompt_tokens for r in runs))
        rate = statistics.median(r.prompt_tokens / r.ttft_s for r in runs)
        row = {"length": length, "prompt_tokens": tokens, "ttft_ms": ms(ttft),
               "tok_s": round(rate, 1),
               "cached_tokens": runs[0].cached_tokens if all(known) else None}
        progress(f"prefill [{target.name}] {tokens} tokens: {row['tok_s']} tok/s "
                 f"(TTFT {row['ttft_ms']} ms)")
        rows.append(row)
    return rows


def prefill_table(results: dict[str, list[dict[str, Any]]]) -> str:
    headers = ["target", "prompt tokens", "TTFT ms", "tok/s", "cached"]
    rows = [[name, r["prompt_tokens"], r["ttft_ms"], r["tok_s"],
             "unknown" if r["cached_tokens"] is None else r["cached_tokens"]]
            for name, runs in results.items() for r in runs]
    return format_table(headers, rows)
