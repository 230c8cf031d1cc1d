"""paged_attention's Triton kernels (interpreted on the CPU) against the float64 reference,
and the reference against the engine's attend_reference, on KV written by the engine's
own KVCache (engine/kv/formats.py encoders) into randomly permuted pages.

Batches mix a prefill chunk, decode rows, a verify row and a chunk continuing a context;
GQA 4:1 and 3:1, a sliding window, soft-capping, sinks, every KV format pair.
The kernel takes f16 operands (relative 2^-11 per rounding) and accumulates in f32; a
wrong mask, page, scale or merge is off by the size of the output itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.batch import ForwardBatch
from engine.errors import InvalidRequest
from engine.kv.cache import KVCache, LayerKVSpec
from engine.layers.attention import AttnLayer, attend_reference
from kernels.paged_attention import AttnConfig, paged_attention_reference
from kernels.quant_x import quantize_x_reference

KERNEL = "kernels.paged_attention:paged_attention"
PAGE = 16
# (new tokens, tokens in context after the step): prefill, decode, verify, a continued
# chunk, a decode at the start of a sequence.
ROWS = [(19, 19), (1, 40), (3, 35), (9, 30), (1, 5)]


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def make_case(rng, kv_quant, rows=ROWS, heads=8, kv_heads=2, dim=64):
    """Engine-written KV for `rows` and random q; returns (q, kv, batch)."""
    num_pages = sum(-(-length // PAGE) for _, length in rows) + 2
    perm = rng.permutation(num_pages).tolist()
    tables, spans = [], []
    for new, length in rows:
        count = -(-length // PAGE)
        tables.append(perm[:count])
        perm = perm[count:]
        spans.append(([0] * new, length - new))
    batch = ForwardBatch.build(spans, {"full": tables})
    kv = KVCache([LayerKVSpec("full", kv_heads, dim, dim)], {"full": num_pages}, PAGE, kv_quant)

    def randn(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

    for row, (_, length) in enumerate(rows):
        keys = randn(length, kv_heads, dim)
        keys[..., 5] *= 20  # an outlier channel, as real K has
        slots = batch.row_slots("full", row, torch.arange(length), PAGE)
        kv.write(0, slots, keys, randn(length, kv_heads, dim))
    return randn(batch.num_tokens, heads, dim), kv, batch


def kwargs(batch, dim, window=None, softcap=None, sinks=None):
    return dict(query_start=batch.query_start, seq_lens=batch.seq_lens,
                positions=batch.positions, page_table=batch.page_tables["full"],
                page_size=PAGE, scale=dim**-0.5, window=window, softcap=softcap, sinks=sinks)


def run_both(interp, q, kv, kw, config=None):
    args = (q, kv.k[0], kv.v[0], kv.k_format.name, kv.v_format.name)
    out = interp.call(KERNEL, *args, config=config, **kw)
    ref = paged_attention_reference(*args, **kw)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all(), "output not fully written"
    return out, ref


def assert_close(out, ref, tol=4e-3):
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < tol, err


@pytest.mark.parametrize("kv_quant", ["f16", "q8", "k8v4", "k4v4"])
def test_mixed_batch_every_format(interp, rng, kv_quant):
    q, kv, batch = make_case(rng, kv_quant)
    assert_close(*run_both(interp, q, kv, kwargs(batch, 64)))


def test_window_softcap_sinks(interp, rng):
    q, kv, batch = make_case(rng, "q8")
    sinks = torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
    out, ref = run_both(interp, q, kv, kwargs(batch, 64, window=12, softcap=3.0, sinks=sinks))
    assert_close(out, ref)
    plain = paged_attention_reference(q, kv.k[0], kv.v[0], "q8", "q8", **kwargs(batch, 64))
    assert (plain - ref).abs().max() > 0.1  # the options matter at these shapes


def test_odd_head_dim_gqa3_and_splits(interp, rng):
    """Head dim 96 (padded to 128 in the kernel), 3 query heads per KV head, and short
    key splits so decode rows merge several partials."""
    rows = [(1, 70), (2, 45), (20, 40)]
    q, kv, batch = make_case(rng, "k4v8", rows, heads=6, kv_heads=2, dim=96)
    config = AttnConfig(block_m=16, block_n=16, split_keys=32)
    out, ref = run_both(interp, q, kv, kwargs(batch, 96, window=50), config)
    assert_close(out, ref)


@pytest.mark.parametrize("kv_quant", ["f16", "q8"])
def test_decode_config(interp, rng, kv_quant):
    """Decode-only steps' config (16-row M, 128-key blocks on NVIDIA) on decode rows whose
    keys span several blocks and splits, GQA 4:1 as in its AOT build."""
    rows = [(1, 300), (1, 129), (1, 7)]
    q, kv, batch = make_case(rng, kv_quant, rows, heads=8, kv_heads=2, dim=128)
    config = AttnConfig.decode(4, 128, 128, "cuda")
    assert config != AttnConfig.default(4, 128, 128, "cuda")
    out, ref = run_both(interp, q, kv, kwargs(batch, 128), config)
    assert_close(out, ref)


def test_batch_invariance(interp, rng):
    """A decode row's output is bit-equal alone and inside a mixed batch."""
    q, kv, batch = make_case(rng, "k8v4")
    config = AttnConfig(block_m=32, block_n=16, split_keys=16)
    args = (kv.k[0], kv.v[0], "q8", "q4")
    mixed = interp.call(KERNEL, q, *args, config=config, **kwargs(batch, 64))
    row = 1  # (1 new token, 40 in context)
    alone_batch = ForwardBatch(
        input_ids=batch.input_ids[19:20], positions=batch.positions[19:20],
        query_start=torch.tensor([0, 1]), seq_lens=batch.seq_lens[row:row + 1],
        page_tables={"full": batch.page_tables["full"][row:row + 1]},
        logits_rows=torch.tensor([0]))
    alone = interp.call(KERNEL, q[19:20], *args, config=config, **kwargs(alone_batch, 64))
    assert torch.equal(alone[0], mixed[19])


