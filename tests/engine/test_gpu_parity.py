"""GPU path against the CPU path on a tiny GGUF: same greedy tokens, close logits.
Runs on the lent GPU machine (`pytest -m gpu`), never in CI."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampler import SamplingParams
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.gpu
T = __import__("gguf").GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, vocab_dir):
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    spec = SyntheticSpec("llama", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                         ffn_size=512, num_layers=3,
                         types={"attn_q.weight": T.Q8_0, "ffn_gate.weight": T.Q4_K,
                                "ffn_down.weight": T.Q6_K})
    path = tmp_path_factory.mktemp("gpu") / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=7)
    return path


@pytest.mark.parametrize("kv_quant", ["f16", "q8", "k8v4"])
def test_gpu_matches_cpu(tiny, kv_quant):
    cpu = LLM(tiny, dtype="f32", context=256, kv_quant=kv_quant, device="cpu")
    gpu = LLM(tiny, dtype="f32", context=256, kv_quant=kv_quant, device="cuda")
    ids = list(range(100, 160))
    a, b = cpu.prompt_logits(ids), gpu.prompt_logits(ids).cpu()
    rel = (a - b).norm() / a.norm()
    assert torch.isfinite(b).all() and rel < 1e-3, float(rel)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [s.token_id for s in cpu.generate(ids[:8], params)] == \
        [s.token_id for s in gpu.generate(ids[:8], params)]
