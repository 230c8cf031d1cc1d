"""Random-weight GGUF files with a family's exact tensor names and shapes.

Used by the parity tests (tiny models, a real vocabulary copied from another GGUF) and by
`mbufo bench --synthetic` (a real model's shapes, no real weights). Quantized tensors are
random GGML blocks whose scale fields are set to small finite values, so the true weights
are whatever `gguf.quants.dequantize` says they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from engine.cache_files import write_whole

T = gguf.GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    architecture: str  # llama | qwen2 | qwen3 | qwen3moe | gemma3 | gpt-oss
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn_size: int = 128
    context_length: int = 2048
    rope_base: float = 10000.0
    sliding_window: int | None = None
    rms_eps: float = 1e-6
    tied_embeddings: bool = True
    # tensor-name suffix -> GGML type; anything unlisted is F32 (vectors) or `default_type`
    types: dict[str, int] = field(default_factory=dict)
    default_type: int = T.F16
    rope_freq_factors: bool = False  # write rope_freqs.weight (Llama 3.1 style)
    # general.file_type (gguf.LlamaFileType): the recipe's name, as llama.cpp labels a file
    file_type: int = gguf.LlamaFileType.MOSTLY_F16
    # MoE (qwen3moe, gpt-oss): experts of `expert_ffn_size` each, `experts_used` a token
    num_experts: int = 0
    experts_used: int = 0
    expert_ffn_size: int = 0
    # YaRN RoPE scaling (gpt-oss): the factor and the trained context; 0: none
    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    # an embedding model's pooling (`<arch>.pooling_type`, gguf.PoolingType); 0: none
    pooling_type: int = 0


# (scale field byte offset, count of f16 scales) inside one block, for random-block fixing
_SCALE_FIELDS = {
    T.Q4_0: [(0, 1)], T.Q4_1: [(0, 2)], T.Q5_0: [(0, 1)], T.Q5_1: [(0, 2)], T.Q8_0: [(0, 1)],
    T.Q2_K: [(80, 2)], T.Q3_K: [(108, 1)], T.Q4_K: [(0, 2)], T.Q5_K: [(0, 2)],
    T.Q6_K: [(208, 1)],
}
# rough magnitude of |q * sub-scale| per type, so weights come out near `std`
_CODE_GAIN = {T.Q4_0: 8, T.Q4_1: 8, T.Q5_0: 16, T.Q5_1: 16, T.Q8_0: 128, T.Q2_K: 30,
              T.Q3_K: 128, T.Q4_K: 400, T.Q5_K: 800, T.Q6_K: 1500}


def random_blocks(qtype: int, shape: tuple[int, ...], rng: np.random.Generator,
                  std: float = 0.05) -> np.ndarray:
    """Random GGML blocks for a tensor of torch-order `shape`: uint8 (rows, bytes_per_row)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    n_blocks = rows * shape[-1] // block
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.MXFP4:  # an E8M0 exponent a block: 2^(e - 128) times codes up to 12
        raw[:, 0] = rng.integers(119, 123, size=n_blocks) + round(np.log2(std / 0.05))
    for offset, count in _SCALE_FIELDS.get(qtype, []):
        scales = (rng.uniform(0.2, 1.0, size=(n_blocks, count)) * std * 2 / _CODE_GAIN[qtype])
        raw[:, offset:offset + 2 * count] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, shape[-1] // block * type_size)