@pytest.mark.parametrize("kv_quant", ["f16", "q8", "k8v4", "k4v4", "k4v8"])
def test_reference_matches_engine(rng, kv_quant):
    """The float64 definition equals the engine's attend_reference (float32)."""
    q, kv, batch = make_case(rng, kv_quant)
    for window, softcap in ((None, None), (10, 4.0)):
        layer = AttnLayer(0, 8, 2, 64, 64, 64**-0.5, window, softcap)
        engine = attend_reference(layer, q, batch, kv, "full")
        ref = paged_attention_reference(q, kv.k[0], kv.v[0], kv.k_format.name,
                                        kv.v_format.name, **kwargs(batch, 64, window, softcap))
        assert float((engine.double() - ref).abs().max()) < 1e-4


def test_checks_inputs(interp, rng):
    q, kv, batch = make_case(rng, "q8", rows=[(1, 4)])
    kw = kwargs(batch, 64)
    with pytest.raises(InvalidRequest):  # planes of another format
        interp.call(KERNEL, q, kv.k[0], kv.v[0], "f16", "q8", **kw)
    with pytest.raises(InvalidRequest):  # heads not a multiple of KV heads
        interp.call(KERNEL, q[:, :7], kv.k[0], kv.v[0], "q8", "q8", **kw)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, q, kv.k[0], kv.v[0], "q8", "q8", **{**kw, "sinks": torch.zeros(3)})


def merge_reference(m, l, acc, base, splits, sinks):
    """Token t's partials merged in float64: sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M)
    l_s + 2^(sink - M))."""
    out = torch.empty(len(base), m.shape[1], acc.shape[2], dtype=torch.float64)
    for t, (b, n) in enumerate(zip(base.tolist(), splits.tolist(), strict=True)):
        mt, lt, at = m[b:b + n].double(), l[b:b + n].double(), acc[b:b + n].double()
        top = mt.max(0).values
        if sinks is not None:
            top = torch.maximum(top, sinks.double())
        w = torch.exp2(mt - top)
        den = (lt * w).sum(0) + (0 if sinks is None else torch.exp2(sinks.double() - top))
        out[t] = (at * w[..., None]).sum(0) / den[:, None]
    return out


