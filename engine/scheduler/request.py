"""Request (what was asked) and OutputChunk (what submit() yields), as DESIGN.md fixes them."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    client_id: str = "local"
    priority: int = 0
    arrival: float = 0.0


@dataclass(frozen=True, slots=True)
class OutputChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which
    # has no context), in the chunk of the first sampled token
    prompt_logprobs: tuple | None = None
