"""qwen2 (q/k/v biases), qwen3 (q/k RMSNorm per head) and qwen3moe (qwen3 with a
mixture-of-experts MLP in every block): SwiGLU, NEOX RoPE."""

from __future__ import annotations

from engine.gguf import ModelFile
from engine.models.config import ModelConfig, read_base_config, read_experts


def read_qwen2_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True)  # biases are picked up by the loader


def read_qwen3_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True, qk_norm=True)


def read_qwen3moe_config(mf: ModelFile) -> ModelConfig:
    """qwen3 with `expert_count` experts (config.read_experts), softmax routing over them,
    `expert_used_count` a token with their weights normalized to sum 1."""
    experts, used, ffn = read_experts(mf)
    scale = mf.arch_get("expert_weights_scale")
    return read_base_config(mf, rope_neox=True, qk_norm=True, ffn_size=ffn,
                            num_experts=experts, experts_used=used, expert_weights_norm=True,
                            expert_weights_scale=float(scale) if scale else None)