@pytest.mark.parametrize("geometry", [(1, 4), (2, 8), (16, 8)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_geometries(interp, rng, geometry, with_sinks):
    """The merge kernel on partials of 1 to 19 splits a token (more than one load's
    MERGE_SPLITS), empty splits among them (m = -inf, l = 0: a split past the row's keys),
    6 heads (not a multiple of the heads a program takes), in the GPU's geometry (one token,
    4 heads a program) and others, against the float64 merge."""
    counts = [1, 3, 19, 8, 9]
    heads, dv = 6, 40
    slots = sum(counts)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    m, l_part, acc = t(slots, heads) * 3, t(slots, heads).abs() + 0.5, t(slots, heads, dv)
    base = torch.tensor(np.cumsum([0] + counts[:-1]), dtype=torch.int32)
    splits = torch.tensor(counts, dtype=torch.int32)
    empty = [int(base[2]) + 17, int(base[1]) + 2]  # token 2's split 17, token 1's last
    m[empty], l_part[empty], acc[empty] = float("-inf"), 0.0, 0.0
    sinks = t(heads) if with_sinks else None
    out = torch.full((len(counts), heads, dv), float("nan"))
    out = interp.call("tests.kernels.test_paged_attention:_merge_out", m, l_part, acc, base,
                      splits, sinks, out, geometry)
    want = merge_reference(m, l_part, acc, base, splits, sinks)
    assert torch.isfinite(out).all()
    assert float((out.double() - want).abs().max()) < 1e-5


def _merge_out(m, l_part, acc, base, splits, sinks, out, geometry, quantize=False):
    """Runs in the interpreter worker: the merge kernel into `out`, returned (with
    `quantize` also its quantized copy)."""
    from kernels.paged_attention_triton import merge
    from kernels.quant_x import empty_quant_x

    xq = empty_quant_x(out.shape[0], out.shape[1] * out.shape[2], out.device) if quantize \
        else None
    merge(m, l_part, acc, base, splits, sinks, out, geometry, xq=xq)
    return (out, xq) if quantize else out


@pytest.mark.parametrize("geometry", [(1, 4), (2, 8), (16, 8)])
def test_merge_quantizes_each_programs_blocks(interp, rng, geometry):
    """With a quantized copy asked for, each merge program quantizes its own heads' whole
    256-column blocks (4 heads of 128 columns: 2 blocks; the GPU's geometry) of each of its
    tokens: together quantize_x's bits of the merged output."""
    counts, heads, dv = [1, 3, 9], 8, 128
    slots = sum(counts)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    m, l_part, acc = t(slots, heads) * 3, t(slots, heads).abs() + 0.5, t(slots, heads, dv)
    base = torch.tensor(np.cumsum([0] + counts[:-1]), dtype=torch.int32)
    splits = torch.tensor(counts, dtype=torch.int32)
    out = torch.full((len(counts), heads, dv), float("nan"))
    out, xq = interp.call("tests.kernels.test_paged_attention:_merge_out", m, l_part, acc,
                          base, splits, None, out, geometry, True)
    assert float((out.double() - merge_reference(m, l_part, acc, base, splits, None)
                  ).abs().max()) < 1e-5
    codes, scales = quantize_x_reference(out.reshape(len(counts), -1))
    assert torch.equal(xq.q.to(torch.int32), codes) and torch.equal(xq.dx, scales)
    assert torch.equal(xq.bs.to(torch.int32), codes.to(torch.int32).view(len(counts), -1,
                                                                         16).sum(-1))


def test_merge_refuses_to_quantize_partial_blocks(interp, rng):
    """A program's heads short of whole 256-column blocks (4 heads of 40 columns) cannot be
    quantized by it: a clear error, not a wrong scale."""
    out = torch.zeros(1, 6, 40)
    with pytest.raises(InvalidRequest, match="256-column blocks"):
        interp.call("tests.kernels.test_paged_attention:_merge_out", torch.zeros(1, 6),
                    torch.ones(1, 6), torch.zeros(1, 6, 40), torch.zeros(1, dtype=torch.int32),
                    torch.ones(1, dtype=torch.int32), None, out, (1, 4), True)


@pytest.mark.parametrize("kv_quant", ["f16", "k8v4"])
@pytest.mark.parametrize("rows,config,sinks", [
    ([(1, 40), (1, 7), (1, 130)], AttnConfig.decode(4, 128, 128, "cuda"), False),  # direct
    ([(1, 300), (3, 35), (1, 129)], AttnConfig(block_m=16, block_n=16, split_keys=64), False),
    ([(1, 40), (2, 9)], None, True),  # sinks: the merge kernel writes out
])
def test_output_quantized_for_q8(interp, rng, rows, config, sinks, kv_quant):
    """paged_attention_q8: the launch that writes the output (the partial kernel with one
    split a token and no sinks, else the merge) also writes it quantized, with
    kernels/qint.py's quantize_x bits of that output (its float64-exact reference), and
    the output itself is paged_attention's; a rotated V's output is quantized as rotated
    back."""
    q, kv, batch = make_case(rng, kv_quant, rows, heads=8, kv_heads=2, dim=128)
    kw = kwargs(batch, 128, sinks=torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
                if sinks else None)
    args = (q, kv.k[0], kv.v[0], kv.k_format.name, kv.v_format.name)
    out, xq = interp.call("kernels.paged_attention:paged_attention_q8", *args, config=config,
                          **kw)
    assert xq is not None
    assert torch.equal(out, interp.call(KERNEL, *args, config=config, **kw))
    codes, scales = quantize_x_reference(out)
    assert torch.equal(xq.q.to(torch.int32), codes) and torch.equal(xq.dx, scales)
    want_sums = codes.to(torch.int32).view(out.shape[0], -1, 16).sum(-1)
    assert torch.equal(xq.bs.to(torch.int32), want_sums)
    assert_close(out, paged_attention_reference(*args, **kw))


def test_output_quantized_only_where_it_can(interp, rng):
    """A KV head's query heads short of a 256-column block: no quantized output (None)."""
    q, kv, batch = make_case(rng, "f16", [(1, 40)], heads=2, kv_heads=2, dim=128)
    out, xq = interp.call("kernels.paged_attention:paged_attention_q8", q, kv.k[0], kv.v[0],
                          "f16", "f16", **kwargs(batch, 128))
    assert xq is None


@pytest.mark.parametrize("kv_quant", ["q8", "k8v4", "k4v4"])
@pytest.mark.parametrize("rows,config,sinks", [
    (ROWS, None, False),
    ([(1, 300), (3, 35), (1, 129)], AttnConfig(block_m=16, block_n=16, split_keys=64), False),
    ([(1, 40), (1, 7)], AttnConfig.decode(4, 64, 64, "cuda"), False),  # direct
    ([(1, 40), (2, 9)], None, True),  # the merge writes out
])
def test_rotations_are_the_exact_rotations(interp, rng, kv_quant, rows, config,
                                                          sinks):
    """Rotated K and V: q rotated by its launch and the output by the kernel that stores
    it (the partial kernel, direct, or the merge) give the bits of the exact rotations
    (engine/kv/hadamard.py's rotate_exact) around the same kernel on the same planes read
    unrotated (the _plain formats): q before it, the output after it."""
    from engine.kv.hadamard import rotate_exact

    q, kv, batch = make_case(rng, kv_quant, rows)
    kw = kwargs(batch, 64, sinks=torch.from_numpy(rng.standard_normal(8, dtype=np.float32))
                if sinks else None)
    k_fmt, v_fmt = kv.k_format.name, kv.v_format.name
    folded = interp.call(KERNEL, q, kv.k[0], kv.v[0], k_fmt, v_fmt, config=config, **kw)
    apart = interp.call(KERNEL, rotate_exact(q), kv.k[0], kv.v[0], k_fmt + "_plain",
                        v_fmt + "_plain", config=config, **kw)
    apart = rotate_exact(apart.view(q.shape[0], 8, 64)).reshape(apart.shape)
    assert torch.equal(folded, apart)
    # q rotated before the call (rope_qk's store does): the same bits, no rotation here
    pre = interp.call(KERNEL, rotate_exact(q), kv.k[0], kv.v[0], k_fmt, v_fmt, config=config,
                      q_rotated=True, **kw)
    assert torch.equal(pre, folded)
    ref = paged_attention_reference(q, kv.k[0], kv.v[0], k_fmt, v_fmt, **kw)
    assert_close(pre, ref)
    from kernels.paged_attention import paged_attention  # the reference path (no interpreter)

    cpu = paged_attention(rotate_exact(q), kv.k[0], kv.v[0], k_fmt, v_fmt, q_rotated=True, **kw)
    assert_close(cpu, ref, tol=1e-5)
