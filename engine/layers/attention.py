"""Attention over the paged KV cache: one `attend` call covers every row of a ForwardBatch.

The new tokens' K/V are stored first and then read back with the context, so a row sees
exactly what later steps will see (quantized KV included), whatever the chunking.

Two backends behind one switch (engine/kernel_select.py): on a GPU the Triton paged
attention (kernels/paged_attention.py, every row in one launch per layer), elsewhere the
torch reference below. The Triton kernel runs a plan (work items) per layer group, which
the runner makes once per step (`plan_batch`, on the host, for any batch; `plan_decode`,
on the device, for decode-only batches) and passes in a PlannedBatch. `plan_decode` gives
every row the same number of key splits, the unused ones empty (their partials merge as
exact zeros), so a decode step has fixed grid sizes and no host synchronisation: it can
be captured in a CUDA graph (engine/graphs.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.kernel_select import use_triton
from engine.kv.cache import KVCache
from engine.kv.hadamard import rotate_exact
from engine.layers.attention_cpu import attend_cpu, softmax_with_sinks
from kernels.fused_rope import KVStore
from kernels.paged_attention import (
    ROTATED,
    AttnConfig,
    AttnPlan,
    paged_attention,
    paged_attention_q8,
    plan_attention,
)
from kernels.paged_attention_plan import WORK_FIELDS
from kernels.quant_x import QuantX
from kernels.triton_util import carveout_active


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
    # gpt-oss: a logit a head (H,) float32 that joins each softmax with no value behind it
    sinks: torch.Tensor | None = None


class GroupInputs(NamedTuple):
    """The Triton attention's inputs for one layer group and one step."""

    plan: AttnPlan
    page_table: torch.Tensor  # (rows, max_pages) int32
    positions: torch.Tensor  # (tokens,) int32
    config: AttnConfig  # what the plan was made for


@dataclass(slots=True)
class PlannedBatch(ForwardBatch):
    """A ForwardBatch on the device with each layer group's attention inputs."""

    attn: dict[str, GroupInputs] = field(default_factory=dict)


def attend(
    layer: AttnLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    kv: KVCache,
    stored: bool = False,
) -> torch.Tensor:
    """q (T, H, D), k (T, KVH, D), v (T, KVH, Dv) float32 -> (T, H * Dv) float32; `stored`:
    k and v are in the cache already (rope_qk's store, `kv_target`), and q comes from that
    call: rotated as a rotated K is stored (kernels/fused_rope.py's q_rotates)."""
    group = kv.group_of(layer.index)
    if not stored:
        kv.write(layer.index, batch.write_slots(group, kv.page_size), k, v)
    if use_triton(q.device):
        return attend_triton(layer, q, batch, kv, group, q_rotated=stored)
    if stored and kv.k_format.name in ROTATED:  # back to the basis the CPU paths read K in
        q = rotate_exact(q)
    if q.device.type == "cpu":
        return attend_cpu(layer, q, batch, kv, group)
    return attend_reference(layer, q, batch, kv, group)


