"""Synthetic GGUF recipes (engine/synthetic.py): tensor types by whole name components."""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from engine.synthetic import _tensor_type, synthetic_spec


def test_q4_k_m_recipe_types():
    """llama.cpp's Q4_K_M as the synthetic files approximate it: attn_v, ffn_down and the
    head in Q6_K, the other linears (attn_output among them) in Q4_K, norms in F32."""
    spec = synthetic_spec("llama-3.1-8b:Q4_K_M")
    mat, vec = (4096, 4096), (4096,)
    want = {"output.weight": T.Q6_K, "blk.3.attn_output.weight": T.Q4_K,
            "blk.3.attn_v.weight": T.Q6_K, "blk.3.ffn_down.weight": T.Q6_K,
            "blk.3.attn_q.weight": T.Q4_K, "blk.3.ffn_gate.weight": T.Q4_K,
            "token_embd.weight": T.Q4_K}
    for name, qtype in want.items():
        assert _tensor_type(spec, name, mat) == qtype, name
    assert _tensor_type(spec, "blk.3.attn_norm.weight", vec) == T.F32