def tensor_shapes(spec: SyntheticSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> torch-order shape, as llama.cpp expects the family's tensors."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab_size, h),
                                          "output_norm.weight": (h,)}
    if not spec.tied_embeddings:
        shapes["output.weight"] = (vocab_size, h)
    if spec.rope_freq_factors:
        shapes["rope_freqs.weight"] = (spec.head_dim // 2,)
    oss = spec.architecture == "gpt-oss"
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "attn_q.weight": (q, h),
            p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
            p + "attn_output.weight": (h, q),
            p + ("post_attention_norm.weight" if oss else "ffn_norm.weight"): (h,),
        })
        if oss:  # biases everywhere, a sink a head
            e, f = spec.num_experts, spec.expert_ffn_size
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                           p + "attn_v.bias": (kv,), p + "attn_output.bias": (h,),
                           p + "attn_sinks.weight": (spec.num_heads,),
                           p + "ffn_gate_inp.bias": (e,), p + "ffn_gate_exps.bias": (e, f),
                           p + "ffn_up_exps.bias": (e, f), p + "ffn_down_exps.bias": (e, h)})
        if spec.num_experts:
            e, f = spec.num_experts, spec.expert_ffn_size
            shapes.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, f, h),
                           p + "ffn_up_exps.weight": (e, f, h),
                           p + "ffn_down_exps.weight": (e, h, f)})
        else:
            shapes.update({p + "ffn_gate.weight": (spec.ffn_size, h),
                           p + "ffn_up.weight": (spec.ffn_size, h),
                           p + "ffn_down.weight": (h, spec.ffn_size)})
        if spec.architecture == "qwen2":
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                           p + "attn_v.bias": (kv,)})
        if spec.architecture in ("qwen3", "qwen3moe", "gemma3"):
            shapes.update({p + "attn_q_norm.weight": (spec.head_dim,),
                           p + "attn_k_norm.weight": (spec.head_dim,)})
        if spec.architecture == "gemma3":
            shapes.update({p + "post_attention_norm.weight": (h,),
                           p + "post_ffw_norm.weight": (h,)})
    return shapes


# llama.cpp's fallback for a row length that is not a multiple of the type's block
# (tensor_type_fallback in src/llama-quant.cpp): 256-blocks go to a 32-block type, and a
# row that fits no 32-block either is written in F16.
_BLOCK_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1,
                   T.Q6_K: T.Q8_0}


def _fit_rows(qtype: int, shape: tuple[int, ...]) -> int:
    def fits(t: int) -> bool:
        return shape[-1] % gguf.GGML_QUANT_SIZES[t][0] == 0

    if len(shape) == 1 or fits(qtype):
        return qtype
    qtype = _BLOCK_FALLBACK.get(qtype, qtype)
    return qtype if fits(qtype) else T.F16


