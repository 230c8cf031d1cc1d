"""CPU attention: decode rows batched by key-length bucket, other rows one at a time.

A decode row (one query token) attends to its keys padded up to a multiple of
KEY_BUCKET; rows in the same bucket share one batched matmul. A row's result depends only
on its own keys and its own bucket, never on which rows share the step, so the batch
invariance of engine/layers/attention.py's reference holds (tested bit-exactly). Rows
with several query tokens (prefill chunks, verify rows) run the reference's per-row path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache

if TYPE_CHECKING:
    from engine.layers.attention import AttnLayer

KEY_BUCKET = 64  # keys per decode row are padded to a multiple of this


def attend_cpu(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str
) -> torch.Tensor:
    """q (T, H, D) float32 -> (T, H * Dv) float32, for every row of `batch`."""
    from engine.layers.attention import attend_rows  # the per-row reference path

    starts = batch.query_start.tolist()
    seq_lens = batch.seq_lens.tolist()
    decode = [r for r in range(batch.num_rows) if starts[r + 1] - starts[r] == 1]
    if not decode:
        return attend_rows(layer, q, batch, kv, group, range(batch.num_rows))
    out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim_v, dtype=torch.float32)
    others = [r for r in range(batch.num_rows) if starts[r + 1] - starts[r] != 1]
    if others:
        part = attend_rows(layer, q, batch, kv, group, others)
        for r in others:
            out[starts[r]:starts[r + 1]] = part[starts[r]:starts[r + 1]]
    buckets: dict[int, list[tuple[int, int, int]]] = {}  # bucket -> [(row, first key, keys)]
    for r in decode:
        lo = 0 if layer.window is None else max(0, seq_lens[r] - layer.window)
        n = seq_lens[r] - lo
        buckets.setdefault(-(-n // KEY_BUCKET) * KEY_BUCKET, []).append((r, lo, n))
    for width, rows in buckets.items():
        token = torch.tensor([starts[r] for r, _, _ in rows])
        out[token] = _decode_bucket(layer, q[token], batch, kv, group, rows, width)
    return out


def _decode_bucket(layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                   group: str, rows: list[tuple[int, int, int]], width: int) -> torch.Tensor:
    """q (R, H, D) of R decode rows whose keys fit `width` -> (R, H * Dv)."""
    num_rows, groups = len(rows), layer.num_heads // layer.num_kv_heads
    row_ids = torch.tensor([r for r, _, _ in rows])
    first = torch.tensor([lo for _, lo, _ in rows])
    count = torch.tensor([n for _, _, n in rows])
    offset = torch.arange(width)
    valid = offset[None, :] < count[:, None]  # (R, width)
    # padded keys re-read the row's last key (always a real slot); the mask drops them
    k_pos = first[:, None] + torch.minimum(offset[None, :], count[:, None] - 1)
    pages = batch.page_tables[group][row_ids[:, None], k_pos // kv.page_size]
    slots = pages * kv.page_size + k_pos % kv.page_size
    keys, values = kv.read(layer.index, slots.reshape(-1))
    keys = keys.view(num_rows, width, layer.num_kv_heads, layer.head_dim)
    values = values.view(num_rows, width, layer.num_kv_heads, layer.head_dim_v)
    qr = q.view(num_rows, layer.num_kv_heads, groups, layer.head_dim)
    # matmul, not einsum: einsum turns a lone row into a plain mm, which rounds differently
    keys_t = keys.permute(0, 2, 3, 1).contiguous()  # (R, KVH, D, width)
    scores = torch.matmul(qr, keys_t) * layer.scale  # (R, KVH, G, width)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    rows_out = torch.matmul(probs, values.transpose(1, 2).contiguous())  # (R, KVH, G, Dv)
    return rows_out.reshape(num_rows, -1)
