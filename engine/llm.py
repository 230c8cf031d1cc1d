"""LLM: the engine as a library, for one caller at a time (the CLI's generate/perplexity).

Serving many callers goes through engine.engine.Engine (scheduler + loop thread); this
class runs one sequence through the same ModelRunner, KV pool and sampler.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.errors import ContextOverflow, InvalidRequest
from engine.kv.pool import SeqPages
from engine.loader import LoadedModel, load
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplerState, SamplingParams
from engine.stop import StopChecker
from engine.tokenizer.detok import IncrementalDetokenizer

# Weight dtypes by name; auto (None) is int8 on the CPU, bf16 on a GPU (engine/models/weights.py)
DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bf16": torch.bfloat16,
                                         "f32": torch.float32, "int8": torch.int8}


@dataclass(frozen=True, slots=True)
class GenerationStep:
    token_id: int
    text: str  # text that may be shown now (stop strings held back)
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    num_tokens: int
    mean_nll: float
    ppl: float
    argmax_ids: list[int]  # predicted next token after each position but the last


class LLM:
    def __init__(self, model: str | os.PathLike = "default", *, dtype: str = "auto",
                 context: int | None = None, kv_quant: str = "f16",
                 prefill_chunk: int = 512, device: str = "auto") -> None:
        if dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.loaded: LoadedModel = load(model, DTYPES[dtype], device)
        cfg = self.loaded.config
        self.context = min(context or cfg.context_length, cfg.context_length)
        self.prefill_chunk = prefill_chunk
        pages = -(-self.context // 16)
        self.runner = ModelRunner(self.loaded.model, pages, 16, kv_quant)
        self.sampler = Sampler()

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def _prefill(self, seq: SeqPages, ids: list[int], start: int,
                 all_logits: bool = False) -> torch.Tensor:
        """Run `ids` (positions start..) in chunks; -> logits of the last (or every) token."""
        outs = []
        for lo in range(0, len(ids), self.prefill_chunk):
            chunk = ids[lo:lo + self.prefill_chunk]
            seq.ensure(start + lo + len(chunk))
            tables = {g: [seq.table(g)] for g in self.runner.pool.groups}
            rows = list(range(len(chunk))) if all_logits else None
            batch = ForwardBatch.build([(chunk, start + lo)], tables, rows)
            outs.append(self.runner.forward(batch))
        return torch.cat(outs)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[GenerationStep]:
        max_tokens = params.max_tokens or (self.context - len(prompt_ids))
        if not prompt_ids:
            raise InvalidRequest("the prompt has no tokens")
        if len(prompt_ids) + max_tokens > self.context:
            raise ContextOverflow(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context ({self.context} tokens)")
        state = SamplerState.create(params, prompt_ids, self.loaded.config.vocab_size)
        stop = StopChecker(params.stop, params.stop_token_ids, self.tokenizer.eog_ids,
                           params.ignore_eos, max_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, clean_spaces=False, continuation=True)
        seq = SeqPages(self.runner.pool)
        try:
            logits = self._prefill(seq, list(prompt_ids), 0)
            pos = len(prompt_ids)
            while True:
                token = self.sampler.sample(logits[-1:], [state]).token_ids[0]
                update = stop.feed(token, detok.push(token))
                text = update.text
                if update.finish_reason is not None and update.finish_reason != "stop":
                    text += detok.flush()
                yield GenerationStep(token, text, update.finish_reason)
                if update.finish_reason is not None:
                    return
                logits = self._prefill(seq, [token], pos)
                pos += 1
        finally:
            seq.free()

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits after every token of `ids`: (len(ids), vocab) float32."""
        if not ids:
            raise InvalidRequest("no tokens")
        if len(ids) > self.context:
            raise ContextOverflow(f"{len(ids)} tokens exceed the context ({self.context})")
        seq = SeqPages(self.runner.pool)
        try:
            return self._prefill(seq, ids, 0, all_logits=True)
        finally:
            seq.free()

    def perplexity(self, text: str) -> PerplexityResult:
        ids = self.encode(text)
        if len(ids) < 2:
            raise InvalidRequest("perplexity needs at least 2 tokens")
        if len(ids) > self.context:
            raise ContextOverflow(f"text has {len(ids)} tokens, the context is {self.context}")
        nll, argmax = [], []
        seq = SeqPages(self.runner.pool)
        try:
            for lo in range(0, len(ids) - 1, self.prefill_chunk):
                chunk = ids[lo:lo + self.prefill_chunk]
                logits = self._prefill(seq, chunk, lo, all_logits=True)  # (len(chunk), vocab)
                targets = torch.tensor(ids[lo + 1:lo + 1 + len(chunk)])
                logits = logits[:len(targets)]
                logp = torch.log_softmax(logits.double(), dim=-1)
                nll.append(-logp[torch.arange(len(targets)), targets])
                argmax.extend(logits.argmax(-1).tolist())
        finally:
            seq.free()
        mean = float(torch.cat(nll).mean())
        return PerplexityResult(len(ids), mean, math.exp(mean), argmax)
