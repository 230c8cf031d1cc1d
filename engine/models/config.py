"""ModelConfig: the hyperparameters one decoder family needs, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import GGUFFormatError
from engine.gguf import ModelFile


@dataclass(frozen=True, slots=True)
class YaRN:
    """YaRN RoPE scaling (arXiv:2309.00071) as ggml_rope_ext applies it with ext_factor 1:
    the context the model was trained at, the ramp's bounds in rotations and the
    magnitude factor's base (engine/layers/rope.py)."""

    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    ffn_size: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_neox: bool
    rope_freq_scale: float = 1.0
    rope_base_swa: float | None = None
    rope_freq_scale_swa: float = 1.0  # the sliding layers' (gpt-oss: the full layers')
    rope_yarn: YaRN | None = None  # YaRN scaling (gpt-oss), on every layer where set
    sliding_window: int | None = None
    swa_layers: tuple[bool, ...] = ()  # per layer: True if it uses the sliding window
    attn_scale: float | None = None  # None -> 1/sqrt(head_dim)
    qk_norm: bool = False
    post_norms: bool = False  # gemma: norm after attention and after the MLP too
    embed_scale: float = 1.0  # gemma multiplies embeddings by sqrt(hidden)
    final_softcap: float | None = None
    activation: str = "silu"  # "silu" (SwiGLU) | "gelu" (GeGLU, tanh GELU)
    # MoE (qwen3moe): every block's MLP is `num_experts` experts of ffn_size each, of which
    # a softmax router picks `experts_used` a token; their weights are the picked
    # probabilities, divided by their sum where `expert_weights_norm`, times
    # `expert_weights_scale` where it is set (llama.cpp's build_moe_ffn)
    num_experts: int = 0
    experts_used: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float | None = None
    # the MLP's pre-norm tensor (gpt-oss names it post_attention_norm)
    ffn_norm_tensor: str = "ffn_norm"
    # an embedding model's pooling of the output norm's states (`<arch>.pooling_type`, as
    # llama.cpp numbers it: 1 mean, 2 cls, 3 last); None: a generator only
    pooling: str | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.swa_layers)


POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*


def read_base_config(mf: ModelFile, *, rope_neox: bool, **overrides: object) -> ModelConfig:
    """The keys every decoder family shares (`<arch>.*`); families pass their differences."""
    num_heads = _int(mf, "attention.head_count")
    hidden = _int(mf, "embedding_length")
    num_kv = mf.arch_get("attention.head_count_kv", num_heads)
    if not isinstance(num_kv, int) or num_kv <= 0 or num_heads % num_kv:
        raise GGUFFormatError(
            f"{mf.architecture}.attention.head_count_kv must be a positive divisor of "
            f"head_count ({num_heads}), got {num_kv!r}")
    head_dim = mf.arch_get("attention.key_length", hidden // num_heads)
    tokens = mf.get("tokenizer.ggml.tokens")
    embd = mf.tensors.get("token_embd.weight")
    vocab = len(tokens) if tokens is not None else (embd.shape[0] if embd else 0)
    if vocab <= 0:
        raise GGUFFormatError("no vocabulary: tokenizer.ggml.tokens and token_embd.weight missing")
    freq_scale = 1.0
    if mf.arch_get("rope.scaling.type") == "linear":
        freq_scale = 1.0 / float(mf.arch_get("rope.scaling.factor", 1.0))
    values: dict[str, object] = dict(
        architecture=mf.architecture,
        num_layers=_int(mf, "block_count"),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        head_dim_v=mf.arch_get("attention.value_length", head_dim),
        ffn_size=overrides["ffn_size"] if "ffn_size" in overrides else _int(
            mf, "feed_forward_length"),
        vocab_size=vocab,
        context_length=_int(mf, "context_length"),
        rms_eps=float(mf.arch_require("attention.layer_norm_rms_epsilon", (int, float))),
        rope_base=float(mf.arch_get("rope.freq_base", 10000.0)),
        rope_neox=rope_neox,
        rope_freq_scale=freq_scale,
        pooling=POOLING_TYPES.get(mf.arch_get("pooling_type", 0)),
    )
    values.update(overrides)
    return ModelConfig(**values)  # type: ignore[arg-type]


def read_experts(mf: ModelFile) -> tuple[int, int, int]:
    """(expert_count, expert_used_count, each expert's feed-forward length): the last from
    `expert_feed_forward_length`, else feed_forward_length / expert_used_count, as
    llama.cpp falls back. Bad counts get an error that names the key."""
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
    return experts, used, ffn


def _int(mf: ModelFile, suffix: str) -> int:
    value = mf.arch_require(suffix, int)
    if value <= 0:
        raise GGUFFormatError(f"{mf.architecture}.{suffix} must be positive, got {value}")
    return value
