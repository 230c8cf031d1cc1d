"""The embedded default model (Gemma 3 270M Q4_K_M) against llama.cpp on the same file.

Judged where llama.cpp is decisive: llama.cpp disagrees with itself (flash attention on
or off) at near-ties, so argmax agreement counts positions whose top-1/top-2 logprob gap
is >= 0.3 nats, and a greedy continuation may first differ only at such a near-tie.
Both CPU weight layouts are tested: bf16 (the GGML values rounded to bf16) and int8 (per-row
int8 codes re-quantized from them; the CPU default), with f32 norms/softmax/accumulation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampler import SamplingParams

GAP = 0.3
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, there was a little fox who",
    "The three primary colors are",
    "In 1492, Christopher Columbus",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "import numpy as np\n\nx = np.",
]


@pytest.fixture(scope="module")
def reference(default_model_path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(default_model_path), n_ctx=1024, n_batch=512,
                           logits_all=True, verbose=False, n_threads=2, seed=0)


@pytest.fixture(scope="module", params=["bf16", "int8"])
def ours(request) -> LLM:
    return LLM("default", dtype=request.param, context=1024)


def _gaps(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def test_teacher_forced_agreement_and_nll(reference, ours: LLM):
    text = (Path(__file__).parents[2] / "data" / "parity_text.txt").read_text()
    ids = ours.encode(text)
    assert ids == reference.tokenize(text.encode(), add_bos=True, special=False)
    assert len(ids) >= 400
    reference.reset()
    reference.eval(ids)
    want = np.array(reference.scores[: len(ids)], dtype=np.float64)
    got = ours.prompt_logits(ids).double().numpy()
    decisive = _gaps(want[:-1]) >= GAP
    agree = (got[:-1].argmax(-1) == want[:-1].argmax(-1))[decisive].mean()
    # int8 re-quantizes each row, one more rounding than bf16's (see the KL test below)
    want_agree = 0.99 if ours.dtype == "bf16" else 0.98
    assert agree >= want_agree, f"argmax agreement {agree:.4f} over {decisive.sum()} positions"

    def mean_nll(logits: np.ndarray) -> float:
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())

    ours_nll, ref_nll = mean_nll(got[:-1]), mean_nll(want[:-1])
    assert abs(ours_nll - ref_nll) <= 0.03, (ours_nll, ref_nll)
    result = ours.perplexity(text)  # the CLI's path gives the same numbers
    assert result.num_tokens == len(ids)
    assert abs(result.mean_nll - ours_nll) < 1e-3


def test_distance_from_exact_math_within_llama_cpp_s(reference, ours: LLM):
    """The layout's distance from exact f32 math (our f32 path, itself within 8e-4 of
    llama.cpp on all-F32 files), as mean KL over a 450-token text, against llama.cpp's
    own (it rounds activations to 8 bits): int8 at most 1.2x it (measured 0.85x), bf16 at
    most a quarter of it (measured 0.12x)."""
    text = (Path(__file__).parents[2] / "data" / "parity_text.txt").read_text()
    ids = ours.encode(text)
    exact = LLM("default", dtype="f32", context=1024).prompt_logits(ids).double()
    reference.reset()
    reference.eval(ids)
    llama = torch.tensor(np.array(reference.scores[: len(ids)]), dtype=torch.float64)
    got = ours.prompt_logits(ids).double()

    def mean_kl(logits: torch.Tensor) -> float:
        p = exact.log_softmax(-1)
        return float((p.exp() * (p - logits.log_softmax(-1))).sum(-1).mean())

    ours_kl, llama_kl = mean_kl(got), mean_kl(llama)
    assert ours_kl <= (1.2 if ours.dtype == "int8" else 0.25) * llama_kl, (ours_kl, llama_kl)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation(reference, ours: LLM, prompt: str):
    ids = reference.tokenize(prompt.encode(), add_bos=True, special=False)
    reference.reset()
    reference.eval(ids)
    ref_ids, gaps = [], []
    for _ in range(24):
        logits = np.array(reference.scores[reference.n_tokens - 1], dtype=np.float64)
        gaps.append(float(_gaps(logits)))
        ref_ids.append(int(logits.argmax()))
        reference.eval([ref_ids[-1]])
    got = [s.token_id for s in ours.generate(
        ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    for i, (a, b) in enumerate(zip(ref_ids, got, strict=True)):
        if a != b:
            assert gaps[i] < GAP, f"token {i}: ours {b}, llama.cpp {a} (gap {gaps[i]:.3f})"
            break