def kv_target(layer: AttnLayer, v: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> KVStore:
    """Where the step's K and V of `layer` go (rope_qk stores them in its launch; attend
    then takes stored=True): v (T, KVH, Dv), the batch's write slots, the layer's planes."""
    k_planes, v_planes = kv.k[layer.index], kv.v[layer.index]
    assert k_planes is not None and v_planes is not None
    return KVStore(v, batch.write_slots(kv.group_of(layer.index), kv.page_size), k_planes,
                   v_planes, kv.k_format.name, kv.v_format.name)


def attn_quant_enabled(tokens: int = 1) -> bool:
    """Whether the attention of a step of `tokens` query rows writes its output quantized
    for a q8 output projection (attend_q8): one quantize_x launch a layer fewer, the o
    product launched right after the attention. MBUFO_ATTN_QUANT=1: always, 0: never;
    unset: at one row on NVIDIA where the carveout is on (MBUFO_CARVEOUT: on by default).
    Without the carveout the o product right after the attention ran 18% slower (H200:
    377 against 466 tok/s); with it one stream gained (474 against 466), 16 streams lost
    (3440 against 3567 with the attention quantizing at every row count; bench/RESULTS.md,
    2026-12-02). ROCm (no carveout, no programmatic dependent launch) keeps quantize_x:
    unmeasured there."""
    raw = os.environ.get("MBUFO_ATTN_QUANT", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"MBUFO_ATTN_QUANT must be 0 or 1, got {raw!r}")
    if raw:
        return raw == "1"
    return tokens == 1 and carveout_active()


def attend_q8(layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch,
              kv: KVCache) -> tuple[torch.Tensor, QuantX | None]:
    """attend(..., stored=True) on the Triton path, and its output quantized for a q8
    output projection by the attention's own launch where it can (paged_attention_q8;
    None: the projection quantizes for itself)."""
    return attend_triton(layer, q, batch, kv, kv.group_of(layer.index), quantize=True,
                         q_rotated=True)


def attend_triton(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str,
    quantize: bool = False, q_rotated: bool = False,
) -> Any:
    """One paged-attention launch for every row; without a PlannedBatch the plan is made
    here from the batch (a host synchronisation per layer). With `quantize`:
    (out, out quantized or None), paged_attention_q8's; `q_rotated`: paged_attention's."""
    inputs = batch.attn.get(group) if isinstance(batch, PlannedBatch) else None
    k_planes, v_planes = kv.k[layer.index], kv.v[layer.index]
    assert k_planes is not None and v_planes is not None
    return (paged_attention_q8 if quantize else paged_attention)(
        q, k_planes, v_planes, kv.k_format.name, kv.v_format.name,
        query_start=batch.query_start, seq_lens=batch.seq_lens,
        positions=batch.positions if inputs is None else inputs.positions,
        page_table=batch.page_tables[group] if inputs is None else inputs.page_table,
        page_size=kv.page_size, scale=layer.scale, window=layer.window,
        softcap=layer.softcap, sinks=layer.sinks, plan=None if inputs is None else inputs.plan,
        config=attn_config(layer, q.device) if inputs is None else inputs.config,
        q_rotated=q_rotated)


def attn_config(layer: AttnLayer, device: torch.device, decode: bool = False) -> AttnConfig:
    """The kernel config of `layer` (what paged_attention would choose itself), or with
    `decode` the one of decode-only steps (plan_decode)."""
    backend = "hip" if device.type == "cuda" and torch.version.hip else "cuda"
    make = AttnConfig.decode if decode else AttnConfig.default
    return make(layer.num_heads // layer.num_kv_heads, layer.head_dim, layer.head_dim_v,
                backend)


def group_layers(layers: Iterable[AttnLayer], kv: KVCache) -> dict[str, AttnLayer]:
    """One layer per KV group; one plan serves a group, so its layers must agree."""
    out: dict[str, AttnLayer] = {}
    for layer in layers:
        first = out.setdefault(kv.group_of(layer.index), layer)
        if _plan_key(first) != _plan_key(layer):
            raise ValueError(f"layers {first.index} and {layer.index} share a KV group but "
                             f"not the attention shape or window")
    return out


def _plan_key(layer: AttnLayer) -> tuple:
    return layer.window, layer.num_heads // layer.num_kv_heads, layer.head_dim, layer.head_dim_v


def plan_batch(host: ForwardBatch, batch: ForwardBatch, layers: dict[str, AttnLayer],
               page_size: int, fill: dict[str, int] | None = None,
               decode_keys: dict[str, np.ndarray] | None = None) -> PlannedBatch:
    """Any batch (prefill, mixed, verify): plans and write slots computed on the host from
    `host` (the CPU copy of `batch`), then copied to `batch`'s device. `fill[group]`: the
    work items the device runs at once (plan_attention: a long chunk's few are cut).
    `decode_keys[group]` (one per row): one-token rows cut as a decode step cuts them and
    run with the decode config (plan_attention), as in a decode-only step."""
    dev = batch.input_ids.device
    positions = batch.positions.to(torch.int32)
    attn, slots = {}, {}
    for group, layer in layers.items():
        config = attn_config(layer, dev)
        plan = plan_attention(host.query_start, host.seq_lens,
                              group=layer.num_heads // layer.num_kv_heads, window=layer.window,
                              config=config, device=dev, fill=(fill or {}).get(group, 0),
                              decode_keys=None if decode_keys is None else decode_keys[group])
        attn[group] = GroupInputs(plan, batch.page_tables[group].to(torch.int32), positions,
                                  config)
        slots[group] = host.write_slots(group, page_size).to(dev)
    return _planned(batch, attn, slots)


def decode_splits(layer: AttnLayer, max_context: int, device: torch.device,
                  split_keys: int | None = None) -> int:
    """Key splits a decode row of at most `max_context` tokens can need (plan_decode), cut
    at `split_keys` (default: the decode config's)."""
    split_keys = split_keys or attn_config(layer, device, decode=True).split_keys
    splits = -(-max_context // split_keys)
    if layer.window is not None:  # keys (pos - window, pos] touch at most this many
        splits = min(splits, -(-layer.window // split_keys) + 1)
    return max(1, splits)


def plan_decode(batch: ForwardBatch, layers: dict[str, AttnLayer], page_size: int,
                splits: dict[str, int],
                keys: dict[str, int | np.ndarray] | None = None) -> PlannedBatch:
    """A decode-only batch (one new token per row, at position seq_len - 1) on the device:
    write slots and plans by device ops only, `splits[group]` work items per row of
    `keys[group]` key positions (one for every row, or one a row: the runner's
    decode_split_keys of each row's own length; default the decode config's split_keys)."""
    rows = batch.positions.shape[0]
    dev = batch.positions.device
    positions = batch.positions.to(torch.int32)
    row_ids = torch.arange(rows, dtype=torch.int32, device=dev)
    attn, slots = {}, {}
    for group, layer in layers.items():
        table = batch.page_tables[group]  # (rows, max_pages) int64
        page = table.gather(1, (batch.positions // page_size)[:, None]).squeeze(1)
        slots[group] = page * page_size + batch.positions % page_size
        config = attn_config(layer, dev, decode=True)
        split_keys = keys[group] if keys else config.split_keys
        if isinstance(split_keys, np.ndarray):
            split_keys = torch.from_numpy(split_keys).to(device=dev, dtype=torch.int32)
        plan = _decode_plan(batch.seq_lens, layer.window, split_keys, splits[group], row_ids)
        attn[group] = GroupInputs(plan, table.to(torch.int32), positions, config)
    return _planned(batch, attn, slots)


def _decode_plan(seq_lens: torch.Tensor, window: int | None, split_keys: int | torch.Tensor,
                 num_splits: int, row_ids: torch.Tensor) -> AttnPlan:
    """kernels/paged_attention_plan.py's items for one-token rows, padded to `num_splits`
    per row: row r's split s covers keys [max(lo, (f + s) * K), min(len, (f + s + 1) * K))
    with lo its first visible key, K its split_keys (one for all rows, or (R,)) and f = lo
    // K; past the last key a range is empty."""
    lens = seq_lens.to(torch.int32)  # (R,)
    lo = (lens - window).clamp_(min=0) if window is not None else torch.zeros_like(lens)
    sk = split_keys[:, None] if isinstance(split_keys, torch.Tensor) else split_keys
    split = torch.arange(num_splits, dtype=torch.int32, device=lens.device)  # (S,)
    first = lo[:, None] // sk + split[None, :]  # (R, S) aligned split index
    key_hi = torch.minimum(lens[:, None], (first + 1) * sk)
    key_lo = torch.minimum(torch.maximum(lo[:, None], first * sk), key_hi)
    rows = row_ids[:, None].expand_as(key_lo)
    work = torch.stack([rows, rows, torch.ones_like(rows), key_lo, key_hi,
                        split[None, :].expand_as(key_lo)], dim=-1)  # (R, S, WORK_FIELDS)
    num_rows = lens.shape[0]
    return AttnPlan(work.reshape(num_rows * num_splits, WORK_FIELDS).contiguous(),
                    row_ids * num_splits, torch.full_like(lens, num_splits),
                    num_rows * num_splits, num_rows)


def decode_items_host(seq_lens: np.ndarray, window: int | None,
                      split_keys: int | np.ndarray, num_splits: int) -> np.ndarray:
    """_decode_plan's work items on the host (numpy; the same integers): (rows * num_splits,
    WORK_FIELDS) int32 for one-token rows of `seq_lens` tokens, cut at `split_keys` (one
    for all rows, or one a row). The decode graphs stage them with the step's inputs
    (engine/graphs.py), so a replay makes no plan."""
    lens = seq_lens.astype(np.int64)
    lo = np.maximum(lens - window, 0) if window is not None else np.zeros_like(lens)
    sk = np.broadcast_to(np.asarray(split_keys, dtype=np.int64), lens.shape)[:, None]
    split = np.arange(num_splits, dtype=np.int64)
    first = lo[:, None] // sk + split[None, :]
    key_hi = np.minimum(lens[:, None], (first + 1) * sk)
    key_lo = np.minimum(np.maximum(lo[:, None], first * sk), key_hi)
    rows = np.broadcast_to(np.arange(len(lens), dtype=np.int64)[:, None], key_lo.shape)
    work = np.stack([rows, rows, np.ones_like(rows), key_lo, key_hi,
                     np.broadcast_to(split[None, :], key_lo.shape)], axis=-1)
    return work.reshape(-1, WORK_FIELDS).astype(np.int32)


def _planned(batch: ForwardBatch, attn: dict[str, GroupInputs],
             slots: dict[str, torch.Tensor]) -> PlannedBatch:
    return PlannedBatch(batch.input_ids, batch.positions, batch.query_start, batch.seq_lens,
                        batch.page_tables, batch.logits_rows, _write_slots=slots, attn=attn,
                        _every_token=batch.every_token())


def attend_reference(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str
) -> torch.Tensor:
    """The reference: every row on its own (q (T, H, D) -> (T, H * Dv) float32)."""
    return attend_rows(layer, q, batch, kv, group, range(batch.num_rows))


def attend_rows(
    layer: AttnLayer, q: torch.Tensor, batch: ForwardBatch, kv: KVCache, group: str,
    rows: Iterable[int],
) -> torch.Tensor:
    """(T, H * Dv) float32 with the tokens of `rows` filled (the others left unset)."""
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, layer.num_heads * layer.head_dim_v, dtype=torch.float32,
                      device=q.device)
    groups = layer.num_heads // layer.num_kv_heads
    starts = batch.query_start.tolist()
    seq_lens = batch.seq_lens.tolist()
    first_pos = batch.positions[batch.query_start[:-1]].tolist()
    for row in rows:
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
        probs = softmax_with_sinks(scores, layer.sinks, (layer.num_kv_heads, groups, 1, 1))
        rows = torch.einsum("hgqk,khd->qhgd", probs, values)  # (ql, KVH, G, Dv)
        out[qs:qe] = rows.reshape(qe - qs, -1)
    return out
