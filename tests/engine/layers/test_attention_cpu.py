"""CPU attention with batched decode rows: equal to a float64 softmax attention, and each
row bit-equal whatever other rows share the step."""

from __future__ import annotations

import pytest
import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache, LayerKVSpec
from engine.layers.attention import AttnLayer
from engine.layers.attention_cpu import attend_cpu

PAGE, HEADS, DIM = 16, 4, 64


def _setup(kv_quant: str, lengths: list[int], seed: int, kv_heads: int = 2):
    KVH = kv_heads  # noqa: N806
    """K/V for sequences of `lengths` tokens in random pages -> (kv, tables, keys, values)."""
    gen = torch.Generator().manual_seed(seed)
    kv = KVCache([LayerKVSpec("full", KVH, DIM, DIM)], {"full": 256}, PAGE, kv_quant)
    free = torch.randperm(256, generator=gen).tolist()
    tables, keys, values = [], [], []
    for n in lengths:
        pages = [free.pop() for _ in range(-(-n // PAGE))]
        k = torch.randn(n, KVH, DIM, generator=gen)
        v = torch.randn(n, KVH, DIM, generator=gen)
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(n)])
        kv.write(0, slots, k, v)
        stored_k, stored_v = kv.read(0, slots)  # what attention sees (quantized KV included)
        tables.append(pages)
        keys.append(stored_k)
        values.append(stored_v)
    return kv, tables, keys, values


def _reference(q, keys, values, layer: AttnLayer) -> torch.Tensor:
    KVH = layer.num_kv_heads  # noqa: N806
    """float64 attention of one decode query (HEADS, DIM) over its window."""
    n = keys.shape[0]
    lo = 0 if layer.window is None else max(0, n - layer.window)
    k, v = keys[lo:].double(), values[lo:].double()
    groups = HEADS // KVH
    qr = q.double().view(KVH, groups, DIM)
    scores = torch.einsum("hgd,khd->hgk", qr, k) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    return torch.einsum("hgk,khd->hgd", torch.softmax(scores, -1), v).reshape(-1)


@pytest.mark.parametrize("kv_quant", ["f16", "q8", "k8v4"])
@pytest.mark.parametrize("window,softcap,kv_heads", [(None, None, 2), (40, None, 1),
                                                     (None, 30.0, 2), (None, None, 1)])
def test_decode_rows_match_float64_and_are_batch_invariant(kv_quant, window, softcap, kv_heads):
    lengths = [1, 17, 64, 65, 130, 33]
    kv, tables, keys, values = _setup(kv_quant, lengths, len(str(window)) + 7, kv_heads)
    layer = AttnLayer(0, HEADS, kv_heads, DIM, DIM, 0.125, window, softcap)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(3))
    spans = [([1], n - 1) for n in lengths]
    together = attend_cpu(layer, q, ForwardBatch.build(spans, {"full": tables}), kv, "full")
    for i, n in enumerate(lengths):
        ref = _reference(q[i], keys[i], values[i], layer)
        torch.testing.assert_close(together[i].double(), ref, rtol=1e-5, atol=1e-5)
        alone = attend_cpu(layer, q[i:i + 1], ForwardBatch.build([spans[i]], {"full": [tables[i]]}),
                           kv, "full")
        assert torch.equal(alone[0], together[i]), f"row {i} ({n} keys) differs alone"


def test_mixed_step_keeps_prefill_rows_on_the_reference_path():
    lengths = [40, 20]
    kv, tables, keys, values = _setup("f16", lengths, seed=1)
    layer = AttnLayer(0, HEADS, 2, DIM, DIM, 0.125, None)
    q = torch.randn(1 + 5, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    # row 0 decodes its 40th token; row 1 prefills positions 15..19 (5 queries)
    batch = ForwardBatch.build([([1], 39), ([1] * 5, 15)], {"full": tables})
    out = attend_cpu(layer, q, batch, kv, "full")
    torch.testing.assert_close(out[0].double(), _reference(q[0], keys[0], values[0], layer),
                               rtol=1e-5, atol=1e-5)
    for j in range(5):  # causal: query at position 15 + j sees keys 0..15 + j
        ref = _reference(q[1 + j], keys[1][:16 + j], values[1][:16 + j], layer)
        torch.testing.assert_close(out[1 + j].double(), ref, rtol=1e-5, atol=1e-5)