def _tensor_type(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> int:
    if name.endswith((".ffn_gate_inp.weight", ".bias")):
        return T.F32  # llama.cpp never quantizes the router (llama-quant.cpp) or a bias
    qtype = spec.types.get(name)  # a whole name ("blk.3.attn_v.weight") first
    if qtype is None:
        for suffix, t in spec.types.items():  # whole name components: "output.weight" is
            if name.endswith("." + suffix):  # the head, not attn_output
                qtype = t
                break
        else:
            qtype = T.F32 if len(shape) == 1 else spec.default_type
    return _fit_rows(qtype, shape)


def copy_vocabulary(writer: gguf.GGUFWriter, vocab_path: str | os.PathLike) -> int:
    """Copy every tokenizer.* key of another GGUF; returns the vocabulary size."""
    from engine.gguf import scan_file
    from engine.gguf.reader import MappedReader  # the stock reader takes ~10 s per vocab

    scan_file(vocab_path)  # the bounded pre-scan first, as for any model file
    reader = MappedReader(vocab_path)
    size = 0
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(fld.types[0])
        value = fld.contents()
        if key == "tokenizer.ggml.tokens":
            size = len(value)
        sub = gguf.GGUFValueType(fld.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    return size


def write_synthetic_gguf(path: str | os.PathLike, spec: SyntheticSpec,
                         vocab_path: str | os.PathLike, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    arch = spec.architecture
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.ffn_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_base)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    if spec.yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(spec.yarn_original_context)
    if spec.num_experts:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_used)
        writer.add_expert_feed_forward_length(spec.expert_ffn_size)
    if spec.pooling_type:
        writer.add_pooling_type(gguf.PoolingType(spec.pooling_type))
    writer.add_file_type(spec.file_type)
    vocab_size = copy_vocabulary(writer, vocab_path)
    for name, shape in tensor_shapes(spec, vocab_size).items():
        qtype = _tensor_type(spec, name, shape)
        if name == "rope_freqs.weight":
            data = rng.uniform(1.0, 8.0, size=shape).astype(np.float32)
        elif len(shape) == 1:  # norms near 1, biases near 0
            base = 0.0 if name.endswith(".bias") else 1.0
            data = (base + rng.normal(0, 0.1, size=shape)).astype(np.float32)
        elif qtype in (T.F32, T.F16, T.BF16):
            # a router 10x wider than the other matrices: its softmax picks its experts as
            # clearly as a trained one's, so that tiny rounding differences (llama.cpp's
            # 8-bit activations) seldom swap one
            std = 0.5 if name.endswith(".ffn_gate_inp.weight") else 0.05
            data = rng.normal(0, std, size=shape).astype(np.float32)
            if qtype == T.F16:
                data = data.astype(np.float16)
            elif qtype == T.BF16:
                data = gguf.quants.quantize(data, T.BF16)
        else:  # (..., bytes a row): the writer reads the leading dims as the tensor's own
            data = random_blocks(qtype, shape, rng).reshape(*shape[:-1], -1)
        raw_dtype = None if qtype in (T.F32, T.F16) else qtype
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Real models' shapes for `mbufo bench --synthetic NAME:QUANT` (random weights, same bytes).
PRESETS: dict[str, SyntheticSpec] = {
    "llama-3.1-8b": SyntheticSpec("llama", num_layers=32, hidden_size=4096, num_heads=32,
                                  num_kv_heads=8, head_dim=128, ffn_size=14336,
                                  context_length=131072, rope_base=500000.0, rms_eps=1e-5,
                                  tied_embeddings=False, rope_freq_factors=True),
    "qwen3-8b": SyntheticSpec("qwen3", num_layers=36, hidden_size=4096, num_heads=32,
                              num_kv_heads=8, head_dim=128, ffn_size=12288,
                              context_length=40960, rope_base=1000000.0,
                              tied_embeddings=False),
    "qwen3-30b-a3b": SyntheticSpec("qwen3moe", num_layers=48, hidden_size=2048, num_heads=32,
                                   num_kv_heads=4, head_dim=128, ffn_size=6144,
                                   context_length=40960, rope_base=1000000.0,
                                   tied_embeddings=False, num_experts=128, experts_used=8,
                                   expert_ffn_size=768),
    # head_dim 64 beside a hidden size of 2880 (not 64 x 64); 32 experts of 2880, 4 a token
    "gpt-oss-20b": SyntheticSpec("gpt-oss", num_layers=24, hidden_size=2880, num_heads=64,
                                 num_kv_heads=8, head_dim=64, ffn_size=2880,
                                 context_length=131072, rope_base=150000.0, rms_eps=1e-5,
                                 sliding_window=128, tied_embeddings=False, num_experts=32,
                                 experts_used=4, expert_ffn_size=2880, yarn_factor=32.0,
                                 yarn_original_context=4096),
    "gemma3-270m": SyntheticSpec("gemma3", num_layers=18, hidden_size=640, num_heads=4,
                                 num_kv_heads=1, head_dim=256, ffn_size=2048,
                                 context_length=32768, rope_base=1000000.0,
                                 sliding_window=512),
}
# Quantization recipes by tensor name suffix (whole components), ".weight" the default for
# the matrices, after llama.cpp's type choice per tensor (llama_tensor_get_type_impl in
# src/llama-quant.cpp, llama-cpp-python 0.3.36's vendor/llama.cpp). Its Q4_K_M puts the head
# (output.weight; token_embd.weight where the embeddings are tied, since it is the head
# then) in Q6_K, an untied token_embd stays Q4_K, and the rows that fit no 256-block fall
# back as `_fit_rows` says (gemma3-270m's 640 columns: Q4_K -> Q5_0, Q6_K -> Q8_0).
# general.file_type of each recipe (llama.cpp's llama_ftype)
FILE_TYPES: dict[str, int] = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                              "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
                              "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                              "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}
