"""The shared decoder: embedding, N blocks of (norm, attention, norm, gated MLP), head.

Families (llama, qwen2/qwen3, gemma3) differ only in ModelConfig flags and config reading;
the forward below serves every ForwardBatch row in one pass over the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache, LayerKVSpec
from engine.layers.activation import ACTIVATIONS
from engine.layers.attention import AttnLayer, attend
from engine.layers.linear import Int8Linear, Linear
from engine.layers.norm import rms_norm
from engine.layers.rope import Rope
from engine.models.config import ModelConfig
from engine.models.weights import WeightLoader


@dataclass(slots=True)
class Block:
    attn: AttnLayer
    attn_norm: torch.Tensor
    qkv: Linear | Int8Linear  # fused q, k, v rows
    out: Linear | Int8Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | Int8Linear  # fused gate, up rows
    down: Linear | Int8Linear
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
        self.rope = Rope(cfg.head_dim, cfg.rope_base, cfg.rope_neox, cfg.rope_freq_scale, factors)
        self.rope_swa = self.rope
        if cfg.rope_base_swa is not None and cfg.swa_layers:
            self.rope_swa = Rope(cfg.head_dim, cfg.rope_base_swa, cfg.rope_neox)
        self.blocks = [self._load_block(weights, i) for i in range(cfg.num_layers)]
        self.device = weights.device
        self._act = ACTIVATIONS[cfg.activation]

    def _load_block(self, w: WeightLoader, i: int) -> Block:
        cfg, p = self.cfg, f"blk.{i}."
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        v_dim = cfg.num_kv_heads * cfg.head_dim_v
        qkv = w.fused([p + "attn_q", p + "attn_k", p + "attn_v"],
                      [q_dim, kv_dim, v_dim], cfg.hidden_size)
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        block = Block(
            attn=AttnLayer(i, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim_v,
                           scale, window),
            attn_norm=w.vector(p + "attn_norm.weight", cfg.hidden_size),
            qkv=qkv,
            out=w.linear(p + "attn_output", (cfg.hidden_size, cfg.num_heads * cfg.head_dim_v)),
            ffn_norm=w.vector(p + "ffn_norm.weight", cfg.hidden_size),
            gate_up=w.fused([p + "ffn_gate", p + "ffn_up"], [cfg.ffn_size] * 2, cfg.hidden_size),
            down=w.linear(p + "ffn_down", (cfg.hidden_size, cfg.ffn_size)),
        )
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
        """-> (len(batch.logits_rows), hidden) float32, after the output norm."""
        cfg = self.cfg
        x = self.embed(batch.input_ids)  # (T, hidden) f32 residual stream
        cos_sin = self.rope.cos_sin(batch.positions)
        cos_sin_swa = cos_sin if self.rope_swa is self.rope else self.rope_swa.cos_sin(
            batch.positions)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            rope, cs = (self.rope_swa, cos_sin_swa) if cfg.is_sliding(i) else (self.rope, cos_sin)
            h = self._attention(blk, rms_norm(x, blk.attn_norm, cfg.rms_eps), rope, cs, batch, kv)
            if i == last:  # only the requested rows go through the last MLP
                x, h = x[batch.logits_rows], h[batch.logits_rows]
            x = x + h
            h = rms_norm(x, blk.ffn_norm, cfg.rms_eps)
            gate, up = blk.gate_up(h).split(cfg.ffn_size, dim=-1)
            h = blk.down(self._act(gate, up))
            if blk.post_ffn_norm is not None:
                h = rms_norm(h, blk.post_ffn_norm, cfg.rms_eps)
            x = x + h
        return rms_norm(x, self.output_norm, cfg.rms_eps)

    def _attention(self, blk: Block, h: torch.Tensor, rope: Rope,
                   cs: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                   kv: KVCache) -> torch.Tensor:
        cfg, n = self.cfg, h.shape[0]
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = blk.qkv(h).split([q_dim, kv_dim, cfg.num_kv_heads * cfg.head_dim_v], dim=-1)
        q = q.reshape(n, cfg.num_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim_v)
        if blk.q_norm is not None:
            q = rms_norm(q, blk.q_norm, cfg.rms_eps)
            k = rms_norm(k, blk.k_norm, cfg.rms_eps)
        q, k = rope.apply(q, *cs), rope.apply(k, *cs)
        o = blk.out(attend(blk.attn, q, k, v, batch, kv))
        if blk.post_attn_norm is not None:
            o = rms_norm(o, blk.post_attn_norm, cfg.rms_eps)
        return o

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden) -> (n, vocab) float32."""
        out = self.head(hidden)
        if self.cfg.final_softcap:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out
