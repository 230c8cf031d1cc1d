"""Sampler: one logits row per sequence -> one token, each row with its own SamplingParams.

The chain, per row (vLLM's order where vLLM and llama.cpp differ on temperature, llama.cpp's
filter order top-k -> top-p -> min-p):
  1. repetition_penalty over ids seen in prompt + output (CTRL, arXiv:1909.05858): a
     positive logit is divided by the penalty, a negative one multiplied (vLLM, llama.cpp).
  2. frequency/presence penalties over output ids only (OpenAI): l -= f * count + p * [count>0].
  3. temperature: l / T (vLLM; llama.cpp's default chain scales after its filters).
  4. top-k: exactly the k highest, ties to the lower id (llama.cpp keeps exactly k).
  5. top-p: the shortest prefix of the descending distribution (after top-k, renormalised)
     whose mass reaches top_p; the token that crosses top_p is kept.
  6. min-p: keep p_i >= min_p * p_max. The ratio to the max does not change when top-k/top-p
     renormalise, so this is a threshold on the scaled logits.
  7. draw: one float64 uniform from the sequence's own CPU generator, inverse CDF over the
     kept weights in id order. A row's draw depends only on its logits and its generator,
     never on the other rows, and a seeded row gives the same tokens on CPU and GPU.
Greedy (temperature 0 or top_k 1): argmax after penalties and grammar mask, ties to the lowest
id. Logprobs come from log_softmax of the *raw* logits (before penalties, temperature and the
grammar mask) in float32: the model's distribution, as OpenAI and vLLM's default report it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from engine.sampling_params import Grammar, SamplingParams

__all__ = [
    "Grammar", "SampleOutput", "Sampler", "SamplerState", "SamplingParams", "TokenLogprobs",
]

MAX_LOGPROBS = 20
_UNIFORM_BLOCK = 32


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def validate_params(params: SamplingParams) -> None:
    """Raise InvalidRequest for options out of range (checked once, at admission)."""
    checks = [
        (math.isfinite(params.temperature) and params.temperature >= 0.0, "temperature >= 0"),
        (0.0 < params.top_p <= 1.0, "0 < top_p <= 1"),
        (params.top_k >= -1, "top_k >= -1 (0 and -1 disable it)"),
        (0.0 <= params.min_p <= 1.0, "0 <= min_p <= 1"),
        (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0.0,
         "repetition_penalty > 0"),
        (-2.0 <= params.presence_penalty <= 2.0, "-2 <= presence_penalty <= 2"),
        (-2.0 <= params.frequency_penalty <= 2.0, "-2 <= frequency_penalty <= 2"),
        (params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS,
         f"0 <= logprobs <= {MAX_LOGPROBS}"),
    ]
    for ok, rule in checks:
        if not ok:
            raise InvalidRequest(f"sampling parameter out of range: need {rule}, got {params}")


@dataclass(slots=True)
class SamplerState:
    """A sequence's sampling state; created at admission, fed every appended token."""

    params: SamplingParams
    generator: torch.Generator  # CPU: one float64 uniform per random step
    vocab_size: int
    seen_mask: torch.Tensor | None = None  # (vocab,) bool, prompt + output ids
    output_counts: torch.Tensor | None = None  # (vocab,) int32, output ids
    pending_ids: list[int] = field(default_factory=list)  # recorded, not yet in the tensors
    uniforms: list[float] = field(default_factory=list)  # drawn ahead, consumed from the end
    num_output_tokens: int = 0

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int
    ) -> SamplerState:
        validate_params(params)
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()  # non-deterministic, drawn once for the sequence
        else:
            generator.manual_seed(params.seed % 2**64)
        state = cls(params, generator, vocab_size)
        if params.repetition_penalty != 1.0:
            state.seen_mask = torch.zeros(vocab_size, dtype=torch.bool)
            if len(prompt_ids):
                state.seen_mask[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            state.output_counts = torch.zeros(vocab_size, dtype=torch.int32)
        return state

    @property
    def has_penalties(self) -> bool:
        return self.seen_mask is not None or self.output_counts is not None

    def record(self, token_id: int) -> None:
        """A token was appended to the output: count it and advance the grammar."""
        self.num_output_tokens += 1
        if self.has_penalties:
            self.pending_ids.append(token_id)
        if self.params.grammar is not None:
            self.params.grammar.accept(token_id)

    def next_uniform(self) -> float:
        """The next U[0, 1) draw of this sequence's stream.

        Drawn from the generator in blocks (one torch call per block instead of per step);
        the stream depends only on the seed and on how many draws came before.
        """
        if not self.uniforms:
            block = torch.rand(_UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64)
            self.uniforms = block.tolist()[::-1]
        return self.uniforms.pop()

    def penalty_tensors(self, device: torch.device) -> tuple[torch.Tensor | None, ...]:
        """(seen_mask, output_counts) on `device`, with recorded ids applied in one update."""
        if self.seen_mask is not None and self.seen_mask.device != device:
            self.seen_mask = self.seen_mask.to(device)
        if self.output_counts is not None and self.output_counts.device != device:
            self.output_counts = self.output_counts.to(device)
        if self.pending_ids:
            ids = torch.tensor(self.pending_ids, dtype=torch.long, device=device)
            if self.seen_mask is not None:
                self.seen_mask[ids] = True
            if self.output_counts is not None:
                ones = torch.ones_like(ids, dtype=torch.int32)
                self.output_counts.index_put_((ids,), ones, accumulate=True)
            self.pending_ids.clear()
        return self.seen_mask, self.output_counts


class Sampler:
    """Stateless: all per-sequence state lives in SamplerState."""

    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplerState], *, record: bool = True
    ) -> SampleOutput:
        """logits (num_rows, vocab) -> one token per row.

        With record=True (the default) each chosen token is passed to its state's record()
        (penalty counts, grammar.accept); the caller then must not record it again.
        """
        x = self._adjusted(logits, states)  # (rows, vocab) float64
        device = x.device
        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
        token_ids = torch.zeros(len(states), dtype=torch.long, device=device)
        if greedy:
            token_ids[greedy] = x[greedy].argmax(dim=-1)  # first maximum: lowest id
        if rand:
            weights = _filtered_weights(x[rand], [states[i].params for i in rand])
            u = torch.tensor([states[i].next_uniform() for i in rand], dtype=torch.float64)
            u = u.to(device)
            cdf = weights.cumsum(dim=-1)  # (rand, vocab), last column = total kept weight
            target = (u * cdf[:, -1]).unsqueeze(-1)
            # First id whose cdf exceeds the target; zero-weight ids never increase the cdf.
            picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
            token_ids[rand] = picked.clamp_(max=x.shape[-1] - 1)
        tokens = token_ids.tolist()
        logprobs = _logprobs(logits, states, tokens)
        if record:
            for state, token in zip(states, tokens, strict=True):
                state.record(token)
        return SampleOutput(tokens, logprobs)

    def probs(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """(num_rows, vocab) float64: the distribution sample() draws from (one-hot if greedy).

        For speculative verification (rejection sampling needs the target distribution).
        """
        x = self._adjusted(logits, states)
        out = torch.zeros_like(x)
        for i, state in enumerate(states):
            if state.params.is_greedy:
                out[i, x[i].argmax()] = 1.0
            else:
                w = _filtered_weights(x[i : i + 1], [state.params])
                out[i] = w[0] / w[0].sum()
        return out

    def _adjusted(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """Raw logits -> float64 copy with penalties and grammar masks applied."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(states)} sequences")
        for state in states:
            if state.vocab_size != logits.shape[-1]:
                raise ValueError(f"logits width {logits.shape[-1]} != vocab {state.vocab_size}")
        x = logits.to(torch.float64, copy=True)
        _apply_penalties(x, states)
        _apply_grammar(x, states)
        return x


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplerState]) -> None:
    """In place on x (rows, vocab); rows without penalties are untouched."""
    rep_rows = [i for i, s in enumerate(states) if s.seen_mask is not None]
    cnt_rows = [i for i, s in enumerate(states) if s.output_counts is not None]
    tensors = {i: states[i].penalty_tensors(x.device) for i in set(rep_rows) | set(cnt_rows)}

    def column(values: list[float]) -> torch.Tensor:  # (rows, 1)
        return torch.tensor(values, dtype=x.dtype, device=x.device).unsqueeze(-1)

    if rep_rows:
        sub = x[rep_rows]  # (r, vocab)
        seen = torch.stack([tensors[i][0] for i in rep_rows])
        r = column([states[i].params.repetition_penalty for i in rep_rows])
        x[rep_rows] = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    if cnt_rows:
        counts = torch.stack([tensors[i][1] for i in cnt_rows]).to(x.dtype)  # (c, vocab)
        f = column([states[i].params.frequency_penalty for i in cnt_rows])
        p = column([states[i].params.presence_penalty for i in cnt_rows])
        x[cnt_rows] -= f * counts + p * (counts > 0).to(x.dtype)


def _apply_grammar(x: torch.Tensor, states: Sequence[SamplerState]) -> None:
    for i, state in enumerate(states):
        grammar = state.params.grammar
        if grammar is None:
            continue
        allowed = grammar.allowed_mask(state.vocab_size)  # (vocab,) bool
        if not bool(allowed.any()):
            raise InvalidRequest("the grammar allows no token at this point")
        x[i].masked_fill_(~allowed.to(x.device), float("-inf"))


def _filtered_weights(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """x (rows, vocab) float64 adjusted logits -> unnormalised weights, 0 outside the support.

    The weights are exp(l/T - max): the top token has weight 1, so min-p is `w >= min_p`.
    """
    rows, vocab = x.shape
    dev = x.device
    temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
    scaled = x / temp.unsqueeze(-1)
    w = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        k = torch.tensor(top_k, device=dev)
        w = _top_k_top_p(w, k, torch.tensor(top_p, dtype=x.dtype, device=dev))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
        w = w.masked_fill(w < min_p.unsqueeze(-1), 0.0)
    return w


def _top_k_top_p(w: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """w (rows, vocab) weights; top_k (rows,) long (vocab = off); top_p (rows,) (1 = off)."""
    # Stable descending sort: equal weights stay in id order, so ties go to the lower id.
    sorted_w, order = w.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(w.shape[-1], device=w.device)
    sorted_w = sorted_w.masked_fill(rank >= top_k.unsqueeze(-1), 0.0)
    cum = sorted_w.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # mass ahead
    keep = (before < top_p.unsqueeze(-1) * cum[:, -1:]) | (top_p >= 1.0).unsqueeze(-1)
    sorted_w = sorted_w.masked_fill(~keep, 0.0)
    return torch.zeros_like(w).scatter_(-1, order, sorted_w)


def _logprobs(
    logits: torch.Tensor, states: Sequence[SamplerState], tokens: list[int]
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].to(torch.float32), dim=-1)  # (r, vocab) raw logits
    chosen_ids = torch.tensor([tokens[i] for i in rows], device=lp.device).unsqueeze(-1)
    chosen = lp.gather(-1, chosen_ids).squeeze(-1).tolist()
    k_max = max(states[i].params.logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        top = tuple(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out
