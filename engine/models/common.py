"""The shared decoder: embedding, N blocks of (norm, attention, norm, gated MLP), head.

Families (llama, qwen2/qwen3, qwen3moe, gemma3, gpt-oss) differ only in ModelConfig flags
and config reading (qwen3moe's and gpt-oss's MLPs are mixtures of experts:
engine/layers/moe.py; gpt-oss's attention has sinks);
the forward below serves every ForwardBatch row in one pass over the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.kernel_select import use_triton
from engine.kv.cache import KVCache, LayerKVSpec
from engine.layers.activation import ACTIVATIONS
from engine.layers.attention import AttnLayer, attend, attend_q8, attn_quant_enabled, kv_target
from engine.layers.linear import Int8Linear, Linear
from engine.layers.moe import MoE
from engine.layers.norm import rms_norm
from engine.layers.rope import Rope
from engine.models.config import ModelConfig
from engine.models.weights import WeightLoader
from kernels.fused_norm import NormOut, add_rms_norm
from kernels.fused_rope import rope_qk
from kernels.gated_act import gated_act, gated_act_quant
from kernels.moe_route import Combined
from kernels.quant_x import QuantX

# A block output on its way into the residual stream: (output, post-norm weight or None).
# (a MoE block's output may be its Combined: the fused norm kernel combines it)
_Residual = tuple[torch.Tensor | Combined, torch.Tensor | None]


def _act8(linear: object, fused: bool, rows: int) -> bool:
    """Whether the norm kernel before `linear`'s call of `rows` rows also quantizes its
    output for it (a linear of the q8 layout, which would otherwise launch that quantization
    itself; the hybrid layout's only below its dense copies' threshold)."""
    wants = getattr(linear, "wants_xq", None)
    return fused and wants is not None and wants(rows)


def _in_dtype(linear: object, rows: int, default: torch.dtype) -> torch.dtype:
    """What the kernel before `linear`'s call of `rows` rows writes: the dtype that call
    multiplies in where the layer says (the hybrid layout's dense copies: bf16), else
    `default`."""
    of = getattr(linear, "input_dtype", None)
    return default if of is None else of(rows)


@dataclass(slots=True)
class Block:
    attn: AttnLayer
    attn_norm: torch.Tensor
    qkv: Linear | Int8Linear  # fused q, k, v rows
    out: Linear | Int8Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | Int8Linear | None  # fused gate, up rows (None: a MoE block)
    down: Linear | Int8Linear | None
    moe: MoE | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


class DecoderModel:
    """forward(batch, kv) -> hidden states at batch.logits_rows; logits(hidden) -> f32 logits."""

    def __init__(self, cfg: ModelConfig, weights: WeightLoader) -> None:
        self.cfg = cfg
        table = (cfg.vocab_size, cfg.hidden_size)
        self.embedding = weights.embedding("token_embd.weight", table)
        self.output_norm = weights.vector("output_norm.weight", cfg.hidden_size)
        self.head = weights.head("output.weight", table, self.embedding)  # tied when absent
        factors = weights.vector("rope_freqs.weight", cfg.head_dim // 2) if weights.has(
            "rope_freqs.weight") else None
        self.rope = Rope(cfg.head_dim, cfg.rope_base, cfg.rope_neox, cfg.rope_freq_scale, factors,
                         cfg.rope_yarn)
        self.rope_swa = self.rope
        if cfg.rope_base_swa is not None and cfg.swa_layers and (
                cfg.rope_base_swa, cfg.rope_freq_scale_swa, factors) != (
                cfg.rope_base, cfg.rope_freq_scale, None):
            self.rope_swa = Rope(cfg.head_dim, cfg.rope_base_swa, cfg.rope_neox,
                                 cfg.rope_freq_scale_swa, yarn=cfg.rope_yarn)
        self.blocks = [self._load_block(weights, i) for i in range(cfg.num_layers)]
        self.device = weights.device
        # the hybrid layout's threshold (every linear keeps a dense copy); None otherwise
        self.dense_rows = weights.dense_rows
        self._act = ACTIVATIONS[cfg.activation]
        # What the block matmuls read: bf16 when all are dense bf16 layers (they round x to
        # bf16 first), so that the fused kernels write it and no cast kernel runs.
        mats = [m for b in self.blocks for m in (b.qkv, b.gate_up, b.down) if m is not None]
        self._mm_dtype = torch.bfloat16 if all(
            isinstance(m, Linear) and m.weight.dtype == torch.bfloat16 for m in mats) \
            else torch.float32

    def _load_block(self, w: WeightLoader, i: int) -> Block:
        cfg, p = self.cfg, f"blk.{i}."
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        v_dim = cfg.num_kv_heads * cfg.head_dim_v
        qkv = w.fused([p + "attn_q", p + "attn_k", p + "attn_v"],
                      [q_dim, kv_dim, v_dim], cfg.hidden_size)
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        sinks = w.vector(p + "attn_sinks.weight", cfg.num_heads) if w.has(
            p + "attn_sinks.weight") else None  # gpt-oss
        block = Block(
            attn=AttnLayer(i, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v,
                           scale, window, sinks=sinks),
            attn_norm=w.vector(p + "attn_norm.weight", cfg.hidden_size),
            qkv=qkv,
            out=w.linear(p + "attn_output", (cfg.hidden_size, cfg.num_heads * cfg.head_dim_v)),
            ffn_norm=w.vector(p + cfg.ffn_norm_tensor + ".weight", cfg.hidden_size),
            gate_up=None,
            down=None,
        )
        if cfg.num_experts:
            m = w.experts(p, cfg.num_experts, cfg.ffn_size, cfg.hidden_size)
            block.moe = MoE(m.router, m.gate_up, m.down, cfg.experts_used,
                            cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.activation,
                            m.router_bias)
        else:
            block.gate_up = w.fused([p + "ffn_gate", p + "ffn_up"], [cfg.ffn_size] * 2,
                                    cfg.hidden_size)
            block.down = w.linear(p + "ffn_down", (cfg.hidden_size, cfg.ffn_size))
        if cfg.qk_norm:
            block.q_norm = w.vector(p + "attn_q_norm.weight", cfg.head_dim)
            block.k_norm = w.vector(p + "attn_k_norm.weight", cfg.head_dim)
        if cfg.post_norms:
            block.post_attn_norm = w.vector(p + "post_attention_norm.weight", cfg.hidden_size)
            block.post_ffn_norm = w.vector(p + "post_ffw_norm.weight", cfg.hidden_size)
        return block

    def kv_layers(self) -> list[LayerKVSpec | None]:
        cfg = self.cfg
        return [LayerKVSpec("sliding" if cfg.is_sliding(i) else "full", cfg.num_kv_heads,
                            cfg.head_dim, cfg.head_dim_v) for i in range(cfg.num_layers)]

    def windows(self) -> dict[str, int]:
        return {"sliding": self.cfg.sliding_window} if self.cfg.sliding_window else {}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """-> (len(batch.logits_rows), hidden) float32, after the output norm.

        A block's output joins the residual stream at the next norm (`_add_norm`), which on
        the Triton path is one kernel for the add, the optional post-norm and the norm."""
        return self._forward(batch, kv, False).y

    @torch.inference_mode()
    def step_logits(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """logits(forward(batch, kv)); the output norm's kernel also quantizes its output
        for a q8 head (no quantization launch of the head's own)."""
        out = self._forward(batch, kv, True)
        return self.logits(out.y, out.xq)

    def _forward(self, batch: ForwardBatch, kv: KVCache, head_xq: bool) -> NormOut:
        """forward's NormOut of the output norm; `head_xq`: quantized for the head where it
        takes that (q8)."""
        cfg = self.cfg
        x = self.embed(batch.input_ids)  # (T, hidden) f32 residual stream
        fused = use_triton(x.device)
        cos_sin = self.rope.cos_sin(batch.positions)
        cos_sin_swa = cos_sin if self.rope_swa is self.rope else self.rope_swa.cos_sin(
            batch.positions)
        last = len(self.blocks) - 1
        pending: _Residual | None = None  # the previous block's MLP output, not yet added
        for i, blk in enumerate(self.blocks):
            rope, cs = (self.rope_swa, cos_sin_swa) if cfg.is_sliding(i) else (self.rope, cos_sin)
            n = x.shape[0]
            x, h, hq = self._add_norm(x, pending, blk.attn_norm, fused,
                                      _in_dtype(blk.qkv, n, self._mm_dtype),
                                      _act8(blk.qkv, fused, n))
            o = self._attention(blk, h, hq, rope, cs, batch, kv, fused)
            if i == last and not batch.every_token():  # only the requested rows go
                x, o = x[batch.logits_rows], o[batch.logits_rows]  # through the last MLP
            n = x.shape[0]
            if blk.moe is not None:  # the router reads the norm in float32
                x, h, _ = self._add_norm(x, (o, blk.post_attn_norm), blk.ffn_norm, fused)
                pending = (blk.moe.deferred(h), blk.post_ffn_norm)
                continue
            x, h, hq = self._add_norm(x, (o, blk.post_attn_norm), blk.ffn_norm, fused,
                                      _in_dtype(blk.gate_up, n, self._mm_dtype),
                                      _act8(blk.gate_up, fused, n))
            gate_up = blk.gate_up(h) if hq is None else blk.gate_up(h, xq=hq)
            if _act8(blk.down, fused, n):  # the activation kernel quantizes for the q8 down
                act, aq = gated_act_quant(gate_up, self.cfg.activation, self._mm_dtype)
                down = blk.down(act, xq=aq)
            else:
                down = blk.down(self._mlp_act(gate_up, fused,
                                              _in_dtype(blk.down, n, self._mm_dtype)))
            pending = (down, blk.post_ffn_norm)
        n = x.shape[0]
        quantize = head_xq and _act8(self.head, fused, n)
        # forward's hidden states stay float32; step_logits' go to the head as it multiplies
        out_dtype = _in_dtype(self.head, n, torch.float32) if head_xq and not quantize \
            else torch.float32
        return self._add_norm(x, pending, self.output_norm, fused, out_dtype, quantize)

    def _mlp_act(self, gate_up: torch.Tensor, fused: bool,
                 out_dtype: torch.dtype) -> torch.Tensor:
        """(T, 2 ffn) gate and up rows -> act(gate) * up (T, ffn), written in `out_dtype` on
        the Triton path."""
        if fused:
            return gated_act(gate_up, self.cfg.activation, out_dtype)
        gate, up = gate_up.split(self.cfg.ffn_size, dim=-1)
        return self._act(gate, up)

    def _add_norm(self, x: torch.Tensor, residual: _Residual | None, weight: torch.Tensor,
                  fused: bool, out_dtype: torch.dtype = torch.float32, quantize: bool = False,
                  ) -> NormOut:
        """(x + post_norm(r), rms_norm(x + post_norm(r)) * weight, the norm quantized for
        kernels/qint.py or None) for residual (r, post-norm weight or None); x itself and
        its norm without a residual. The fused kernel writes the norm in `out_dtype` (and
        with `quantize` its 8-bit codes); the torch path leaves that rounding to the matmul."""
        r, r_weight = residual if residual is not None else (None, None)
        if fused:
            return add_rms_norm(x, weight, self.cfg.rms_eps, r, r_weight, out_dtype, quantize)
        if r is not None:
            x = x + (r if r_weight is None else rms_norm(r, r_weight, self.cfg.rms_eps))
        return NormOut(x, rms_norm(x, weight, self.cfg.rms_eps))

    def _attention(self, blk: Block, h: torch.Tensor, hq: QuantX | None, rope: Rope,
                   cs: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                   kv: KVCache, fused: bool) -> torch.Tensor:
        """-> the output projection, before the post-attention norm (see _add_norm); hq: h
        quantized by the norm kernel for a q8 projection."""
        cfg, n = self.cfg, h.shape[0]
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = blk.qkv(h) if hq is None else blk.qkv(h, xq=hq)  # f32
        q, k, v = qkv.split([q_dim, kv_dim, cfg.num_kv_heads * cfg.head_dim_v], dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim_v)
        if fused:  # q/k norm and RoPE of both, and the K/V store, in one kernel
            q, k = rope_qk(q, k, *cs, rope.neox, blk.q_norm, blk.k_norm, cfg.rms_eps,
                           kv_target(blk.attn, v, batch, kv))
            if _act8(blk.out, fused, n) and attn_quant_enabled(n):  # the attention quantizes
                o, oq = attend_q8(blk.attn, q, batch, kv)
                return blk.out(o) if oq is None else blk.out(o, xq=oq)
            return blk.out(attend(blk.attn, q, k, v, batch, kv, stored=True))
        if blk.q_norm is not None:
            q = rms_norm(q, blk.q_norm, cfg.rms_eps)
            k = rms_norm(k, blk.k_norm, cfg.rms_eps)
        q, k = rope.apply(q, *cs), rope.apply(k, *cs)
        return blk.out(attend(blk.attn, q, k, v, batch, kv))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, xq: QuantX | None = None) -> torch.Tensor:
        """hidden (n, hidden) -> (n, vocab) float32; `xq`: hidden quantized for a q8 head."""
        out = self.head(hidden) if xq is None else self.head(hidden, xq=xq)
        if self.cfg.final_softcap:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out
