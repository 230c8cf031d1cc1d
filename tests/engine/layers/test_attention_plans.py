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
    _decode_plan,
    attend,
    decode_splits,
    plan_batch,
    plan_decode,
)
from kernels.paged_attention_plan import (
    MAX_DECODE_SPLITS,
    MIN_SPLIT_KEYS,
    SPLIT_KEYS,
    AttnConfig,
    decode_split_keys,
    plan_attention,
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
    """Splits are halved (to MIN_SPLIT_KEYS at least) only while a step's items are fewer
    than a quarter of the multiprocessors: Llama 3 8B's 8 KV heads on 132 of them."""
    assert MIN_SPLIT_KEYS == 128
    assert decode_split_keys(1, 577, 8, 132) == 128  # 24 items at 256, 40 at 128
    assert decode_split_keys(1, 1024, 8, 132) == 128  # 32 at 256
    assert decode_split_keys(1, 4096, 8, 132) == SPLIT_KEYS  # 128 at 256
    assert decode_split_keys(1, 96, 8, 132) == SPLIT_KEYS  # one split: no merge
    assert decode_split_keys(1, 256, 8, 132) == SPLIT_KEYS
    assert decode_split_keys(1, 257, 8, 132) == 128  # 16 items at 256, 24 at 128
    assert decode_split_keys(1, 577, 8, 400) == 128  # never below MIN_SPLIT_KEYS
    assert decode_split_keys(16, 577, 8, 132) == SPLIT_KEYS  # 384 items already
    assert decode_split_keys(1, 577, 8, 0) == SPLIT_KEYS  # the CPU: never cut
    assert decode_split_keys(1, 577, 8, 132, most=32) == 32  # 19 splits: not lengthened


def test_decode_split_keys_lengthen_past_max_splits():
    """A row of more than MAX_DECODE_SPLITS splits takes longer ones (doubled from `most`
    until it fits), whatever the rows and multiprocessors; 32 splits of 256 keys stay."""
    assert MAX_DECODE_SPLITS == 32
    assert decode_split_keys(1, 8192, 8, 132) == SPLIT_KEYS  # 32 splits
    assert decode_split_keys(1, 8193, 8, 132) == 512  # 33 at 256, 17 at 512
    assert decode_split_keys(1, 16384, 8, 132) == 512
    assert decode_split_keys(1, 32768, 8, 132) == 1024
    assert decode_split_keys(16, 32768, 8, 132) == 1024
    assert decode_split_keys(1, 131072, 8, 0) == 4096  # the CPU too
    assert decode_split_keys(1, 2048, 8, 0, most=32) == 64
    for keys in (8193, 20000, 65537, 250_000):
        split = decode_split_keys(1, keys, 8, 132)
        assert -(-keys // split) <= MAX_DECODE_SPLITS < -(-keys // (split // 2)), keys
