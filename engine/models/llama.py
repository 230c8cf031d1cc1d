"""llama (Llama 2/3.x): SwiGLU, original RoPE pair layout, optional rope_freqs (Llama 3.1)."""

from __future__ import annotations

from engine.gguf import ModelFile
from engine.models.config import ModelConfig, read_base_config


def read_config(mf: ModelFile) -> ModelConfig:
    return read_base_config(mf, rope_neox=False)
