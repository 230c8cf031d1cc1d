"""The Triton attention path of `attend` (interpreted) against the torch reference, with the
runner's plans: `plan_decode` (device-side, a fixed number of key splits per row, as
graph capture needs) and `plan_batch` (host-side, any batch). The padded decode plan is
also checked item by item against kernels/paged_attention_plan.py's planner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache, LayerKVSpec
from engine.layers.attention import (
    AttnLayer,
    GroupInputs,
    _decode_plan,
    _planned,
    attend,
    decode_splits,
    plan_batch,
    plan_decode,
)
from kernels.paged_attention_plan import (
    MAX_DECODE_SPLITS,
    MIN_PREFILL_SPLIT,
    MIN_SPLIT_KEYS,
    SPLIT_KEYS,
    AttnConfig,
    decode_split_keys,
    plan_attention,
    prefill_split_keys,
    row_split_keys,
)

PAGE = 16
HEADS, KV_HEADS, DIM = 4, 2, 32


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def make_case(gen, spans: list[tuple[int, int]], kv_quant: str, window: int | None):
    """spans: per row (new tokens, seq_len after the step). Context keys are random and
    already stored; the rows' pages are distinct random pages. -> (layer, kv, batch, q, k, v)"""
    group = "full" if window is None else "sliding"
    kv = KVCache([LayerKVSpec(group, KV_HEADS, DIM, DIM)], {group: 160}, PAGE, kv_quant)
    pages = torch.randperm(160, generator=gen).tolist()
    tables, batch_spans = [], []
    for new, seq_len in spans:
        n = -(-seq_len // PAGE)
        tables.append([pages.pop() for _ in range(n)])
        old = seq_len - new
        if old:
            pos = torch.arange(old)
            slots = torch.tensor(tables[-1])[pos // PAGE] * PAGE + pos % PAGE
            kv.write(0, slots, torch.randn(old, KV_HEADS, DIM, generator=gen),
                     torch.randn(old, KV_HEADS, DIM, generator=gen))
        ids = torch.randint(0, 100, (new,), generator=gen).tolist()
        batch_spans.append((ids, old))
    batch = ForwardBatch.build(batch_spans, {group: tables})
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    layer = AttnLayer(0, HEADS, KV_HEADS, DIM, DIM, DIM ** -0.5, window)
    return layer, kv, batch, q, k, v


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "output not fully written"
    rel = (out - ref).norm() / ref.norm()
    assert rel < 5e-3, float(rel)  # f16 dot operands in the kernel, f32 in the reference


@pytest.mark.parametrize("kv_quant,window", [("f16", None), ("k8v4", None), ("q8", 20)])
def test_decode_plan_attention_matches_reference(triton_worker, gen, kv_quant, window):
    # a padding-like row (1 token of context), short rows, and one over several key splits
    spans = [(1, 1), (1, 23), (1, 77), (1, 5)] + ([(1, 1100)] if window is None else [])
    layer, kv, batch, q, k, v = make_case(gen, spans, kv_quant, window)
    group = kv.group_of(0)
    splits = decode_splits(layer, max(n for _, n in spans), torch.device("cpu")) + 1
    assert splits > 2 or window is not None
    planned = plan_decode(batch, {group: layer}, PAGE, {group: splits})  # one left empty
    assert torch.equal(planned.write_slots(group, PAGE), batch.write_slots(group, PAGE))
    out = triton_worker.call("engine.layers.attention:attend", layer, q, k, v, planned, kv)
    assert_close(out, attend(layer, q, k, v, batch, kv))  # the CPU default: the reference


def test_one_split_writes_the_output_without_the_merge(triton_worker, gen):
    """Rows within one key split: the partial kernel writes the output itself (no merge
    launch); the same values as the merge of the same work padded with an empty split."""
    spans = [(1, 1), (1, 40), (1, 100)]
    layer, kv, batch, q, k, v = make_case(gen, spans, "f16", None)
    group = kv.group_of(0)
    outs = []
    for splits in (1, 2):
        planned = plan_decode(batch, {group: layer}, PAGE, {group: splits})
        assert (planned.attn[group].plan.num_slots == 3) == (splits == 1)
        outs.append(triton_worker.call("engine.layers.attention:attend", layer, q, k, v,
                                       planned, kv))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert_close(outs[0], attend(layer, q, k, v, batch, kv))


@pytest.mark.parametrize("kv_quant,window", [("f16", 12), ("k4v8", None)])
def test_mixed_plan_attention_matches_reference(triton_worker, gen, kv_quant, window):
    layer, kv, batch, q, k, v = make_case(gen, [(1, 30), (9, 40), (1, 3), (40, 40)], kv_quant,
                                          window)
    group = kv.group_of(0)
    planned = plan_batch(batch, batch, {group: layer}, PAGE)
    out = triton_worker.call("engine.layers.attention:attend", layer, q, k, v, planned, kv)
    assert_close(out, attend(layer, q, k, v, batch, kv))


@pytest.mark.parametrize("kv_quant,window", [("f16", None), ("q8", 70), ("k4v8", None)])
def test_cut_prefill_items_match_reference(triton_worker, gen, kv_quant, window):
    """Long chunks' query blocks cut into key splits (few items: `fill`), beside decode
    rows and a one-block chunk: the merged output is the reference's."""
    spans = [(20, 300), (1, 250), (3, 90), (13, 13)]
    layer, kv, batch, q, k, v = make_case(gen, spans, kv_quant, window)
    group = kv.group_of(0)
    config = AttnConfig(16, 16, 32)  # query blocks of 8 tokens
    plan = plan_attention(batch.query_start, batch.seq_lens, group=HEADS // KV_HEADS,
                          window=window, config=config, device="cpu", fill=64, least=32)
    assert plan.num_slots > batch.num_tokens + 2  # cut: more slots than one a token
    first = plan.work[plan.work[:, 0] == 0]
    assert first[:, 5].max() > 0  # the long chunk's blocks take several splits
    planned = _planned(batch, {group: GroupInputs(
        plan, batch.page_tables[group].to(torch.int32), batch.positions.to(torch.int32),
        config)}, {group: batch.write_slots(group, PAGE)})
    out = triton_worker.call("engine.layers.attention:attend", layer, q, k, v, planned, kv)
    assert_close(out, attend(layer, q, k, v, batch, kv))


def _cover(plan, row: int) -> dict[int, list[tuple[int, int]]]:
    """A row's items by their first token: [(key_lo, key_hi), ...] in split order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for w in plan.work.tolist():
        if w[0] == row:
            out.setdefault(w[1], []).append((w[5], w[3], w[4]))
    return {t: [(lo, hi) for _, lo, hi in sorted(v)] for t, v in out.items()}


@pytest.mark.parametrize("window", [None, 150])
def test_few_long_prefill_items_are_cut(window):
    """A 10-token chunk at 1000 keys (3 query blocks of 4 tokens) beside a short decode
    row: fill 24 items cuts each block's keys into contiguous, 64-aligned pieces of at
    most the chunk's mean load; every token gets its block's pieces as its splits; the
    chunk alone gets the same items."""
    cfg = AttnConfig(8, 16, 32)  # block_q 4 tokens at group 2
    qs, lens = torch.tensor([0, 10, 11]), torch.tensor([1000, 40])
    kw = dict(group=2, window=window, config=cfg, device="cpu")
    whole = plan_attention(qs, lens, **kw)
    cut = plan_attention(qs, lens, **kw, fill=24, least=64)
    keys = [w[4] - w[3] for w in whole.work.tolist() if w[0] == 0]
    load = prefill_split_keys(keys, 24, 64)
    assert load == max(64, -(-sum(keys) // 24)) and max(keys) > 2 * load
    before, after = _cover(whole, 0), _cover(cut, 0)
    assert sorted(before) == sorted(after) == [0, 4, 8]
    splits = []
    for t, [(lo, hi)] in before.items():
        pieces = after[t]
        assert pieces[0][0] == lo and pieces[-1][1] == hi and len(pieces) > 1
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
        assert all((b - a) % 64 == 0 and b - a <= -(-load // 64) * 64 for a, b in pieces[:-1])
        splits += [len(pieces)] * min(4, 10 - t)
    assert _cover(cut, 1) == _cover(whole, 1)  # the decode row: its own splits
    assert cut.tok_splits.tolist() == splits + whole.tok_splits.tolist()[10:]
    assert cut.tok_base.tolist() == (torch.cumsum(cut.tok_splits, 0) - cut.tok_splits).tolist()
    assert cut.num_slots == int(cut.tok_splits.sum())
    alone = plan_attention(qs[:2], lens[:1], **kw, fill=24, least=64)
    assert torch.equal(alone.work, cut.work[:alone.work.shape[0]])


def test_prefill_split_keys_leave_even_or_short_items():
    assert MIN_PREFILL_SPLIT == 1024
    assert prefill_split_keys([200_000] * 4, 33) == 24243  # 800K keys over 33 items
    assert prefill_split_keys([4096] * 32, 33) == 0  # 512 tokens at 4K: even already
    assert prefill_split_keys([32768] * 32 + [1] * 8, 33) == 0
    assert prefill_split_keys([3000, 10], 33) == 1024  # the least load
    assert prefill_split_keys([2000, 10], 33) == 0  # within twice the least
    assert prefill_split_keys([200_000] * 4, 0) == 0  # the CPU: never cut
    assert prefill_split_keys([], 33) == 0


def test_one_block_rows_take_at_most_max_decode_splits():
    """A one-block row's splits lengthen past MAX_DECODE_SPLITS (row_split_keys), in
    plan_attention too: a mixed step's long decode row is not cut into 128 splits."""
    assert row_split_keys(8192, 256) == 256 and row_split_keys(8193, 256) == 512
    assert row_split_keys(32768, 256) == 1024 and row_split_keys(100, 256) == 256
    cfg = AttnConfig(64, 64, 256)
    plan = plan_attention(torch.tensor([0, 1, 3]), torch.tensor([32768, 20000]), group=4,
                          window=None, config=cfg, device="cpu")
    assert plan.tok_splits.tolist() == [32, 20, 20]  # 1024 and 1024-key splits
    ranges = [(w[3], w[4]) for w in plan.work.tolist() if w[0] == 0]
    assert ranges == [(s * 1024, (s + 1) * 1024) for s in range(32)]
    windowed = plan_attention(torch.tensor([0, 1]), torch.tensor([40000]), group=4,
                              window=8192, config=cfg, device="cpu")
    assert windowed.work[:, 3].min() == 31808 and windowed.work[:, 4].max() == 40000
    assert int(windowed.tok_splits[0]) == MAX_DECODE_SPLITS + 1  # 256-key, straddling


@pytest.mark.parametrize("window", [None, 100, 64])
def test_padded_decode_plan_holds_the_planners_items(gen, window):
    split_keys, num_splits = 64, 6
    lens = torch.randint(1, 321, (9,), generator=gen)
    lens[:3] = torch.tensor([1, 64, 65])  # boundaries
    cfg = AttnConfig(64, 32, split_keys)
    ref = plan_attention(torch.arange(10), lens, group=2, window=window, config=cfg,
                         device="cpu")
    got = _decode_plan(lens, window, split_keys, num_splits, torch.arange(9, dtype=torch.int32))
    assert got.num_slots == 9 * num_splits and got.num_tokens == 9
    assert got.tok_splits.tolist() == [num_splits] * 9
    assert got.tok_base.tolist() == [r * num_splits for r in range(9)]
    work = got.work.view(9, num_splits, 6)
    expected = ref.work.tolist()
    for r in range(9):
        items = [tuple(w) for w in work[r].tolist()]
        real = [w for w in items if w[3] < w[4]]
        assert real == [tuple(w) for w in expected if w[0] == r]
        assert [w[5] for w in items] == list(range(num_splits))
        assert all(w[:3] == (r, r, 1) for w in items)


def test_decode_splits_cover_the_context():
    layer = AttnLayer(0, 8, 2, 64, 64, 0.125, None)
    cpu = torch.device("cpu")
    split_keys = AttnConfig.default(4, 64, 64).split_keys
    assert decode_splits(layer, split_keys, cpu) == 1
    assert decode_splits(layer, split_keys + 1, cpu) == 2
    windowed = AttnLayer(0, 8, 2, 64, 64, 0.125, split_keys)
    assert decode_splits(windowed, 100 * split_keys, cpu) == 2  # a window straddles a boundary


def test_plans_carry_their_config(gen):
    """plan_decode's plans are made for, and launched with, decode steps' config (its split
    keys cut the rows); plan_batch's with the layer's default."""
    layer, kv, batch, *_ = make_case(gen, [(1, 300), (1, 20)], "f16", None)
    cpu = torch.device("cpu")
    decode_cfg = AttnConfig.decode(HEADS // KV_HEADS, DIM, DIM)
    splits = {"full": decode_splits(layer, 300, cpu)}
    decoded = plan_decode(batch, {"full": layer}, PAGE, splits).attn["full"]
    assert decoded.config == decode_cfg
    assert decoded.plan.num_slots == 2 * -(-300 // decode_cfg.split_keys)
    planned = plan_batch(batch, batch, {"full": layer}, PAGE).attn["full"]
    assert planned.config == AttnConfig.default(HEADS // KV_HEADS, DIM, DIM)


def test_decode_split_keys_fill_the_device():
    """A one-token row's splits are halved (to MIN_SPLIT_KEYS at least) only while its
    own items are fewer than a quarter of the multiprocessors: Llama 3 8B's 8 KV heads on
    132 of them. The row's length decides alone (no other row of its step)."""
    assert MIN_SPLIT_KEYS == 128
    assert decode_split_keys(577, 8, 132) == 128  # 24 items at 256, 40 at 128
    assert decode_split_keys(1024, 8, 132) == 128  # 32 at 256
    assert decode_split_keys(1025, 8, 132) == SPLIT_KEYS  # 40 at 256
    assert decode_split_keys(4096, 8, 132) == SPLIT_KEYS  # 128 at 256
    assert decode_split_keys(96, 8, 132) == SPLIT_KEYS  # one split: no merge
    assert decode_split_keys(256, 8, 132) == SPLIT_KEYS
    assert decode_split_keys(257, 8, 132) == 128  # 16 items at 256, 24 at 128
    assert decode_split_keys(577, 8, 400) == 128  # never below MIN_SPLIT_KEYS
    assert decode_split_keys(577, 8, 0) == SPLIT_KEYS  # the CPU: never cut
    assert decode_split_keys(577, 8, 132, most=32) == 32  # 19 splits: not lengthened


def test_decode_split_keys_by_row():
    """An array of lengths gives each row the split of its length alone."""
    lens = np.array([96, 577, 1024, 1025, 8193, 32768, 1])
    got = decode_split_keys(lens, 8, 132)
    assert got.tolist() == [decode_split_keys(int(n), 8, 132) for n in lens]
    assert got.tolist() == [256, 128, 128, 256, 512, 1024, 256]


def test_decode_split_keys_lengthen_past_max_splits():
    """A row of more than MAX_DECODE_SPLITS splits takes longer ones (doubled from `most`
    until it fits), whatever the multiprocessors; 32 splits of 256 keys stay."""
    assert MAX_DECODE_SPLITS == 32
    assert decode_split_keys(8192, 8, 132) == SPLIT_KEYS  # 32 splits
    assert decode_split_keys(8193, 8, 132) == 512  # 33 at 256, 17 at 512
    assert decode_split_keys(16384, 8, 132) == 512
    assert decode_split_keys(32768, 8, 132) == 1024
    assert decode_split_keys(131072, 8, 0) == 4096  # the CPU too
    assert decode_split_keys(2048, 8, 0, most=32) == 64
    for keys in (8193, 20000, 65537, 250_000):
        split = decode_split_keys(keys, 8, 132)
        assert -(-keys // split) <= MAX_DECODE_SPLITS < -(-keys // (split // 2)), keys
