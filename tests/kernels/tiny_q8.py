"""A tiny synthetic Llama on the q8 layout, for decoder steps in the interpreter's worker
(test_model_q8_head.py)."""

from __future__ import annotations

from pathlib import Path

T = __import__("gguf").GGMLQuantizationType


def write_tiny_llama(path: Path, vocab_gguf: Path, seed: int) -> None:
    """Two layers of 256 columns in Q4_K_M's types (Q6_K v, down and head)."""
    from engine.synthetic import SyntheticSpec, write_synthetic_gguf

    q4 = {name: T.Q4_K for name in ("attn_q.weight", "attn_k.weight", "attn_output.weight",
                                     "ffn_gate.weight", "ffn_up.weight", "token_embd.weight")}
    spec = SyntheticSpec("llama", hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=512, num_layers=2,
                         types={**q4, "attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                                "output.weight": T.Q6_K})
    write_synthetic_gguf(path, spec, vocab_gguf, seed=seed)


def tiny_core(path: str):
    """(engine core, model, the vocabulary's size) on the CPU's Triton path, the model's
    head cut to its first 256 rows (the vocabulary's 128256 take minutes interpreted)."""
    from engine.build import EngineOptions, build_core, load_for
    from engine.layers import ggml_linear

    opts = EngineOptions(sessions=1, context=64, prefill_chunk=16, device="cpu",
                         dtype="f32", weights="q8", cuda_graphs=False,
                         max_pending_per_client=None)
    core = build_core(load_for(Path(path), opts), opts)
    model = core.runner.model
    part, vocab = model.head.parts[0], model.head.out_features
    model.head = ggml_linear.GGMLLinear(
        [ggml_linear.GGMLPart(256, part.ggml_type, part.weight[:256].clone())],
        model.head.in_features, act8=model.head.act8)
    return core, model, vocab
