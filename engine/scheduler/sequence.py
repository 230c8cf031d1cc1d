"""Sequence: the live state of one request, from submit to finish.

Tokens: `token_ids` = prompt + output. Positions [0, num_computed) have their KV written
(whole pages of a prefix-cache hit count as computed). While decoding, the last token is
the only one not computed yet: num_computed == num_tokens - 1. A preempted sequence keeps
its tokens, sampler, stop and detokenizer state and is recomputed from position 0 (or a
cache hit): its prefill then covers prompt + output, and it continues where it stopped.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Protocol

from engine.kv.pool import SeqPages
from engine.kv.radix import RadixNode
from engine.sampler import SamplerState, TokenLogprobs
from engine.scheduler.request import OutputChunk, Request
from engine.stop import StopChecker

ITL_SAMPLES = 64  # inter-token gaps kept per sequence for the dashboard
# Prefill chunk of a sequence that wants its prompt's logprobs: every token of a chunk
# needs its logits, (chunk, vocab) floats (128 x 262144: 134 MB)
PROMPT_LOGPROBS_CHUNK = 128


class Detokenizer(Protocol):
    """What the engine needs from engine.tokenizer.IncrementalDetokenizer."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


DetokenizerFactory = Callable[[], Detokenizer]


class Phase(enum.Enum):
    WAITING = "waiting"  # queued for a session slot
    PREFILL = "prefill"  # resident, prompt (or recompute) not fully computed
    DECODE = "decode"  # resident, one token per step
    PREEMPTED = "preempted"  # pages given up, queued at the head for recompute
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, seq_no: int, max_tokens: int, sampler: SamplerState,
                 stop: StopChecker, detok: Detokenizer, now: float) -> None:
        self.request = request
        self.seq_no = seq_no  # submit order: FIFO ties and victim order
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt = len(request.prompt_ids)
        self.max_tokens = max_tokens  # effective limit on output tokens
        self.num_computed = 0
        self.num_cached = 0  # prefix-cache hit at first admission (reported in usage)
        self.phase = Phase.WAITING
        self.pages: SeqPages | None = None
        self.radix_node: RadixNode | None = None  # locked prefix-cache match
        self.sampler = sampler
        self.stop = stop
        self.detok = detok
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.is_admitted = False  # admitted at least once
        # Timings on the engine clock (seconds).
        self.arrival_time = now
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.itl: deque[float] = deque(maxlen=ITL_SAMPLES)
        # Output gathered during a step, handed out by take_output().
        self._out_ids: list[int] = []
        self._out_text: list[str] = []
        self._out_logprobs: list[TokenLogprobs | None] = []
        # SamplingParams.prompt_logprobs: entry p for prompt token p, set by position (a
        # recompute after preemption before they were sent overwrites, never appends);
        # None once sent, so a later recompute computes no more of them
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if request.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def max_chunk(self) -> int:
        """The most tokens of this sequence one prefill step may take."""
        return PROMPT_LOGPROBS_CHUNK if self.prompt_logprobs is not None else 1 << 62

    @property
    def num_remaining(self) -> int:
        """Output tokens still allowed."""
        return self.max_tokens - self.num_output

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def rank(self) -> tuple[int, float, int]:
        """Higher keeps its pages longer: higher priority, then earlier arrival."""
        return (self.request.priority, -self.request.arrival, -self.seq_no)

    def append(self, token_id: int, logprob: TokenLogprobs | None, now: float) -> bool:
        """Append a sampled token (already recorded in the sampler state); returns True when
        the sequence finished with it."""
        self.token_ids.append(token_id)
        if self.phase is Phase.PREFILL:
            self.phase = Phase.DECODE
        if self.last_token_time is not None:
            self.itl.append(now - self.last_token_time)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        update = self.stop.feed(token_id, self.detok.push(token_id))
        text, reason = update.text, update.finish_reason
        grammar = self.request.sampling.grammar
        if reason is None and grammar is not None and grammar.is_finished():
            reason = "stop"
            text += self.stop.flush()
        if reason is not None and reason != "stop":
            text += self.stop.flush() + self.detok.flush()
        self._out_ids.append(token_id)
        self._out_text.append(text)
        self._out_logprobs.append(logprob)
        if reason is not None:
            self.finish_reason = reason
        return reason is not None

    def finish_abort(self) -> None:
        """Finish without a sampled token; held-back text is released."""
        self._out_text.append(self.stop.flush() + self.detok.flush())
        self.finish_reason = "abort"
        self.phase = Phase.FINISHED

    def has_output(self) -> bool:
        return bool(self._out_ids) or self.finish_reason is not None

    def take_output(self) -> OutputChunk:
        """The tokens and text gathered since the last call, as one chunk."""
        want_logprobs = self.request.sampling.logprobs is not None
        prompt = None
        if self.prompt_logprobs is not None:  # with the first token (or the end)
            prompt, self.prompt_logprobs = tuple(self.prompt_logprobs), None
        chunk = OutputChunk(
            request_id=self.request.id,
            token_ids=tuple(self._out_ids),
            text="".join(self._out_text),
            logprobs=tuple(self._out_logprobs) if want_logprobs else None,
            finish_reason=self.finish_reason,
            prompt_tokens=self.num_prompt,
            cached_tokens=self.num_cached,
            completion_tokens=self.num_output,
            prompt_logprobs=prompt,
        )
        self._out_ids, self._out_text, self._out_logprobs = [], [], []
        return chunk
