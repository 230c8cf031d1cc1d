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
     never on the other rows; a seeded row gives the same tokens on CPU and GPU (barring
     float rounding that moves a CDF boundary across the draw).
Greedy (temperature 0 or top_k 1): argmax after penalties and grammar mask, ties to the lowest
id. Logprobs come from log_softmax of the *raw* logits (before penalties, temperature and the
grammar mask) in float32: the model's distribution, as OpenAI and vLLM's default report it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.batch import to_device
from engine.errors import InvalidRequest
from engine.sampler_filters import filtered_weights
from engine.sampling_params import Grammar, SamplingParams

__all__ = [
    "Grammar", "SampleOutput", "Sampler", "SamplerState", "SamplingParams", "TokenLogprobs",
]

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias, either sign
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
        (params.prompt_logprobs is None or 0 <= params.prompt_logprobs <= MAX_LOGPROBS,
         f"0 <= prompt_logprobs <= {MAX_LOGPROBS}"),
    ]
    for ok, rule in checks:
        if not ok:
            raise InvalidRequest(f"sampling parameter out of range: need {rule}, got {params}")
    for token_id, bias in params.logit_bias:
        if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            raise InvalidRequest(f"logit_bias of token {token_id} is {bias}: need "
                                 f"-{MAX_LOGIT_BIAS:g} <= bias <= {MAX_LOGIT_BIAS:g}")


@dataclass(slots=True)
class SamplerState:
    """A sequence's sampling state; created at admission, fed every appended token."""

    params: SamplingParams
    generator: torch.Generator  # CPU: one float64 uniform per random step
    vocab_size: int
    prompt_mask: torch.Tensor | None = None  # (vocab,) bool, prompt ids (repetition only)
    output_counts: torch.Tensor | None = None  # (vocab,) float32 counts of output ids
    pending_ids: list[int] = field(default_factory=list)  # recorded, not yet in output_counts
    uniforms: list[float] = field(default_factory=list)  # drawn ahead, consumed from the end
    num_output_tokens: int = 0
    table_row: tuple[float, ...] = ()  # its parameter table row (_T.._PRES), built once
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: ids, values (float64)
    is_plain_greedy: bool = False  # greedy, no penalties, no grammar: the raw logits' argmax
    # no penalties, no grammar: a draw depends on the logits and the uniform stream only,
    # not on the tokens before it, so the device can feed it to the next step
    is_stateless: bool = False

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
        top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
        state.table_row = (params.temperature, top_k, params.top_p, params.min_p,
                           params.repetition_penalty, params.frequency_penalty,
                           params.presence_penalty)
        # Kept on the device across steps and updated by the recorded ids only (one
        # index_add_ per step), never rebuilt from the history. The output side of
        # "seen" for repetition_penalty is output_counts > 0.
        if params.repetition_penalty != 1.0:
            state.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
            if len(prompt_ids):
                state.prompt_mask[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        if state.has_penalties:
            # float32 holds counts exactly up to 2**24 and has atomic adds everywhere.
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32)
        if params.logit_bias:
            ids = [t for t, _ in params.logit_bias]
            if not all(0 <= t < vocab_size for t in ids):
                raise InvalidRequest(f"logit_bias token ids must lie in [0, {vocab_size})")
            state.bias = (torch.tensor(ids, dtype=torch.long),
                          torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64))
        # a bias is the same every step: a draw still depends on nothing before it
        state.is_stateless = not state.has_penalties and params.grammar is None
        state.is_plain_greedy = (params.is_greedy and state.is_stateless
                                 and state.bias is None)
        return state

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)

    def record(self, token_id: int) -> None:
        """A token was appended to the output: count it and advance the grammar."""
        self.num_output_tokens += 1
        if self.output_counts is not None:  # has_penalties (set at creation)
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


