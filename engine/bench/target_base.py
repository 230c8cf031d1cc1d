"""The `Target` contract of engine/bench/target.py and the values a request goes in and comes
out as: a `Prompt` and a `RequestResult` (the send time and the arrival time of every token
event), from which the benchmarks compute TTFT and inter-token latencies.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError

__all__ = ["Prompt", "RequestResult", "Target", "common_prefix_len", "new_request_id"]

_ids = itertools.count()


def new_request_id(prefix: str) -> str:
    """A request id unique across this process and its siblings (the pid is part of it)."""
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    ids: tuple[int, ...] | None = None  # exact token ids (BOS included) when known


@dataclass(slots=True)
class RequestResult:
    request_id: str
    sent: float  # time.perf_counter() when the request left
    token_times: list[float] = field(default_factory=list)  # arrival of each token event
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # None: the target did not say (unknown, not 0)
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def first_token_time(self) -> float:
        if not self.token_times:
            raise EngineError(f"request {self.request_id} produced no token")
        return self.token_times[0]

    @property
    def last_token_time(self) -> float:
        return self.token_times[-1] if self.token_times else self.first_token_time

    @property
    def ttft_s(self) -> float:
        return self.first_token_time - self.sent

    def intervals(self) -> list[tuple[float, float]]:
        """(start, end) of every inter-token interval, in order."""
        return list(itertools.pairwise(self.token_times))

    def itls_s(self) -> list[float]:
        return [end - start for start, end in self.intervals()]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Target(ABC):
    """Contract: `complete` sends one greedy request (temperature 0, ignore_eos, max_tokens),
    waits until it finishes and returns its timings (setting `first_token`, if given, when
    the first token arrives); calls may overlap unless `is_serial`.
    `tokenizer`, when not None, encodes text exactly as the target does, so prompts can be
    built to an exact token count; otherwise `count_tokens` asks the target."""

    name: str = "target"
    is_serial: bool = False
    tokenizer: Any = None
    # Cached prompt tokens a fresh prompt may still report: 0 for page-granular caches
    # (mbufo); token-granular ones (llama.cpp) count the shared BOS and, rarely, a shared
    # leading sub-word of otherwise unrelated prompts. More than this fails a benchmark.
    cache_slack: int = 0

    @abstractmethod
    async def complete(self, prompt: Prompt, max_tokens: int, *,
                       client: str = "bench",
                       first_token: asyncio.Event | None = None) -> RequestResult: ...

    async def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            raise NotImplementedError
        return len(self.tokenizer.encode(text, add_special=True, parse_special=False))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def itl_target_ms(self) -> float | None:
        """The ITL target the target's scheduler works to, when it says (mbufo in-process)."""
        return None

    def slow_steps(self) -> list[dict[str, Any]] | None:
        """The target's latest steps over its ITL target (engine.scheduler.plan.SlowStep as
        dicts, `at_s` on time.perf_counter's clock), when it says (mbufo in-process)."""
        return None

    async def aclose(self) -> None:
        return None
