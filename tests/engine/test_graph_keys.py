"""Decode graphs are keyed by (row bucket, key splits): `prepare_graphs(context)` must
capture every key that a decode step with rows of up to `context` tokens can use, so no
such step stalls on a capture, and the runner's cached splits must be what the attention
plan asks for (decode_splits rounded up to a power of two, capped at max_context's)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.batch import ForwardBatch
from engine.graphs import bucket_for
from engine.kv.pool import SeqPages
from engine.layers.attention import decode_splits, plan_decode
from engine.loader import load
from engine.runner import ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf
from kernels.paged_attention_plan import SPLIT_KEYS

K = SPLIT_KEYS  # a decode row's keys are split every K positions
CONTEXT = 16 * K  # 1, 2, 4, 8 or 16 splits
KEYS = (CONTEXT // K).bit_length()  # distinct split counts of the full-attention group


class CountingCapture:
    """Runs the captured function once; a replay runs it again into the same output."""

    def __init__(self) -> None:
        self.captures = 0

    def __call__(self, fn):
        self.captures += 1
        out = fn()
        return (lambda: out.copy_(fn())), out


@contextlib.contextmanager
def decode_rows(runner, lengths):
    """A decode-only batch of rows holding `lengths` tokens, on pages given back after."""
    seqs = [SeqPages(runner.pool) for _ in lengths]
    try:
        for s, n in zip(seqs, lengths, strict=True):
            s.ensure(n)
        yield ForwardBatch.build([([1], n - 1) for n in lengths],
                                 {g: [s.table(g) for s in seqs] for g in runner.pool.groups})
    finally:
        for s in seqs:
            s.free()


@pytest.fixture(scope="module")
def model(tmp_path_factory, vocab_dir):
    # a full and a sliding group: the sliding one never needs more than 2 splits
    spec = SyntheticSpec("gemma3", num_layers=6, hidden_size=32, num_heads=2, num_kv_heads=1,
                         head_dim=16, ffn_size=64, sliding_window=24, default_type=T.F32)
    path = tmp_path_factory.mktemp("keys") / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    return load(path, torch.float32, "cpu").model


def test_splits_follow_the_attention_plan(model):
    runner = ModelRunner(model, 300, 16, cuda_graphs=True, max_context=CONTEXT,
                         capture=CountingCapture())
    layers = runner._layers
    top = {g: decode_splits(layer, CONTEXT, torch.device("cpu")) for g, layer in layers.items()}
    for longest in (1, 2, K - 1, K, K + 1, 2 * K - 1, 2 * K, 2 * K + 1, 3 * K, 4 * K - 1,
                    4 * K, 9 * K, CONTEXT - 1, CONTEXT):
        want = {g: min(1 << (decode_splits(layer, longest, torch.device("cpu")) - 1)
                       .bit_length(), top[g]) for g, layer in layers.items()}
        assert runner._splits_for(longest) == want, longest
    assert runner._splits_for(2 * K + 1) == {"full": 4, "sliding": 2}


def test_prepared_graphs_cover_every_row_length(model):
    fake = CountingCapture()
    runner = ModelRunner(model, 300, 16, cuda_graphs=True, max_context=CONTEXT, capture=fake)
    assert runner.graphs is not None
    assert runner.prepare_graphs(CONTEXT) == KEYS * 7  # splits 1, 2, 4 ... (sliding: 1, 2, 2 ...)
    assert fake.captures == KEYS * 7
    replays = runner.graphs.num_replays
    for lengths in ((5,), (K + 76,), (2 * K + 452,), (CONTEXT - 96,), (5, K + 76, 3),
                    (CONTEXT - 96, 7)):
        with decode_rows(runner, lengths) as batch:
            assert runner.forward(batch).shape[0] == len(lengths)
    assert fake.captures == KEYS * 7 and runner.graphs.num_replays == replays + 6
    fresh = ModelRunner(model, 300, 16, cuda_graphs=True, max_context=CONTEXT,
                        capture=CountingCapture())
    assert fresh.prepare_graphs() == 7  # one key for short rows


def test_split_keys_follow_the_device(model):
    """With multiprocessors to fill (num_sms), a short row's keys are cut finer
    (decode_split_keys), by its own length only: a row of 300 keys takes 128-key splits
    alone and among 8 others. prepare_graphs still captures every key such steps use,
    and a replay's staged work items are the device plan's for the same keys."""
    fake = CountingCapture()
    runner = ModelRunner(model, 300, 16, cuda_graphs=True, max_context=CONTEXT, capture=fake,
                         num_sms=64)
    # the sliding group sees 24 keys: one split at K, no merge
    for rows in (1, 9):
        with decode_rows(runner, (300,) * rows) as batch:
            keys = runner._row_keys(batch)
            assert keys["full"].tolist() == [128] * rows
            assert keys["sliding"].tolist() == [K] * rows
    with decode_rows(runner, (300, 4000, 5)) as batch:  # each row its own
        assert runner._row_keys(batch)["full"].tolist() == [128, K, K]
    runner.prepare_graphs(CONTEXT)
    captured = fake.captures
    one_row = [dict(key)["full"] for bucket, key in runner.graphs._graphs if bucket == 1]
    assert max(one_row) > CONTEXT // K  # rows below 4096 keys split in 128 keys
    for lengths in ((5,), (140,), (K + 76,), (2 * K + 452,), (CONTEXT - 96,), (5, K + 76, 3),
                    (CONTEXT - 96, 7), (300,) * 9):
        with decode_rows(runner, lengths) as batch:
            assert runner.forward(batch).shape[0] == len(lengths)
            splits, keys = runner._decode_splits(batch)
            staged = runner.graphs.static_batch(bucket_for(len(lengths)), splits)
            device_plan = plan_decode(batch, runner._layers, 16, splits, keys)
            for g in runner.pool.groups:
                rows = len(lengths) * splits[g]
                assert torch.equal(staged.attn[g].plan.work[:rows],
                                   device_plan.attn[g].plan.work), (lengths, g)
                # every key of each row in exactly one of its items
                work = device_plan.attn[g].plan.work
                for r, n in enumerate(lengths):
                    items = work[work[:, 0] == r]
                    seen = int((items[:, 4] - items[:, 3]).sum())
                    assert seen == min(n, runner._layers[g].window or n), (lengths, g, r)
    assert fake.captures == captured
