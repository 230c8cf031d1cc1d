"""Work items of kernels/paged_attention.py, computed once per batch on the host.

One plan serves every attention layer of a step with the same window (the engine builds
one per layer group). A work item is a block of query tokens of one row times a range of
key positions; a token's partial results go to its slots `tok_base[t] + split`. A row of
one query block (decode, verify, a short chunk) has its keys cut into position-aligned
splits; a longer row has an item a query block, cut into splits only when its few items
would leave most of the device idle (a short chunk deep into a long prompt).

Assumes the ForwardBatch contract: row r's tokens sit at positions
seq_lens[r] - num_new .. seq_lens[r] - 1 (the kernel masks with the real positions; the
plan only needs them to bound each item's key range).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.errors import InvalidRequest
from kernels.triton_util import next_pow2

__all__ = ["FORMAT_IDS", "PROGRAMS_PER_SM", "AttnConfig", "AttnPlan", "decode_split_keys",
           "plan_attention", "prefill_split_keys", "row_split_keys"]

# KV format name -> the kernel's constexpr: 0 f16, 1 q8, 2 q4 (rotation is done outside).
FORMAT_IDS = {"f16": 0, "q8": 1, "q8_plain": 1, "q4": 2, "q4_plain": 2}
WORK_FIELDS = 6  # row, q_begin, q_count, key_lo, key_hi, split
# Key positions per split of a decode row: a decode step has one query block per KV head
# and row, so its keys are cut to keep the device busy (one stream: 8 programs a layer for
# Llama 3 8B without splits); more splits cost one merge term each.
SPLIT_KEYS = 256
# The fewest key positions a decode split is cut to (decode_split_keys)
MIN_SPLIT_KEYS = 128
# The most splits a decode row's keys are cut into: a longer row takes longer splits
# (decode_split_keys). H200, Llama 3 8B, one row (bench/RESULTS.md, 2026-12-04), us a layer
# in 256 / 512 / 1024 / 2048-key splits: 16384 keys 35.9 / 30.0 / 32.0 / 47.2, 32768 keys
# 80.9 / 56.4 / 45.3 / 52.9 (f16; q8 alike): each best at 32 splits a row.
MAX_DECODE_SPLITS = 32
# Programs a multiprocessor runs at once that the plans aim at: a decode row's best split
# left about two (256 programs of Llama 3 8B at 16K and 32K keys on 132 multiprocessors)
PROGRAMS_PER_SM = 2
# The fewest key positions a prefill item is cut to (prefill_split_keys): 16 key blocks of
# a prefill config's 64 a merge term. Not yet measured against other lengths.
MIN_PREFILL_SPLIT = 1024
# A cut prefill item's key count is a multiple of this (whole key blocks but the last)
KEY_ALIGN = 64


class AttnConfig(NamedTuple):
    block_m: int  # query rows per program: tokens * heads of one KV head (GQA packed)
    block_n: int  # keys per inner step
    split_keys: int  # key positions per split of a single-block row
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default

    @classmethod
    def default(cls, group: int, dim: int, dim_v: int, backend: str = "cuda") -> AttnConfig:
        """Depends only on the layer's shape and the backend, never on the batch.

        gfx1151: the largest tiles whose AOT build spills no VGPR for every format pair.
        """
        if backend == "hip":
            return cls(max(32, next_pow2(group)), 16, SPLIT_KEYS, 4, 1)
        wide = max(dim, dim_v) > 128  # keep the (block_m, Dv) accumulator in registers
        return cls(max(32 if wide else 64, next_pow2(group)), 32 if wide else 64, SPLIT_KEYS)

    @classmethod
    def decode(cls, group: int, dim: int, dim_v: int, backend: str = "cuda") -> AttnConfig:
        """The config of decode-only steps (one query token a row, engine/layers/attention.py's
        plan_decode): a row's item fills only `group` rows of the MMA's M side, so M is cut
        to its 16-row minimum and the keys go in 128-key blocks (a decode item is a chain
        of dependent loads, its time set by latency, not by its FLOPs; H200, Llama 3 8B,
        bench/RESULTS.md: 4.1 against 5.4 us at 96 keys, 85 against 106 us for 16 rows of
        4096). gfx1151 keeps `default` (not measured there)."""
        base = cls.default(group, dim, dim_v, backend)
        if backend == "hip" or max(dim, dim_v) > 128:
            return base
        return base._replace(block_m=max(16, next_pow2(group)), block_n=128)

    def tokens_per_block(self, group: int) -> int:
        return self.block_m // group


class AttnPlan(NamedTuple):
    work: torch.Tensor  # (W, WORK_FIELDS) int32
    tok_base: torch.Tensor  # (T,) int32 first partial slot of each token
    tok_splits: torch.Tensor  # (T,) int32 number of splits of each token
    num_slots: int
    num_tokens: int
    # one-token rows' items in a step with other rows, run with the decode config
    # (AttnConfig.decode) as in a decode-only step: plan_attention's `decode_keys`
    decode_work: torch.Tensor | None = None


def decode_split_keys(keys: int | np.ndarray, kv_heads: int, num_sms: int,
                      most: int = SPLIT_KEYS) -> int | np.ndarray:
    """Key positions per split of a one-token row that sees `keys` keys (an int, or an
    array: one length a row). The row's own length decides, never the other rows of its
    step, so a row's splits, and with them its bits, are the same alone or among others
    (DESIGN's batch invariance). `most`, halved down to MIN_SPLIT_KEYS while the row's
    work items (KV heads x the splits of `keys`) are fewer than a quarter of the device's
    `num_sms` multiprocessors (0: never halved), unless `most` holds the keys in one split
    (no merge: cut in two, 96 keys took 6.1 against 3.8 us); then row_split_keys' (at most
    MAX_DECODE_SPLITS splits). H200, Llama 3 8B, one row (bench/RESULTS.md): 577 keys 6.9
    us in 128-key splits against 8.4 in 256 and 8.0 in 64; 1024 keys 7.4 / 8.8 / 9.2; 4096
    keys 16.2 in 128 against 14.7 in 256."""
    k = np.asarray(keys, dtype=np.int64)
    split = np.full_like(k, most)
    while True:
        finer = (k > most) & (split > MIN_SPLIT_KEYS) & (4 * kv_heads * -(-k // split) < num_sms)
        if not finer.any():
            break
        split = np.where(finer, split // 2, split)
    while True:  # row_split_keys
        longer = -(-k // split) > MAX_DECODE_SPLITS
        if not longer.any():
            break
        split = np.where(longer, split * 2, split)
    return int(split) if split.ndim == 0 else split


def row_split_keys(keys: int, split_keys: int) -> int:
    """Key positions per split of a one-block row that sees `keys` keys: `split_keys`,
    doubled while the keys would take more than MAX_DECODE_SPLITS splits (every merge term
    costs: 32768 keys 80.9 us a layer in 256-key splits, 45.3 in 1024)."""
    split = split_keys
    while -(-keys // split) > MAX_DECODE_SPLITS:
        split *= 2
    return split


def prefill_split_keys(item_keys: list[int], fill: int, least: int | None = None) -> int:
    """Key positions a prefill chunk's query blocks are cut to (plan_attention's `fill`),
    or 0 for none: a chunk whose `item_keys` (its query blocks' key ranges) are few and
    long runs on a few programs, each reading its whole context (a 16-token chunk of Llama
    3 8B at 200K keys: 8 programs on 132 multiprocessors, the other streams waiting on
    them). An item longer than twice the mean load of `fill` items (at least `least`,
    default MIN_PREFILL_SPLIT keys) is cut into pieces of about that load (_cut: whole key
    blocks); a chunk whose items already spread evenly (512 tokens: 32 items a KV head of
    near equal keys) is left whole."""
    if fill <= 0 or not item_keys:
        return 0
    least = MIN_PREFILL_SPLIT if least is None else least
    load = max(least, -(-sum(item_keys) // fill))
    return load if max(item_keys) > 2 * load else 0


def _row_items(row: int, q0: int, num_new: int, seq_len: int, block_q: int,
               window: int | None, split_keys: int,
               decode_keys: int = 0) -> list[list[tuple[int, ...]]]:
    """The row's work items, by the tokens they write: one group for a one-block row (its
    key splits: `decode_keys` a split for a one-token row where given, else split_keys
    lengthened by row_split_keys), one a query block otherwise (one item each, all its
    keys)."""
    first_pos = seq_len - num_new

    def key_lo(pos: int) -> int:  # oldest key the query at `pos` sees
        return 0 if window is None else max(0, pos - window + 1)

    if num_new <= block_q:  # one query block: split the keys at aligned boundaries
        lo, hi = key_lo(first_pos), seq_len
        if num_new == 1 and decode_keys:
            split_keys = decode_keys
        else:
            split_keys = row_split_keys(hi - lo, split_keys)
        first, last = lo // split_keys, (hi - 1) // split_keys
        return [[(row, q0, num_new, max(lo, s * split_keys), min(hi, (s + 1) * split_keys),
                  s - first) for s in range(first, last + 1)]]
    return [[(row, q0 + b, min(block_q, num_new - b), key_lo(first_pos + b),
              first_pos + b + min(block_q, num_new - b), 0)]
            for b in range(0, num_new, block_q)]


def _cut(item: tuple[int, ...], length: int) -> list[tuple[int, ...]]:
    """A query block's item cut into splits of about `length` keys (even, KEY_ALIGN-aligned
    sizes): a query may see none of the last one's keys (causal), its partials then merge
    as exact zeros."""
    row, q0, count, lo, hi, _ = item
    pieces = -(-(hi - lo) // length)
    if pieces <= 1:
        return [item]
    step = -(-(hi - lo) // (pieces * KEY_ALIGN)) * KEY_ALIGN
    return [(row, q0, count, a, min(hi, a + step), s)
            for s, a in enumerate(range(lo, hi, step))]


def plan_attention(
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    group: int,
    window: int | None,
    config: AttnConfig,
    device: torch.device | str,
    decode_splits: int = 0,
    fill: int = 0,
    least: int | None = None,
    decode_keys: Sequence[int] | None = None,
) -> AttnPlan:
    """Work items for rows (query_start (R + 1,), seq_lens (R,)); reads both on the host.
    A one-block row's keys are cut at config.split_keys (row_split_keys: at most
    MAX_DECODE_SPLITS splits). `decode_splits` > 0: every one-token row gets exactly that
    many items (its splits, then empty key ranges, which merge as exact zeros), as a
    captured graph's fixed plan sizes need; it must cover the row's splits. `fill` > 0:
    the items the device runs at once (its programs at once over the KV heads); a longer
    row whose few long query blocks would not fill it has them cut into key splits
    (prefill_split_keys, at least `least` keys). `decode_keys` (one per row): one-token
    rows are cut at their entry (a decode step's split of their own length) and their
    items go to `decode_work`, for the decode config, so that such a row's items, kernel
    and bits are a decode-only step's. The cut is the row's own: whatever else is in the
    step, a row gets the same items (and its tokens the same bits)."""
    starts = [int(s) for s in query_start.tolist()]
    lens = [int(s) for s in seq_lens.tolist()]
    if len(starts) != len(lens) + 1 or starts[0] != 0:
        raise InvalidRequest("paged_attention: query_start must be (rows + 1,) from 0")
    if decode_keys is not None and len(decode_keys) != len(lens):
        raise InvalidRequest(f"paged_attention: {len(decode_keys)} decode_keys for "
                             f"{len(lens)} rows")
    block_q = config.tokens_per_block(group)
    if block_q < 1:
        raise InvalidRequest(f"paged_attention: block_m {config.block_m} < group {group}")
    groups: list[list[tuple[int, ...]]] = []  # the items of the same tokens
    decode_rows: list[bool] = []  # by group: a one-token row's (decode_work)
    for row, seq_len in enumerate(lens):
        num_new = starts[row + 1] - starts[row]
        if num_new < 0 or num_new > seq_len:
            raise InvalidRequest(f"paged_attention: row {row} has {num_new} new tokens "
                                 f"and seq_len {seq_len}")
        if num_new == 0:
            continue
        dkeys = int(decode_keys[row]) if decode_keys is not None else 0
        row_groups = _row_items(row, starts[row], num_new, seq_len, block_q, window,
                                config.split_keys, dkeys)
        if decode_splits and num_new == 1:
            items = row_groups[0]
            if len(items) > decode_splits:
                raise InvalidRequest(f"paged_attention: row {row} needs {len(items)} key "
                                     f"splits, more than decode_splits {decode_splits}")
            items += [(row, starts[row], 1, seq_len, seq_len, s)
                      for s in range(len(items), decode_splits)]
        elif num_new > block_q and (length := prefill_split_keys(
                [items[0][4] - items[0][3] for items in row_groups], fill, least)):
            row_groups = [_cut(items[0], length) for items in row_groups]
        groups += row_groups
        decode_rows += [num_new == 1 and dkeys > 0] * len(row_groups)
    splits = [len(items) for items in groups for _ in range(items[0][2])]
    tok_splits = torch.tensor(splits, dtype=torch.int32)
    tok_base = torch.cumsum(tok_splits, 0, dtype=torch.int32) - tok_splits

    def items_of(decode: bool) -> torch.Tensor:
        work = [w for items, d in zip(groups, decode_rows, strict=True) if d == decode
                for w in items]
        return torch.tensor(work, dtype=torch.int32).reshape(-1, WORK_FIELDS).to(device)

    return AttnPlan(items_of(False), tok_base.to(device), tok_splits.to(device),
                    int(tok_splits.sum()), starts[-1],
                    items_of(True) if decode_keys is not None else None)