class Sampler:
    """Stateless: all per-sequence state lives in SamplerState."""

    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplerState], *, record: bool = True,
        on_device: Callable[[torch.Tensor], None] | None = None,
    ) -> SampleOutput:
        """logits (num_rows, vocab) -> one token per row.

        With record=True (the default) each chosen token is passed to its state's record()
        (penalty counts, grammar.accept); the caller then must not record it again.
        `on_device` gets the chosen ids (rows,) on the logits' device before the host reads
        them (the engine launches the next decode step from them, engine/core.py).
        """
        if not states:
            return SampleOutput([], [])
        if all(s.is_plain_greedy for s in states):
            _check_shape(logits, states)
            # The float64 copy would change no order (the conversion is exact): argmax of the
            # raw logits, first maximum, so ties go to the lowest id.
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._draw(logits, states)
        tokens, logprobs = _to_host(logits, states, token_ids, on_device)
        if record:
            for state, token in zip(states, tokens, strict=True):
                state.record(token)
        return SampleOutput(tokens, logprobs)

    def _draw(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """(rows,) token ids on the logits' device: greedy rows by argmax, the others by
        inverse CDF at their sequence's next uniform."""
        rand = [i for i, s in enumerate(states) if not s.params.is_greedy]
        uniforms = [0.0] * len(states)
        for i in rand:
            uniforms[i] = states[i].next_uniform()
        x, table = self._adjusted(logits, states, uniforms)  # (rows, vocab) float64
        if len(rand) < len(states):
            token_ids = x.argmax(dim=-1)  # first maximum: ties go to the lowest id
        if rand:
            rows = _Rows(rand, x.shape[0], x.device)
            params = rows.of(table)
            weights = _filtered_weights(rows.of(x), params, [states[i].params for i in rand])
            cdf = weights.cumsum(dim=-1)  # (rand, vocab), last column = total kept weight
            target = (params[:, _U] * cdf[:, -1]).unsqueeze(-1)
            # First id whose cdf exceeds the target; zero-weight ids never increase the cdf.
            picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
            picked = picked.clamp_(max=x.shape[-1] - 1)
            token_ids = picked if rows.index is None else \
                token_ids.index_copy(0, rows.index, picked)
        return token_ids

    def probs(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """(num_rows, vocab) float64: the distribution sample() draws from (one-hot if greedy).

        For speculative verification (rejection sampling needs the target distribution).
        """
        x, table = self._adjusted(logits, states, [0.0] * len(states))
        out = torch.zeros_like(x)
        for i, state in enumerate(states):
            if state.params.is_greedy:
                out[i, x[i].argmax()] = 1.0
            else:
                w = _filtered_weights(x[i : i + 1], table[i : i + 1], [state.params])
                out[i] = w[0] / w[0].sum()
        return out

    def _adjusted(
        self, logits: torch.Tensor, states: Sequence[SamplerState], uniforms: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw logits -> (float64 copy with penalties and grammar masks, parameter table)."""
        _check_shape(logits, states)
        table = _param_table(states, uniforms, logits.device)
        x = logits.to(torch.float64, copy=True)
        _apply_penalties(x, table, states)
        _apply_bias(x, states)
        _apply_grammar(x, states)
        return x, table


# Columns of the per-row parameter table: built on the host and copied once per step.
_T, _K, _P, _MIN_P, _REP, _FREQ, _PRES, _U = range(8)


def _param_table(states: Sequence[SamplerState], uniforms: list[float],
                 device: torch.device) -> torch.Tensor:
    """(rows, 8) float64; top_k as a count (vocab when off), u the row's uniform draw."""
    rows = [(*state.table_row, u) for state, u in zip(states, uniforms, strict=True)]
    return to_device(torch.tensor(rows, dtype=torch.float64).reshape(-1, 8), device)


def _check_shape(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(states)} sequences")
    width = logits.shape[-1]
    for state in states:
        if state.vocab_size != width:
            raise ValueError(f"logits width {width} != vocab {state.vocab_size}")


class _Rows:
    """A subset of the batch's rows (sorted, unique); the whole batch needs no index (no
    host->device copy) and no gather."""

    def __init__(self, rows: list[int], num_rows: int, device: torch.device) -> None:
        self.index = None if len(rows) == num_rows else \
            to_device(torch.tensor(rows, dtype=torch.long), device)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The subset's rows of t (rows, ...)."""
        return t if self.index is None else t.index_select(0, self.index)


def _sync_counts(states: Sequence[SamplerState], device: torch.device) -> list[torch.Tensor]:
    """Each state's output_counts on `device` with its recorded ids applied.

    One host->device copy for the batch and one index_add_ per state that has new ids.
    """
    flat = [t for s in states for t in s.pending_ids]
    ids = torch.tensor(flat, dtype=torch.long).to(device) if flat else None
    ones = torch.ones(len(flat), dtype=torch.float32, device=device) if flat else None
    out, start = [], 0
    for state in states:
        counts = state.output_counts
        assert counts is not None
        if counts.device != device:
            counts = state.output_counts = counts.to(device)
        if state.prompt_mask is not None and state.prompt_mask.device != device:
            state.prompt_mask = state.prompt_mask.to(device)
        if state.pending_ids and ids is not None and ones is not None:
            end = start + len(state.pending_ids)
            counts.index_add_(0, ids[start:end], ones[start:end])
            state.pending_ids.clear()
            start = end
        out.append(counts)
    return out


def _apply_penalties(x: torch.Tensor, table: torch.Tensor, states: Sequence[SamplerState]) -> None:
    """In place on x (rows, vocab); rows without penalties are untouched."""
    penalized = [i for i, s in enumerate(states) if s.output_counts is not None]
    if not penalized:
        return
    rows = _Rows(penalized, x.shape[0], x.device)
    counts = torch.stack(_sync_counts([states[i] for i in penalized], x.device))  # (r, vocab)
    in_output = counts > 0
    seen = in_output  # prompt + output ids, for repetition_penalty
    masks = [states[i].prompt_mask for i in penalized]
    if any(m is not None for m in masks):
        blank = torch.zeros_like(in_output[0])
        seen = in_output | torch.stack([blank if m is None else m for m in masks])
    params = rows.of(table)
    r, f, p = (params[:, c : c + 1] for c in (_REP, _FREQ, _PRES))  # (r, 1) each
    sub = rows.of(x)
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - f * counts.to(x.dtype) - p * in_output.to(x.dtype)
    if rows.index is None:
        x.copy_(sub)
    else:
        x.index_copy_(0, rows.index, sub)


def _apply_bias(x: torch.Tensor, states: Sequence[SamplerState]) -> None:
    for i, state in enumerate(states):
        if state.bias is not None:
            if state.bias[0].device != x.device:  # moved once, kept on the device
                state.bias = (state.bias[0].to(x.device), state.bias[1].to(x.device))
            x[i].index_add_(0, *state.bias)


def _apply_grammar(x: torch.Tensor, states: Sequence[SamplerState]) -> None:
    for i, state in enumerate(states):
        grammar = state.params.grammar
        if grammar is None:
            continue
        allowed = grammar.allowed_mask(state.vocab_size)  # (vocab,) bool
        if not bool(allowed.any()):
            raise InvalidRequest("the grammar allows no token at this point")
        x[i].masked_fill_(~allowed.to(x.device), float("-inf"))


def _filtered_weights(
    x: torch.Tensor, table: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """filtered_weights with its (rows, 1) columns of the parameter table (rows, 8)."""
    columns = (table[:, c : c + 1] for c in (_T, _K, _P, _MIN_P))
    return filtered_weights(x, *columns, params)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's log-softmax (of the raw logits, float32) at its token and its top k, in
    one device->host copy: what the sampler reports for a sampled token."""
    ids = to_device(torch.tensor(token_ids, dtype=torch.long), logits.device)
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # (rows, vocab)
    top_vals, top_ids = lp.topk(k, dim=-1)  # (rows, k)
    packed = torch.cat([t.double() for t in (lp.gather(-1, ids[:, None]), top_ids, top_vals)],
                       dim=-1).cpu().tolist()
    return [TokenLogprobs(t, row[0], tuple(zip(map(int, row[1:1 + k]), row[1 + k:],
                                                strict=True)))
            for t, row in zip(token_ids, packed, strict=True)]


def _to_host(
    logits: torch.Tensor, states: Sequence[SamplerState], token_ids: torch.Tensor,
    on_device: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Token ids (rows,) on the logits' device -> (ids, logprobs) on the host, in one
    device->host copy. Logprobs come from the raw logits. `on_device(token_ids)` runs
    after the copy is queued and before the host waits for it, so that work it queues
    on the device runs while the host reads."""
    out: list[TokenLogprobs | None] = [None] * len(states)
    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    k_max = max((states[i].params.logprobs or 0 for i in wanted), default=0)
    packed = token_ids
    if wanted:
        rows = _Rows(wanted, len(states), logits.device)
        lp = torch.log_softmax(rows.of(logits).to(torch.float32), dim=-1)  # (r, vocab)
        chosen = lp.gather(-1, rows.of(token_ids).unsqueeze(-1))  # (r, 1)
        top_vals, top_ids = lp.topk(k_max, dim=-1)  # (r, k_max), most likely first
        # Every row's token id, then per wanted row (1 + 2 k_max): its logprob and the
        # top pairs; float64 holds the ids exactly
        pairs = torch.cat([t.double() for t in (chosen, top_ids, top_vals)], dim=-1)
        packed = torch.cat([token_ids.double(), pairs.flatten()])
    flat = _read(packed, on_device, token_ids)
    n, width = len(states), 1 + 2 * k_max
    for j, i in enumerate(wanted):
        row = flat[n + j * width : n + (j + 1) * width]
        k = states[i].params.logprobs or 0
        top = zip(map(int, row[1 : 1 + k]), row[1 + k_max : 1 + k_max + k], strict=True)
        out[i] = TokenLogprobs(int(flat[i]), row[0], tuple(top))
    return [int(t) for t in flat[:n]], out


def _read(packed: torch.Tensor, on_device: Callable[[torch.Tensor], None] | None,
          token_ids: torch.Tensor) -> list:
    """packed.tolist(), with `on_device(token_ids)` called between queueing the copy and
    waiting for it (a plain .tolist() after it would wait for its work too)."""
    if on_device is None:
        return packed.tolist()
    if packed.device.type == "cpu":
        on_device(token_ids)
        return packed.tolist()
    host = packed.to("cpu", non_blocking=True)  # into pinned memory, in stream order
    copied = torch.cuda.Event()
    copied.record()
    on_device(token_ids)
    copied.synchronize()
    return host.tolist()
