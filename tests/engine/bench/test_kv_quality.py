"""kv-quality on a tiny random llama (real SPM vocabulary): the driver, KL and the report."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.bench.kv_quality import FORMATS, compare, run_kv_quality, step_logits
from engine.llm import LLM
from engine.sampler import SamplingParams
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

CONTEXT, STEPS = 16, 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, vocab_dir):
    path = tmp_path_factory.mktemp("kvq") / "tiny-llama.gguf"
    spec = SyntheticSpec("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=32, ffn_size=128)
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=3)
    return path


def test_kl_against_numpy():
    gen = torch.Generator().manual_seed(0)
    ref, other = torch.randn(5, 300, generator=gen) * 3, torch.randn(5, 300, generator=gen) * 3
    kls, agree = compare(ref, other)

    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref.numpy()), log_softmax(other.numpy())
    want = (np.exp(p) * (p - q)).sum(-1)
    np.testing.assert_allclose(kls, want, rtol=1e-10, atol=1e-12)
    assert agree == (ref.numpy().argmax(-1) == other.numpy().argmax(-1)).tolist()
    assert compare(ref, ref)[0] == [0.0] * 5


def test_greedy_teacher_matches_llm_generate(tiny_llama):
    llm = LLM(tiny_llama, dtype="f32", context=64)
    context = llm.encode("The lighthouse at the end of the northern breakwater")
    _, fed = step_logits(llm.runner, context, None, STEPS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    assert fed == [step.token_id for step in llm.generate(context, params)]
    # teacher-forced chunk logits = LLM.prompt_logits over context + fed tokens
    chunk, _ = step_logits(llm.runner, context, fed, STEPS, teacher="prefill")
    whole = llm.prompt_logits(context + fed)[len(context):]
    torch.testing.assert_close(chunk, whole, rtol=1e-5, atol=1e-5)


def test_report_on_a_tiny_model(tiny_llama):
    out = run_kv_quality(tiny_llama, steps=STEPS, context_tokens=CONTEXT, dtype="f32",
                         check_steps=3, progress=lambda _m: None)
    assert out["context_tokens"] == [CONTEXT] * 3 and out["steps"] == STEPS
    assert list(out["formats"]) == list(FORMATS)
    assert out["formats"]["f16"]["vs_f16"] == {"kl_mean": 0.0, "kl_max": 0.0,
                                               "argmax_agreement": 1.0}
    assert out["formats"]["q8"]["vs_q8"]["kl_max"] == 0.0
    for refs in out["formats"].values():
        for stats in refs.values():
            assert 0.0 <= stats["kl_mean"] <= stats["kl_max"]
            assert 0.0 <= stats["argmax_agreement"] <= 1.0
    # 4-bit K and V lose more than 8-bit blocks
    assert out["formats"]["k4v4"]["vs_f16"]["kl_mean"] > out["formats"]["q8"]["vs_f16"]["kl_mean"]
    check = out["prefill_vs_decode"]
    assert check["tokens"] == 3 and set(check) == {"tokens", "f16", "k4v4"}
    for fmt in ("f16", "k4v4"):
        assert check[fmt]["max_abs_logit_diff"] < 1e-3 and check[fmt]["argmax_agreement"] == 1
