"""qwen2 (q/k/v biases) and qwen3 (q/k RMSNorm per head): SwiGLU, NEOX RoPE."""

from __future__ import annotations

from engine.gguf import ModelFile
from engine.models.config import ModelConfig, read_base_config


def read_qwen2_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True)  # biases are picked up by the loader


def read_qwen3_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=True, qk_norm=True)
