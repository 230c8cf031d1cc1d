"""gpt-oss (llama.cpp's openai-moe): a mixture of experts in every block, routed by the
top k of the router's biased logits with their softmax as weights; experts with biases
and a clamped SwiGLU (swiglu_oai); q/k/v and output biases; a sink logit a head in every
attention; NEOX RoPE with YaRN scaling; sliding-window attention on every other layer
(layer 0 slides); the MLP's pre-norm stored as post_attention_norm."""

from __future__ import annotations

from engine.errors import GGUFFormatError
from engine.gguf import ModelFile
from engine.models.config import ModelConfig, YaRN, read_base_config, read_experts

SWA_PATTERN = 2  # layer i slides where i % 2 == 0 (llama.cpp's load_swa_pattern(ml, 2))


def read_config(mf: ModelFile) -> ModelConfig:
    experts, used, ffn = read_experts(mf)
    layers = mf.arch_require("block_count", int)
    window = mf.arch_require("attention.sliding_window", int)
    if window <= 0:
        raise GGUFFormatError(f"{mf.architecture}.attention.sliding_window must be positive, "
                              f"got {window}")
    pattern = mf.arch_get("attention.sliding_window_pattern", SWA_PATTERN)
    if hasattr(pattern, "tolist"):  # the reader's arrays (and scalars) are numpy's
        pattern = pattern.tolist()
    if isinstance(pattern, list):  # a flag a layer; layers past the list attend fully
        swa = tuple(bool(pattern[i]) if i < len(pattern) else False for i in range(layers))
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        swa = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(layers))
    else:
        raise GGUFFormatError(f"{mf.architecture}.attention.sliding_window_pattern must be "
                              f"an integer or a list of flags, got {pattern!r}")
    scale, yarn = 1.0, None
    kind = mf.arch_get("rope.scaling.type")
    factor = float(mf.arch_get("rope.scaling.factor", 0.0) or 0.0)
    if kind in ("linear", "yarn") and factor:
        scale = 1.0 / factor
    if kind == "yarn":
        yarn = YaRN(int(mf.arch_get("rope.scaling.original_context_length",
                                    mf.arch_require("context_length", int))),
                    attn_factor=float(mf.arch_get("rope.scaling.attn_factor", 1.0)))
    elif kind not in (None, "none", "linear"):
        raise GGUFFormatError(f"{mf.architecture}.rope.scaling.type {kind!r} is not "
                              f"supported (none, linear, yarn)")
    base = float(mf.arch_get("rope.freq_base", 10000.0))
    return read_base_config(
        mf, rope_neox=True, ffn_size=ffn, num_experts=experts, experts_used=used,
        # the softmax over the k picked logits: the picked probabilities divided by their sum
        expert_weights_norm=True, activation="swiglu_oai", sliding_window=window,
        swa_layers=swa, rope_freq_scale=scale, rope_yarn=yarn,
        rope_base_swa=float(mf.arch_get("rope.freq_base_swa", base)),
        rope_freq_scale_swa=scale, ffn_norm_tensor="post_attention_norm")
