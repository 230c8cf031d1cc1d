"""The one-row q|k|v product doing RoPE and the f16 K/V store in its finish
(engine/layers/attention.py rope_in_qkv, kernels/qint.py RopeStore) against rope_qk's launch
(MBUFO_ROPE_IN_QKV=0), on a tiny Llama whose shapes take NVIDIA's one-row kernel with its
splits in one program: the same greedy tokens and logits within float32 rounding, decode
steps replayed from CUDA graphs, and the fold actually taken.
Runs on the lent GPU machine (`pytest -m gpu`), never in CI."""

from __future__ import annotations

import pytest
import torch
from span_batch import span_batch

from engine.build import EngineOptions, load_for
from engine.kv.pool import SeqPages
from engine.runner import ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.gpu
T = __import__("gguf").GGMLQuantizationType
# q|k in Q4_K with v in Q6_K (one two-type launch), or all three in Q4_K; 4 super-blocks
# a row, so the one-row config splits them (rope_fits needs the splits in one program)
TYPES = {"q4k_q6k": {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K,
                     "attn_v.weight": T.Q6_K},
         "q4k": {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q4_K}}


@pytest.fixture(scope="module", params=sorted(TYPES))
def llama(request, tmp_path_factory, vocab_dir):
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    types = {**TYPES[request.param], "attn_output.weight": T.Q4_K,
             "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K, "ffn_down.weight": T.Q6_K}
    spec = SyntheticSpec("llama", hidden_size=1024, num_heads=8, num_kv_heads=2,
                         head_dim=128, ffn_size=1024, num_layers=2, types=types)
    path = tmp_path_factory.mktemp("rope") / f"{request.param}.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=11)
    return path


def test_rope_in_qkv_matches_rope_qk(llama, monkeypatch):
    import engine.layers.ggml_linear as ggml_linear

    options = EngineOptions(sessions=4, context=256, prefill_chunk=64, device="cuda",
                            dtype="bf16", weights="q8", cuda_graphs=True, kv_quant="f16",
                            max_pending_per_client=None)
    model = load_for(llama, options).model
    folded = []
    plain_parts = ggml_linear.qint_parts

    def counted(*args, **kwargs):
        folded.append(kwargs.get("rope") is not None)
        return plain_parts(*args, **kwargs)

    monkeypatch.setattr(ggml_linear, "qint_parts", counted)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 20000, (37,), generator=gen).tolist()
    out = {}
    for fold in ("0", "1"):
        monkeypatch.setenv("MBUFO_ROPE_IN_QKV", fold)
        folded.clear()
        runner = ModelRunner(model, 96, 16, "f16", cuda_graphs=True, max_context=256)
        pages = [SeqPages(runner.pool)]
        spans, rows, tokens = [(0, prompt)], [], []
        for _ in range(8):  # a prefill step, then one-row decode steps (graph replays)
            logits = runner.forward(span_batch(runner, pages, spans)).cpu()
            rows.append(logits)
            tokens.append(int(logits[-1].argmax()))
            spans = [(0, [tokens[-1]])]
        assert runner.graphs is not None and runner.graphs.num_replays >= 6
        assert any(folded) == (fold == "1"), folded  # captured decode steps took it
        out[fold] = (tokens, torch.cat(rows))
    assert out["1"][0] == out["0"][0]
    a, b = out["0"][1], out["1"][1]
    assert torch.isfinite(b).all() and float((a - b).norm() / a.norm()) < 1e-5
