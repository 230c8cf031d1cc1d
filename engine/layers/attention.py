"""Attention over the paged KV cache: one `attend` call covers every row of a ForwardBatch.

The new tokens' K/V are stored first and then read back with the context, so a row sees
exactly what later steps will see (quantized KV included), whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache


@dataclass(frozen=True, slots=True)
class AttnLayer:
    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    window: int | None  # sliding window in tokens (a query sees keys with q - k < window)
    softcap: float | None = None


def attend(
    layer: AttnLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    kv: KVCache,
) -> torch.Tensor:
    """q (T, H, D), k (T, KVH, D), v (T, KVH, Dv) float32 -> (T, H * Dv) float32."""
    group = kv.group_of(layer.index)
    kv.write(layer.index, batch.write_slots(group, kv.page_size), k, v)
    return attend_reference(layer, q, batch, kv, group)


def attend_reference(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str
) -> torch.Tensor:
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, layer.num_heads * layer.head_dim_v, dtype=torch.float32,
                      device=q.device)
    groups = layer.num_heads // layer.num_kv_heads
    starts = batch.query_start.tolist()
    seq_lens = batch.seq_lens.tolist()
    first_pos = batch.positions[batch.query_start[:-1]].tolist()
    for row in range(batch.num_rows):
        qs, qe = starts[row], starts[row + 1]
        q_pos = batch.positions[qs:qe]  # (ql,)
        lo = 0
        if layer.window is not None:
            lo = max(0, first_pos[row] - layer.window + 1)
        k_pos = torch.arange(lo, seq_lens[row], device=q.device)  # (L,)
        keys, values = kv.read(layer.index, batch.row_slots(group, row, k_pos, kv.page_size))
        qr = q[qs:qe].view(qe - qs, layer.num_kv_heads, groups, layer.head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qr, keys) * layer.scale  # (KVH, G, ql, L)
        if layer.softcap is not None:
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
        visible = k_pos[None, :] <= q_pos[:, None]
        if layer.window is not None:
            visible &= (q_pos[:, None] - k_pos[None, :]) < layer.window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        rows = torch.einsum("hgqk,khd->qhgd", probs, values)  # (ql, KVH, G, Dv)
        out[qs:qe] = rows.reshape(qe - qs, -1)
    return out