RECIPES: dict[str, dict[str, int]] = {
    "Q4_K_M": {"output.weight": T.Q6_K, ".weight": T.Q4_K},
    "Q8_0": {".weight": T.Q8_0},
    "Q6_K": {".weight": T.Q6_K},
    "BF16": {".weight": T.BF16},
    # gpt-oss as released: MXFP4 experts, every other matrix BF16
    "MXFP4": {"ffn_gate_exps.weight": T.MXFP4, "ffn_up_exps.weight": T.MXFP4,
              "ffn_down_exps.weight": T.MXFP4, ".weight": T.BF16},
}
# Types llama.cpp gives a suffix on the layers where `more_bits_layer` holds. For Q4_K_M:
# attn_v (its counter of attn_v tensors, which run in block order) and ffn_down (its block
# index) in Q6_K, whatever the GQA ratio; the other layers keep Q4_K. Not modelled, since no
# preset has them: 8-expert MoE models (attn_v and attn_k Q8_0, attn_output Q5_K) and the
# 70B model type (its other attn_v layers Q5_K).
MORE_BITS: dict[str, dict[str, int]] = {
    "Q4_K_M": {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
               "ffn_down_exps.weight": T.Q6_K},  # its name test is "ffn_down" in the name
}


def more_bits_layer(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third
    one between them (integer eighths, as in C)."""
    first, last = n_layers // 8, 7 * n_layers // 8
    return i_layer < first or i_layer >= last or (i_layer - first) % 3 == 2


def synthetic_spec(name_quant: str) -> SyntheticSpec:
    """'llama-3.1-8b:Q4_K_M' -> the preset's spec with the recipe's tensor types."""
    name, _, quant = name_quant.partition(":")
    quant = quant or "Q4_K_M"
    if name not in PRESETS or quant not in RECIPES:
        raise ValueError(f"unknown synthetic model {name_quant!r}: models "
                         f"{sorted(PRESETS)}, quantizations {sorted(RECIPES)}")
    preset, recipe = PRESETS[name], RECIPES[quant]
    types = {k: v for k, v in recipe.items() if k != ".weight"}
    if preset.tied_embeddings and "output.weight" in recipe:
        types["token_embd.weight"] = recipe["output.weight"]
    for suffix, qtype in MORE_BITS.get(quant, {}).items():
        for i in range(preset.num_layers):
            if more_bits_layer(i, preset.num_layers):
                types[f"blk.{i}.{suffix}"] = qtype
    return replace(preset, types=types, default_type=recipe[".weight"],
                   file_type=FILE_TYPES[quant])


def _written_as(path: Path, spec: SyntheticSpec) -> bool:
    """Whether the file at `path` has the spec's tensors: names, shapes and types."""
    from engine.gguf.reader import MappedReader

    try:
        found = {t.name: (tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type))
                 for t in MappedReader(path).tensors}
    except (OSError, ValueError):
        return False
    vocab_size = found.get("token_embd.weight", ((0,), 0))[0][0]
    return found == {name: (shape, _tensor_type(spec, name, shape))
                     for name, shape in tensor_shapes(spec, vocab_size).items()}


def ensure_synthetic(name_quant: str, vocab_path: str | os.PathLike,
                     cache_dir: str | os.PathLike) -> Path:
    """The synthetic file for NAME:QUANT in `cache_dir`, written once (seed 0); written
    again where the cached one's tensors are not the recipe's (an earlier recipe's file)."""
    spec = synthetic_spec(name_quant)
    target = Path(cache_dir) / (name_quant.replace(":", "_").replace("/", "_") + ".gguf")
    if not (target.exists() and _written_as(target, spec)):
        # through a partial file of this writer's own: two processes filling the cache at
        # once (a bench beside a test run) each replace the target with the same bytes
        write_whole(target, lambda partial: write_synthetic_gguf(partial, spec, vocab_path,
                                                                 seed=0))
    return target
