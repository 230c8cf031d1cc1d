"""CPU attention: decode rows batched by key-length bucket, other rows one at a time.

A decode row (one query token) attends to its keys padded up to a multiple of
KEY_BUCKET; rows in the same bucket share one batched matmul. A row's result depends only
on its own keys and its own bucket, never on which rows share the step, so the batch
invariance of engine/layers/attention.py's reference holds (tested bit-exactly). Rows
with several query tokens (prefill chunks, verify rows) run the reference's per-row path.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache

if TYPE_CHECKING:
    from engine.layers.attention import AttnLayer

KEY_BUCKET = 64  # keys per decode row are padded to a multiple of this


_memo = threading.local()  # the last step's decode plans, per engine thread


class _Bucket(NamedTuple):
    """Decode rows whose keys pad to the same width, with their gather slots."""

    tokens: torch.Tensor  # (R,) token index of each row in the step
    slots: torch.Tensor  # (R * width,) KV slots, padded keys re-read the row's last key
    valid: torch.Tensor  # (R, 1, 1, width) bool
    width: int


def attend_cpu(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str
) -> torch.Tensor:
    """q (T, H, D) float32 -> (T, H * Dv) float32, for every row of `batch`."""
    from engine.layers.attention import attend_rows  # the per-row reference path

    starts = batch.query_start.tolist()
    decode = [r for r in range(batch.num_rows) if starts[r + 1] - starts[r] == 1]
    if not decode:
        return attend_rows(layer, q, batch, kv, group, range(batch.num_rows))
    out = torch.empty(q.shape[0], layer.num_heads * layer.head_dim_v, dtype=torch.float32)
    others = [r for r in range(batch.num_rows) if starts[r + 1] - starts[r] != 1]
    if others:
        part = attend_rows(layer, q, batch, kv, group, others)
        for r in others:
            out[starts[r]:starts[r + 1]] = part[starts[r]:starts[r + 1]]
    for bucket in _plan(batch, kv, group, layer.window, decode, starts):
        out[bucket.tokens] = _decode_bucket(layer, q[bucket.tokens], kv, bucket)
    return out


def _plan(batch: ForwardBatch, kv: KVCache, group: str, window: int | None,
          decode: list[int], starts: list[int]) -> list[_Bucket]:
    """The decode rows' buckets for one (group, window): made once per step, shared by
    every layer of the group."""
    if getattr(_memo, "batch", None) is not batch:
        _memo.batch, _memo.plans = batch, {}
    plans = _memo.plans
    key = (group, window)
    if key not in plans:
        seq_lens = batch.seq_lens.tolist()
        by_width: dict[int, list[tuple[int, int, int]]] = {}  # width -> [(row, lo, keys)]
        for r in decode:
            lo = 0 if window is None else max(0, seq_lens[r] - window)
            n = seq_lens[r] - lo
            by_width.setdefault(-(-n // KEY_BUCKET) * KEY_BUCKET, []).append((r, lo, n))
        plans[key] = [_bucket(batch, kv, group, rows, width, starts)
                      for width, rows in by_width.items()]
    return plans[key]


def _bucket(batch: ForwardBatch, kv: KVCache, group: str, rows: list[tuple[int, int, int]],
            width: int, starts: list[int]) -> _Bucket:
    row_ids = torch.tensor([r for r, _, _ in rows])
    first = torch.tensor([lo for _, lo, _ in rows])
    count = torch.tensor([n for _, _, n in rows])
    offset = torch.arange(width)
    k_pos = first[:, None] + torch.minimum(offset[None, :], count[:, None] - 1)
    pages = batch.page_tables[group][row_ids[:, None], k_pos // kv.page_size]
    slots = (pages * kv.page_size + k_pos % kv.page_size).reshape(-1)
    valid = (offset[None, :] < count[:, None])[:, None, None, :]
    return _Bucket(torch.tensor([starts[r] for r, _, _ in rows]), slots, valid, width)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None,
                       shape: tuple[int, ...]) -> torch.Tensor:
    """softmax over the last dim; with sinks (H,), viewed as `shape` beside the scores,
    each head's sink logit joins the denominator (llama.cpp's attention sinks)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _decode_bucket(layer: AttnLayer, q: torch.Tensor, kv: KVCache,
                   bucket: _Bucket) -> torch.Tensor:
    """q (R, H, D) of one bucket's decode rows -> (R, H * Dv)."""
    num_rows, groups, width = q.shape[0], layer.num_heads // layer.num_kv_heads, bucket.width
    keys, values = kv.read(layer.index, bucket.slots)
    keys = keys.view(num_rows, width, layer.num_kv_heads, layer.head_dim)
    values = values.view(num_rows, width, layer.num_kv_heads, layer.head_dim_v)
    qr = q.view(num_rows, layer.num_kv_heads, groups, layer.head_dim)
    # matmul, not einsum: einsum turns a lone row into a plain mm, which rounds differently
    keys_t = keys.permute(0, 2, 3, 1).contiguous()  # (R, KVH, D, width)
    scores = torch.matmul(qr, keys_t) * layer.scale  # (R, KVH, G, width)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~bucket.valid, float("-inf"))
    probs = softmax_with_sinks(scores, layer.sinks, (1, layer.num_kv_heads, groups, 1))
    rows_out = torch.matmul(probs, values.transpose(1, 2).contiguous())  # (R, KVH, G, Dv)
    return rows_out.reshape(num_rows, -1)
