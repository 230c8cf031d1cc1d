"""The runner's GPU attention path end to end, on the CPU: a tiny model whose attention runs
the Triton kernel in the interpreter worker, with the plans the runner makes (plan_decode
for decode-only steps, plan_batch for mixed ones), against the same runner on the torch
reference. Weights are dense f32 in both; the kernel's dots take f16 operands, so logits
agree to about 1e-3 relative (1e-2 with q4 values), where a wrong plan, slot or page
would be off by O(1)."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType as T
from span_batch import span_batch

from engine.batch import ForwardBatch
from engine.kv.pool import SeqPages
from engine.loader import load
from engine.runner import ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory, vocab_dir):
    spec = SyntheticSpec("gemma3", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=32, ffn_size=128, sliding_window=20, default_type=T.F32)
    path = tmp_path_factory.mktemp("attn") / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    return load(path, torch.float32, "cpu").model


def on_triton(worker, runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """runner.forward(batch) in the worker (a copy of the runner, KV included)."""
    twin = copy.copy(runner)
    twin.triton = True  # what the runner decides on a GPU
    return worker.call("operator:call", twin.forward, batch)


@pytest.mark.parametrize("kv_quant", ["f16", "k8v4"])
def test_runner_triton_attention_matches_reference(triton_worker, model, kv_quant):
    runner = ModelRunner(model, 32, 16, kv_quant, max_context=128)
    seqs = [SeqPages(runner.pool) for _ in range(4)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (9, 33, 4)]
    runner.forward(span_batch(runner, seqs, list(enumerate(prompts))))  # reference prefill
    steps = [[(0, [5]), (1, [6]), (2, [7])],  # decode-only: plan_decode
             [(0, [8]), (3, [11, 12, 13, 14, 15]), (2, [9])]]  # mixed: plan_batch
    for spans in steps:
        batch = span_batch(runner, seqs, spans)
        got = on_triton(triton_worker, runner, batch)
        ref = runner.forward(batch)
        assert torch.isfinite(got).all()
        rel = (got - ref).norm() / ref.norm()
        # measured 2.7e-4 (f16) and up to 7.6e-3 (q4 V codes flip on f16-sized differences)
        assert rel < (2e-3 if kv_quant == "f16" else 2e-2), float(rel)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert runner.triton is False  # the reference side really ran the reference
