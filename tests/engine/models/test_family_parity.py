"""Each family on a tiny random GGUF, against llama.cpp (llama-cpp-python) on the same file.
qwen3moe's experts mix types too: gate Q4_K and up Q8_0 (two grouped parts), down Q6_K;
gpt-oss's are MXFP4.

The GGUF mixes F32/F16/Q8_0/Q4_K/Q6_K tensors and carries a real vocabulary. llama.cpp
quantizes activations to 8 bits for quantized weights, so logits agree to a tolerance,
and greedy tokens must agree wherever llama.cpp's own top-1/top-2 gap is >= 0.3 nats.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

T = gguf.GGMLQuantizationType
MIXED = {"attn_q.weight": T.Q8_0, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q8_0, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q8_0,
         "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0,
         "ffn_gate_exps.weight": T.Q4_K, "ffn_up_exps.weight": T.Q8_0,
         "ffn_down_exps.weight": T.Q6_K}
OSS = {**{k: v for k, v in MIXED.items() if not k.startswith("ffn_")},
       **{f"ffn_{n}_exps.weight": T.MXFP4 for n in ("gate", "up", "down")}}
BASE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn_size=512,
            types=MIXED, num_layers=2)
CASES = {
    "llama": (SyntheticSpec("llama", **BASE), "ggml-vocab-llama-bpe.gguf"),
    "llama-rope-freqs": (SyntheticSpec("llama", rope_freq_factors=True, rope_base=500000.0,
                                       tied_embeddings=False, **BASE), "ggml-vocab-llama-bpe.gguf"),
    "qwen2": (SyntheticSpec("qwen2", **BASE), "ggml-vocab-qwen2.gguf"),
    "qwen3": (SyntheticSpec("qwen3", rope_base=1000000.0, **BASE), "ggml-vocab-qwen2.gguf"),
    # 8 experts of 256, 2 a token: with ~80 tokens every expert gets rows
    "qwen3moe": (SyntheticSpec("qwen3moe", rope_base=1000000.0, num_experts=8, experts_used=2,
                               expert_ffn_size=256, **BASE), "ggml-vocab-qwen2.gguf"),
    # biases everywhere, a sink a head, YaRN (factor 4 over a trained context of 64),
    # layer 0 sliding over 8 keys and layer 1 full; MXFP4 experts as its files have them
    "gpt-oss": (SyntheticSpec("gpt-oss", rope_base=150000.0, num_experts=8, experts_used=2,
                              expert_ffn_size=256, sliding_window=8, tied_embeddings=False,
                              yarn_factor=4.0, yarn_original_context=64,
                              **{**BASE, "types": OSS}), "ggml-vocab-qwen2.gguf"),
    # the architecture does not depend on the vocabulary: a small SPM one keeps this fast
    # (Gemma's own 262k vocabulary is covered by the default-model tests)
    "gemma3": (SyntheticSpec("gemma3", sliding_window=8,
                             **{**BASE, "num_layers": 6}), "ggml-vocab-llama-spm.gguf"),
}
# All-F32 twins: llama.cpp then multiplies in f32 without quantizing activations, so the
# only expected differences are summation order (and gemma's f16-table GELU in ggml).
for _name in list(CASES):
    _spec, _vocab = CASES[_name]
    CASES[_name + "-f32"] = (replace(_spec, types={}, default_type=T.F32), _vocab)
TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
        "def f(x): return x ** 2  # squares. 東京は日本の首都です。 Emoji: 🦊🐶! ") * 3
GAP = 0.3


QUANT_CASES = sorted(n for n in CASES if not n.endswith("-f32"))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, vocab_dir: Path) -> dict[str, Path]:
    return {}


@pytest.fixture
def tiny_model(request, tmp_path_factory, vocab_dir: Path, tiny_files):
    name = request.param
    if name not in tiny_files:
        spec, vocab = CASES[name]
        path = tmp_path_factory.mktemp("tiny") / f"{name}.gguf"
        write_synthetic_gguf(path, spec, vocab_dir / vocab, seed=sum(map(ord, name)))
        tiny_files[name] = path
    return name, tiny_files[name]


def _reference(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, logits_all=True,
                           verbose=False, n_threads=2, seed=0)


def _reference_logits(ref, ids: list[int]) -> np.ndarray:
    ref.reset()
    ref.eval(ids)
    return np.array(ref.scores[: len(ids)], dtype=np.float64)


@pytest.mark.parametrize("tiny_model", sorted(CASES), indirect=True)
def test_logits_match_llama_cpp(tiny_model):
    """Relative error of the logits (norm of the difference over the norm of the centred
    reference). All-F32 files: llama.cpp's f16 KV cache and f16 GELU table are the only
    rounding, measured at <= 8e-4. Mixed-quant files: llama.cpp quantizes activations to
    Q8_0/Q8_K before each quantized matmul, ~0.5% per matmul, measured 2-7% at the logits;
    a layout or formula error gives errors near 100%."""
    name, path = tiny_model
    ref = _reference(path)
    ids_all = ref.tokenize(TEXT.encode(), add_bos=True, special=False)
    ours = LLM(path, dtype="f32", context=512)
    limit = 2e-3 if name.endswith("-f32") else 0.12
    for n in (1, 5, 37, len(ids_all)):
        ids = ids_all[:n]
        want = _reference_logits(ref, ids)
        got = ours.prompt_logits(ids).double().numpy()
        centred = want - want.mean(axis=-1, keepdims=True)
        rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(centred, axis=-1)
        assert np.isfinite(got).all()
        if name.startswith(("qwen3moe", "gpt-oss")):
            _check_moe(name, n, rel, limit)
        else:
            assert rel.max() < limit, f"{name} n={n}: relative logits error {rel.max():.5f}"


def _check_moe(name: str, n: int, rel: np.ndarray, limit: float) -> None:
    """A router whose k-th and next experts nearly tie for a token (0.01-0.05 nats apart in
    its logits, measured) picks either, whichever side the rounding falls: that token's
    logits then differ by 10-20%, and the later tokens' a little through attention. And a
    lone token has no other keys to average over: gpt-oss's first token (one key and its
    sink) measured 15% from llama.cpp's 8-bit activations alone, with its experts 2 nats
    clear of the next and its f32 twin within 0.1%. So a short prompt's positions must
    each be within twice the limit, and from 20 tokens 95% within the limit and the median
    within half of it; a wrong formula (weights, experts, activation, sinks) misses both
    (errors near 100%)."""
    if n <= 20:
        assert (rel < 2 * limit).all(), f"{name} n={n}: relative logits error {rel.max():.5f}"
        return
    within = float((rel < limit).mean())
    assert within >= 0.95, \
        f"{name} n={n}: only {within:.0%} of the positions within {limit}: {np.sort(rel)[-5:]}"
    assert np.median(rel) < limit / 2, f"{name} n={n}: median error {np.median(rel):.5f}"


@pytest.mark.parametrize("tiny_model", QUANT_CASES, indirect=True)
def test_greedy_matches_llama_cpp_where_decisive(tiny_model):
    name, path = tiny_model
    ref = _reference(path)
    prompt = ref.tokenize(b"Once upon a time, in a land far away,", add_bos=True, special=False)
    ours = LLM(path, dtype="f32", context=512)
    ref_ids, ref_gaps = [], []
    ref.reset()
    ref.eval(prompt)
    for _ in range(24):
        logits = np.array(ref.scores[ref.n_tokens - 1], dtype=np.float64)
        top2 = np.sort(logits)[-2:]
        ref_gaps.append(top2[1] - top2[0])
        ref_ids.append(int(logits.argmax()))
        ref.eval([ref_ids[-1]])
    from engine.sampler import SamplingParams

    got = [s.token_id for s in ours.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    for i, (a, b) in enumerate(zip(ref_ids, got, strict=True)):
        if a != b:
            assert ref_gaps[i] < GAP, (
                f"{name}: token {i} differs ({b} vs llama.cpp {a}) with llama.cpp gap "
                f"{ref_gaps[i]:.3f} nats")
            break


@pytest.mark.parametrize("tiny_model", QUANT_CASES, indirect=True)
def test_bf16_default_stays_close_to_f32(tiny_model):
    _, path = tiny_model
    ids = list(range(10, 60))
    f32 = LLM(path, dtype="f32", context=128).prompt_logits(ids)
    bf16 = LLM(path, dtype="bf16", context=128).prompt_logits(ids)
    rel = (bf16 - f32).norm() / f32.norm()
    assert torch.isfinite(bf16).all() and rel < 0.05, float(rel)
