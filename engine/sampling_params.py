"""SamplingParams: the one place sampling options live (DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Grammar(Protocol):
    """Constrains sampling: a per-step mask of allowed ids, advanced by accepted tokens."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool: ids the grammar allows next."""

    def accept(self, token_id: int) -> None:
        """Advance the grammar state by one sampled token."""

    def is_finished(self) -> bool:
        """True when the grammar accepts the text so far as complete."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None
    # (token id, bias) pairs added to the logits before every draw (OpenAI's logit_bias:
    # +-100 allows or bans a token); logprobs still come from the raw logits
    logit_bias: tuple[tuple[int, float], ...] = ()
    # logprobs of the prompt's tokens (each given the ones before it), with this many top
    # alternatives; None: not computed. Its prefill skips the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1
