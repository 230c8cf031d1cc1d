"""gemma3: GeGLU, q/k norm, norms before and after attention and MLP, embeddings scaled by
sqrt(hidden), sliding window on 5 of every 6 layers with their own RoPE base (10000)."""

from __future__ import annotations

import math

from engine.gguf import ModelFile
from engine.models.config import ModelConfig, read_base_config

SWA_PATTERN = 6  # layer i slides unless i % 6 == 5


def read_config(mf: ModelFile) -> ModelConfig:
    num_layers = mf.arch_require("block_count", int)
    window = mf.arch_get("attention.sliding_window")
    swa: tuple[bool, ...] = ()
    if window:
        pattern = mf.arch_get("attention.sliding_window_pattern", SWA_PATTERN)
        swa = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers))
    hidden = mf.arch_require("embedding_length", int)
    head_dim = mf.arch_get("attention.key_length", hidden // mf.arch_require(
        "attention.head_count", int))
    softcap = mf.arch_get("final_logit_softcapping")
    return read_base_config(
        mf,
        rope_neox=True,
        qk_norm=True,
        post_norms=True,
        activation="gelu",
        embed_scale=math.sqrt(hidden),
        sliding_window=int(window) if window else None,
        swa_layers=swa,
        rope_base_swa=float(mf.arch_get("rope.freq_base_swa", 10000.0)),
        attn_scale=1.0 / math.sqrt(head_dim),
        final_softcap=float(softcap) if softcap else None,
    )
