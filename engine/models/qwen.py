"""qwen2 (q/k/v biases), qwen3 (q/k RMSNorm per head) and qwen3moe (qwen3 with a
mixture-of-experts MLP in every block): SwiGLU, NEOX RoPE."""

from __future__ import annotations

from engine.errors import GGUFFormatError
from engine.gguf import ModelFile
from engine.models.config import ModelConfig, read_base_config


def read_qwen2_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True)  # biases are picked up by the loader


def read_qwen3_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True, qk_norm=True)


def read_qwen3moe_config(mf: ModelFile) -> ModelConfig:
    """qwen3 with `expert_count` experts of `expert_feed_forward_length` (else
    feed_forward_length / expert_used_count, as llama.cpp falls back), softmax routing over
    them, `expert_used_count` a token with their weights normalized to sum 1."""
    experts = mf.arch_get("expert_count", 0)
    used = mf.arch_get("expert_used_count", 0)
    for key, value in (("expert_count", experts), ("expert_used_count", used)):
        if not isinstance(value, int) or value <= 0:
            raise GGUFFormatError(f"{mf.architecture}.{key} must be a positive integer, "
                                  f"got {value!r}")
    if used > experts:
        raise GGUFFormatError(f"{mf.architecture}.expert_used_count ({used}) exceeds "
                              f"expert_count ({experts})")
    ffn = mf.arch_get("expert_feed_forward_length")
    if ffn is None:
        total = mf.arch_get("feed_forward_length")
        ffn = total // used if isinstance(total, int) else None
    if not isinstance(ffn, int) or ffn <= 0:
        raise GGUFFormatError(f"{mf.architecture}.expert_feed_forward_length must be a "
                              f"positive integer, got {ffn!r}")
    scale = mf.arch_get("expert_weights_scale")
    return read_base_config(mf, rope_neox=True, qk_norm=True, ffn_size=ffn,
                            num_experts=experts, experts_used=used, expert_weights_norm=True,
                            expert_weights_scale=float(scale) if scale else None)
