"""`mbufo bench kv-quality`: what each KV format costs in next-token distributions.

Protocol: three unrelated fixed texts (prompts.KV_QUALITY_TEXTS), each cut to ~400 tokens,
are prefilled; then 98 decode steps are fed the same tokens in every format (teacher
forcing with the tokens the f16 run chose greedily). At each step the next-token
distribution of a format is compared with f16's and with q8's: KL(ref || format), mean and
max over all 3 x 98 steps, and greedy argmax agreement. Attention always stores the new
K/V into the (quantized) pages and reads them back, so a format's error enters exactly as
in serving, both for the context and for every decoded token.

Teacher forcing: `teacher="prefill"` (the default) feeds the 98 tokens after the context
as one chunk with logits at every position; `teacher="decode"` feeds them one forward
each, as serving does. Both see the same quantized K/V (a chunk also stores its tokens
and then reads them back), so they can differ only by the float rounding of different
matmul shapes, and with batch-invariant numerics not at all: on the default model (bf16,
CPU, 8 tokens after a 64-token context) the logits were bit-equal in f16 and k4v4. Every
run measures that difference on the first text (`prefill_vs_decode`: max |logit
difference|, max KL, argmax agreement over 16 tokens), so the fast path is checked each
time. The f16 run that chooses the teacher tokens always decodes greedily, one token per
forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.batch import ForwardBatch
from engine.bench.prompts import KV_QUALITY_TEXTS
from engine.bench.report import format_table
from engine.errors import InvalidRequest
from engine.kv.pool import SeqPages
from engine.runner import ModelRunner

log = logging.getLogger(__name__)

FORMATS = ("f16", "q8", "k8v4", "k4v8", "k4v4")
REFERENCES = ("f16", "q8")
PAGE_SIZE = 16
Progress = Callable[[str], None]


def _forward(runner: ModelRunner, seq: SeqPages, ids: list[int], start: int, chunk: int,
             all_logits: bool = False) -> torch.Tensor:
    """Feed ids (positions start..) in chunks -> logits of the last (or every) token."""
    outs = []
    for lo in range(0, len(ids), chunk):
        part = ids[lo:lo + chunk]
        seq.ensure(start + lo + len(part))
        tables = {g: [seq.table(g)] for g in runner.pool.groups}
        rows = list(range(len(part))) if all_logits else None
        outs.append(runner.forward(ForwardBatch.build([(part, start + lo)], tables, rows)))
    return torch.cat(outs)


def step_logits(runner: ModelRunner, context: list[int], follow: list[int] | None,
                steps: int, teacher: str = "decode",
                chunk: int = 512) -> tuple[torch.Tensor, list[int]]:
    """Prefill `context`, then feed `steps` tokens -> ((steps, vocab) logits after each fed
    token, the fed tokens). follow=None feeds greedy choices (decode only)."""
    seq = SeqPages(runner.pool)
    try:
        after_context = _forward(runner, seq, context, 0, chunk)[-1]
        if teacher == "prefill":
            if follow is None:
                raise InvalidRequest("prefill teacher forcing needs the tokens to feed")
            fed = list(follow[:steps])
            return _forward(runner, seq, fed, len(context), chunk, all_logits=True), fed
        rows, fed = [], []
        token = int(after_context.argmax()) if follow is None else follow[0]
        for i in range(steps):
            fed.append(token)
            logits = _forward(runner, seq, [token], len(context) + i, chunk)[-1]
            rows.append(logits)
            if i + 1 < steps:
                token = int(logits.argmax()) if follow is None else follow[i + 1]
        return torch.stack(rows), fed
    finally:
        seq.free()


def compare(ref: torch.Tensor, other: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per row of (steps, vocab) logits: KL(softmax(ref) || softmax(other)) in float64 and
    whether the argmaxes agree."""
    ref_lp = torch.log_softmax(ref.double(), dim=-1)
    other_lp = torch.log_softmax(other.double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - other_lp)).sum(-1).clamp_min(0.0)
    return kl.tolist(), (ref.argmax(-1) == other.argmax(-1)).tolist()


