"""Fakes for the benchmark tests: a word tokenizer and a target that replays scripted
results (a virtual timeline: the scenario reads only the times the target reports)."""

from __future__ import annotations

import zlib
from collections import defaultdict, deque

from engine.bench.target import Prompt, RequestResult, Target

BOS = 1


class WordTokenizer:
    """Each word is 1 + len(word) // 4 tokens (so prompts must be cut mid-word), BOS first."""

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ids = [BOS] if add_special else []
        for word in text.split():
            base = 2 + zlib.crc32(word.encode()) % 100_000_000
            ids += [base + i for i in range(1 + len(word) // 4)]
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return " ".join(str(i) for i in ids if not (skip_special and i == BOS))


def timeline(first_ms: int, count: int, step_ms) -> list[float]:
    """Token times in seconds: first at first_ms, then step_ms(previous_ms) apart."""
    times, t = [], first_ms
    for _ in range(count):
        times.append(t / 1000)
        t += step_ms(t)
    return times


def result(sent_ms: float, token_times: list[float], *, prompt_tokens: int | None = 10,
           cached: int | None = 0) -> RequestResult:
    return RequestResult("r", sent_ms / 1000, list(token_times), prompt_tokens, cached,
                         len(token_times), "length")


class ScriptedTarget(Target):
    """Pops the next scripted result for a call's client role ("stream-0" -> "stream-0",
    "warmup", "short", "long", ...) and records every call."""

    def __init__(self, script: dict[str, list[RequestResult]], tokenizer=None,
                 cache_slack: int = 0) -> None:
        self.name = "scripted"
        self.script = {k: deque(v) for k, v in script.items()}
        self.calls: dict[str, list[tuple[Prompt, int]]] = defaultdict(list)
        self.tokenizer = tokenizer if tokenizer is not None else WordTokenizer()
        self.cache_slack = cache_slack

    async def complete(self, prompt: Prompt, max_tokens: int, *,
                       client: str = "bench", first_token=None) -> RequestResult:
        self.calls[client].append((prompt, max_tokens))
        if first_token is not None:
            first_token.set()
        return self.script[client].popleft()


def parse_cli(argv: list[str]):
    """`mbufo` argv -> Namespace, with only the bench command registered."""
    import argparse

    from appliance.cli import bench_command

    parser = argparse.ArgumentParser(prog="mbufo")
    bench_command.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
