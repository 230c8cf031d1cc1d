"""The decoder's Triton path end to end on the CPU: with MBUFO_KERNELS=triton in the
interpreter worker, a tiny model's forward runs the fused kernels (add + RMSNorm with
Gemma's post-norms, q/k norm + RoPE, the KV store, the gated activation) and the paged
attention, against the same runner on the torch path. One family per layout: llama
(original RoPE pairs, Llama 3 frequency factors), qwen3 (neox, q/k norm), gemma3 (neox,
q/k norm, post-norms, GeGLU, sliding window). Weights are dense f32 on both sides (bf16 in
one case: its bf16 matmul outputs round differences up to about 5e-3 relative); the fused
kernels are float32, so the gap is the attention kernel's f16 dot operands (about 1e-3
relative, 1e-2 with q4 values), where a wrong pair layout, norm or residual is off by O(1).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from span_batch import span_batch

from engine.batch import ForwardBatch
from engine.build import EngineOptions, load_for
from engine.kv.pool import SeqPages
from engine.loader import load
from engine.runner import ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

SPECS = {
    "llama": SyntheticSpec("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           head_dim=32, ffn_size=96, rope_freq_factors=True,
                           default_type=T.F32),
    "qwen3": SyntheticSpec("qwen3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                           head_dim=32, ffn_size=96, default_type=T.F32),
    "gemma3": SyntheticSpec("gemma3", num_layers=3, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=32, ffn_size=96, sliding_window=12,
                            default_type=T.F32),
}


def load_model(family: str, tmp_path, vocab_dir, dtype: torch.dtype):
    path = tmp_path / f"{family}.gguf"
    write_synthetic_gguf(path, SPECS[family], vocab_dir / "ggml-vocab-llama-spm.gguf", seed=11)
    return load(path, dtype, "cpu").model


def on_triton(worker, runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """runner.forward(batch) in the worker, on a copy of the runner. Its KV planes reach the
    worker through shared memory: the kernels' writes land in this process's planes, and
    the torch path's forward of the same batch then writes its own over them, so both
    sides read the same context in the next step."""
    twin = copy.copy(runner)
    twin.triton = True  # what the runner decides on a GPU
    return worker.call("operator:call", twin.forward, batch)


@pytest.mark.parametrize("family,kv_quant,dtype", [
    ("llama", "f16", torch.float32), ("qwen3", "k4v8", torch.float32),
    ("gemma3", "k8v4", torch.float32),
    ("llama", "f16", torch.bfloat16)])  # the norms and activation write bf16 matmul inputs
def test_fused_forward_matches_torch_path(triton_worker, tmp_path, vocab_dir, family, kv_quant,
                                          dtype):
    model = load_model(family, tmp_path, vocab_dir, dtype)
    assert model._mm_dtype == dtype
    runner = ModelRunner(model, 24, 16, kv_quant, max_context=96)
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    prompts = [rng.integers(3, 1000, n).tolist() for n in (9, 21, 3)]
    runner.forward(span_batch(runner, seqs, list(enumerate(prompts))))  # torch-path prefill
    steps = [[(0, [5]), (1, [6]), (2, [7])],  # decode-only: plan_decode
             [(0, [8]), (2, [11, 12, 13]), (1, [9])]]  # mixed, a prefill chunk: plan_batch
    for spans in steps:
        batch = span_batch(runner, seqs, spans)
        got = on_triton(triton_worker, runner, batch)
        ref = runner.forward(batch)  # the torch path
        assert torch.isfinite(got).all()
        rel = (got - ref).norm() / ref.norm()
        assert rel < (2e-3 if kv_quant == "f16" and dtype == torch.float32 else 2e-2), float(rel)
        top = ref.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 0.05  # random tiny models have near ties
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert runner.triton is False  # the reference side really ran the torch path


Q8_TYPES = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K,
            "attn_output.weight": T.Q4_K, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
            "ffn_down.weight": T.Q6_K}


def test_q8_layout_forward_matches_torch_path(triton_worker, tmp_path, vocab_dir):
    """The q8 layout on the Triton path: the norm kernels hand their output over already
    quantized (q|k|v, gate|up), the other products quantize x once per linear, Q6_K in
    qint's aligned rows; the torch path quantizes the same way in qint_reference."""
    spec = SyntheticSpec("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                         head_dim=64, ffn_size=512, types=Q8_TYPES, default_type=T.F32)
    path = tmp_path / "q8.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=13)
    model = load_for(path, EngineOptions(device="cpu", dtype="f32", weights="q8")).model
    assert model.blocks[0].qkv.takes_xq and model.blocks[0].down.takes_xq
    runner = ModelRunner(model, 24, 16, "f16", max_context=96)
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    runner.forward(span_batch(runner, seqs, [(i, rng.integers(3, 1000, n).tolist())
                                             for i, n in enumerate((9, 21, 3))]))
    for spans in ([(0, [5]), (1, [6]), (2, [7])],  # 3 rows: the CUDA-core kernel
                  [(0, [8]), (2, [11, 12, 13]), (1, [9])]):  # 5: the matrix-unit one
        batch = span_batch(runner, seqs, spans)
        got = on_triton(triton_worker, runner, batch)
        ref = runner.forward(batch)
        rel = (got - ref).norm() / ref.norm()
        # the kernel's norm and torch's round differently: codes that move by one move the
        # logits of these random models by 0-4% a row (20 inputs seen; once 9.7% over a
        # batch, when a moved code fed the next layer's quantization); a wrong layout or
        # code moves them by O(1)
        assert torch.isfinite(got).all() and rel < 0.2, float(rel)
    assert runner.triton is False  # the reference side really ran the torch path


def test_hybrid_layout_forward_matches_torch_path(triton_worker, tmp_path, vocab_dir):
    """The hybrid layout on the Triton path (copies from 4 rows): 3 rows take q8's kernels
    (x quantized by the norms), 5 rows the bf16 copies (the norms and the activation write
    bf16 for them); against the torch path of the same model."""
    spec = SyntheticSpec("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                         head_dim=64, ffn_size=512, types=Q8_TYPES, default_type=T.F32)
    path = tmp_path / "hybrid.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=17)
    model = load_for(path, EngineOptions(device="cpu", dtype="bf16", weights="hybrid",
                                         dense_rows=4)).model
    blk = model.blocks[0]
    assert blk.qkv.wants_xq(3) and not blk.qkv.wants_xq(5) and blk.down.dense_at(5)
    runner = ModelRunner(model, 24, 16, "f16", max_context=96)
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    runner.forward(span_batch(runner, seqs, [(i, rng.integers(3, 1000, n).tolist())
                                             for i, n in enumerate((9, 21, 3))]))
    # 3 rows: q8, bounded as the test above; 5 rows: the copies, where the two sides' bf16
    # roundings (norm output, products rounded to bf16 on the CPU, the attention's f16
    # operands) moved the logits 0.5-1.7% in the runs seen; a wrong layout or norm is O(1)
    for spans, bound in (([(0, [5]), (1, [6]), (2, [7])], 0.2),
                         ([(0, [8]), (2, [11, 12, 13]), (1, [9])], 0.05)):
        batch = span_batch(runner, seqs, spans)
        got = on_triton(triton_worker, runner, batch)
        ref = runner.forward(batch)
        rel = (got - ref).norm() / ref.norm()
        assert torch.isfinite(got).all() and rel < bound, float(rel)
    assert runner.triton is False