def _summary(kls: list[float], agree: list[bool]) -> dict[str, float]:
    return {"kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "argmax_agreement": round(sum(agree) / len(agree), 4)}


def _runner(model: Any, tokens: int, fmt: str) -> ModelRunner:
    return ModelRunner(model, -(-tokens // PAGE_SIZE) + 1, PAGE_SIZE, fmt)


def run_kv_quality(model: str = "default", *, formats: Sequence[str] = FORMATS,
                   steps: int = 98, context_tokens: int = 400, teacher: str = "prefill",
                   dtype: str = "bf16", check_steps: int = 16,
                   progress: Progress = log.info) -> dict[str, Any]:
    from engine.llm import LLM

    if min(steps, context_tokens, check_steps) < 1:
        raise InvalidRequest("steps, context_tokens and check_steps must be >= 1")
    if teacher not in ("decode", "prefill"):
        raise InvalidRequest(f"teacher must be 'decode' or 'prefill', got {teacher!r}")
    formats = list(dict.fromkeys([*REFERENCES, *formats]))  # references first
    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, context=context_tokens + steps + 1)
    contexts = [llm.encode(text)[:context_tokens] for text in KV_QUALITY_TEXTS]
    runners = {f: _runner(llm.loaded.model, context_tokens + steps, f) for f in formats}
    acc: dict[tuple[str, str], tuple[list[float], list[bool]]] = {
        (f, r): ([], []) for f in formats for r in REFERENCES}
    consistency: dict[str, Any] = {}
    for n, context in enumerate(contexts):
        progress(f"kv-quality context {n + 1}/{len(contexts)} ({len(context)} tokens): f16")
        f16_logits, teacher_ids = step_logits(runners["f16"], context, None, steps)
        if n == 0:
            consistency = _prefill_vs_decode(runners, context, teacher_ids[:check_steps])
        refs: dict[str, torch.Tensor] = {}  # (steps, vocab) float32 each
        for ref in REFERENCES:
            if ref == "f16" and teacher == "decode":
                refs[ref] = f16_logits
            else:
                progress(f"  {ref}")
                refs[ref] = step_logits(runners[ref], context, teacher_ids, steps, teacher)[0]
        for fmt in formats:
            logits = refs.get(fmt)
            if logits is None:  # only the references are kept
                progress(f"  {fmt}")
                logits = step_logits(runners[fmt], context, teacher_ids, steps, teacher)[0]
            for ref in REFERENCES:
                kls, agree = compare(refs[ref], logits)
                acc[(fmt, ref)][0].extend(kls)
                acc[(fmt, ref)][1].extend(agree)
    return {
        "bench": "kv-quality", "model": str(llm.loaded.path), "dtype": dtype,
        "contexts": len(contexts), "context_tokens": [len(c) for c in contexts],
        "steps": steps, "teacher": teacher,
        "formats": {f: {f"vs_{r}": _summary(*acc[(f, r)]) for r in REFERENCES}
                    for f in formats},
        "prefill_vs_decode": consistency,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _prefill_vs_decode(runners: dict[str, ModelRunner], context: list[int],
                       tokens: list[int]) -> dict[str, Any]:
    """The same tokens fed one by one vs as one chunk, in the first and last formats."""
    out: dict[str, Any] = {"tokens": len(tokens)}
    for fmt in dict.fromkeys([next(iter(runners)), list(runners)[-1]]):
        decoded = step_logits(runners[fmt], context, tokens, len(tokens), "decode")[0]
        chunked = step_logits(runners[fmt], context, tokens, len(tokens), "prefill")[0]
        kls, agree = compare(decoded, chunked)
        out[fmt] = {"max_abs_logit_diff": float((decoded - chunked).abs().max()),
                    "kl_max": max(kls), "argmax_agreement": sum(agree) / len(agree)}
    return out


def kv_quality_table(result: dict[str, Any]) -> str:
    headers = ["kv format", "KL mean vs f16", "KL max vs f16", "agree vs f16",
               "KL mean vs q8", "KL max vs q8", "agree vs q8"]
    rows = []
    for fmt, by_ref in result["formats"].items():
        f16, q8 = by_ref["vs_f16"], by_ref["vs_q8"]
        rows.append([fmt, f"{f16['kl_mean']:.3e}", f"{f16['kl_max']:.3e}",
                     f16["argmax_agreement"], f"{q8['kl_mean']:.3e}", f"{q8['kl_max']:.3e}",
                     q8["argmax_agreement"]])
    return format_table(headers, rows)
