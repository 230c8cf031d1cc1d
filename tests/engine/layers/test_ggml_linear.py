"""GGMLLinear against gguf-py's dequantize @ x in float64, on fresh random GGUF blocks.

The Triton path runs in the interpreter worker (MBUFO_KERNELS=triton there); the torch
path (the CPU default) in this process. Q4_K_M-style fusions mix types: q|k in Q4_K, v in
Q6_K, so the fused layer is two launches whose outputs are concatenated.
Bound: weights and x are rounded to bf16 in the kernel (2^-9 relative each), sums in
f32: |y - ref| <= 2^-7 (|W| @ |x|) is asserted; a wrong row order or part is off by far more.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine.errors import GGUFFormatError
from engine.layers.ggml_linear import GGMLLinear
from kernels.qint import Q6_K_A
from kernels.quant_x import dequantized_x_reference

F16_FIELDS = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def random_raw(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Flat uint8 GGUF bytes of an (n, k) weight: random codes, finite random f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(FLOATS[qtype])
        return w.view(torch.uint8).reshape(-1).numpy()
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset:offset + 2] = (rng.standard_normal((len(raw), 1)) * 0.1).astype(
            np.float16).view(np.uint8)
    return raw.reshape(-1)


def dense64(raw: np.ndarray, qtype: T, n: int, k: int) -> torch.Tensor:
    if qtype in FLOATS:
        return torch.from_numpy(raw).view(FLOATS[qtype]).double().reshape(n, k)
    return torch.from_numpy(gguf_dequantize(raw.reshape(n, -1), qtype).astype(np.float64))


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def build(rng, parts: list[tuple[T, int]], k: int, with_bias: bool):
    """Fused layer of `parts` (type, rows) -> (layer, float64 weight, float64 bias or None)."""
    linears, dense, biases = [], [], []
    for i, (qtype, n) in enumerate(parts):
        raw = random_raw(qtype, n, k, rng)
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if with_bias and \
            i != 1 else None
        linears.append(GGMLLinear.from_raw(torch.from_numpy(raw), int(qtype), (n, k), bias))
        dense.append(dense64(raw, qtype, n, k))
        biases.append(bias.double() if bias is not None else torch.zeros(n, dtype=torch.float64))
    bias = torch.cat(biases) if with_bias else None
    return GGMLLinear.fuse(linears), torch.cat(dense), bias


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    if bias is not None:
        ref = ref + bias
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert (err <= 2**-7 * bound + 1e-6).all(), float((err / bound).max())


QKV = [(T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32)]  # q | k in Q4_K, v in Q6_K


@pytest.mark.parametrize("m", [1, 5, 17])
def test_triton_path_matches_gguf(triton_worker, rng, m):
    k = 256
    layer, w, bias = build(rng, QKV, k, with_bias=True)
    assert [p.ggml_type for p in layer.parts] == [T.Q4_K, T.Q6_K]  # q|k merged: one launch
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    check(triton_worker.call("operator:call", layer, x), x, w, bias)


@pytest.mark.parametrize("m", [3, 17])
def test_triton_path_with_float_parts_and_strided_x(triton_worker, rng, m):
    """F16, BF16 and F32 matrices beside blocks: held as BF16 parts (neighbouring float
    parts merge: one launch), skinny and tiled."""
    k = 128
    layer, w, _ = build(rng, [(T.Q8_0, 48), (T.F16, 16), (T.BF16, 8), (T.Q8_0, 40),
                              (T.F32, 24)], k, with_bias=False)
    assert [p.ggml_type for p in layer.parts] == [T.Q8_0, T.BF16, T.Q8_0, T.BF16]
    assert [p.out_features for p in layer.parts] == [48, 24, 40, 24]
    x = torch.from_numpy(rng.standard_normal((m, 2 * k)).astype(np.float32))[:, ::2]
    check(triton_worker.call("operator:call", layer, x), x, w, None)


def test_float_matrix_held_in_bf16(rng):
    """A BF16 file's bytes are the part as they are; F16 and F32 are rounded once to bf16
    (round to nearest even, as torch rounds); with a float32 dense dtype (exact parity)
    the matrix stays float32 beside the kernels."""
    n, k = 8, 64
    bf16 = torch.from_numpy(random_raw(T.BF16, n, k, rng))
    layer = GGMLLinear.from_raw(bf16, int(T.BF16), (n, k))
    assert layer.parts[0].weight.data_ptr() == bf16.data_ptr()
    for qtype in (T.F16, T.F32):
        raw = random_raw(qtype, n, k, rng)
        part = GGMLLinear.from_raw(torch.from_numpy(raw), int(qtype), (n, k)).parts[0]
        assert part.ggml_type == T.BF16 and part.weight.shape == (n, 2 * k)
        want = torch.from_numpy(raw).view(FLOATS[qtype]).reshape(n, k).to(torch.bfloat16)
        assert torch.equal(part.weight.view(torch.bfloat16), want)
        exact = GGMLLinear.from_raw(torch.from_numpy(raw), int(qtype), (n, k),
                                    dense_dtype=torch.float32).parts[0]
        assert exact.ggml_type is None and exact.weight.dtype == torch.float32
    with pytest.raises(GGUFFormatError, match="attn_out"):
        GGMLLinear.from_raw(bf16[:-2], int(T.BF16), (n, k), name="blk.0.attn_out.weight")


def test_float_part_rows_are_batch_invariant(triton_worker, rng):
    """A BF16 part's row: the same bits alone, among 5 (skinny) and among 33 (tiled)."""
    k = 256
    layer, _, _ = build(rng, [(T.F16, 40)], k, with_bias=False)
    x = torch.from_numpy(rng.standard_normal((33, k)).astype(np.float32))
    alone = triton_worker.call("operator:call", layer, x[:1])
    for rows in (5, 33):
        assert torch.equal(triton_worker.call("operator:call", layer, x[:rows])[:1], alone)


def test_torch_path_matches_gguf(rng):
    k = 256
    layer, w, bias = build(rng, QKV, k, with_bias=True)
    x = torch.from_numpy(rng.standard_normal((4, k)).astype(np.float32))
    check(operator.call(layer, x), x, w, bias)
    assert (layer.out_features, layer.in_features) == (128, k)


def test_wrong_byte_count_is_a_format_error(rng):
    raw = torch.from_numpy(random_raw(T.Q4_K, 8, 256, rng))
    with pytest.raises(GGUFFormatError, match="blk.0.attn_q"):
        GGMLLinear.from_raw(raw[:-1], int(T.Q4_K), (8, 256), name="blk.0.attn_q.weight")


def build_act8(rng, k: int):
    """A q|k|v layer like QKV, and rows of a type without an 8-bit kernel (Q8_0), with
    act8: -> (layer, [(type, rows, raw)])."""
    parts = [(qtype, n, random_raw(qtype, n, k, rng)) for qtype, n in QKV + [(T.Q8_0, 16)]]
    layer = GGMLLinear.fuse([GGMLLinear.from_raw(torch.from_numpy(raw), int(qtype), (n, k),
                                                 act8=True) for qtype, n, raw in parts])
    return layer, parts


def check_act8(y: torch.Tensor, x: torch.Tensor, parts) -> None:
    """Q4_K and Q6_K rows: gguf-py's weights times x quantized to 8 bits (kernels/qint.py's
    definition) within 2^-16; other rows: the plain product within 2^-7 (bf16 operands)."""
    m, k = x.shape
    xq = dequantized_x_reference(x)
    row = 0
    for qtype, n, raw in parts:
        w = dense64(raw, qtype, n, k)
        xx, tol = (xq, 2**-16) if qtype in (T.Q4_K, T.Q6_K) else (x.double(), 2**-7)
        err = (y[:, row:row + n].double() - xx @ w.T).abs()
        assert (err <= tol * (xx.abs() @ w.abs().T) + 1e-9).all(), (qtype, float(err.max()))
        row += n


@pytest.mark.parametrize("m", [1, 5])
def test_act8_layer_multiplies_q4k_q6k_with_8bit_x(triton_worker, rng, m):
    """The q8 layout: Q4_K and Q6_K parts through kernels/qint.py (quantized x; Q6_K held
    in its aligned rows), the others as before; the torch path (CPU) gives the same
    numerics through qint_reference."""
    k = 512
    layer, parts = build_act8(rng, k)
    assert layer.act8 and [p.ggml_type for p in layer.parts] == [T.Q4_K, Q6_K_A, T.Q8_0]
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    check_act8(triton_worker.call("operator:call", layer, x), x, parts)
    check_act8(operator.call(layer, x), x, parts)


def test_act8_layers_fuse_only_with_act8(rng):
    a = GGMLLinear.from_raw(torch.from_numpy(random_raw(T.Q4_K, 8, 256, rng)), int(T.Q4_K),
                            (8, 256), act8=True)
    b = GGMLLinear.from_raw(torch.from_numpy(random_raw(T.Q4_K, 8, 256, rng)), int(T.Q4_K),
                            (8, 256))
    with pytest.raises(ValueError, match="act8"):
        GGMLLinear.fuse([a, b])


def build_hybrid(rng, k: int, dense_rows: int):
    """build_act8's layer twice from the same bytes: with a bf16 copy from `dense_rows`
    rows (the hybrid layout) and without (q8)."""
    parts = [(qtype, n, random_raw(qtype, n, k, rng)) for qtype, n in QKV + [(T.Q8_0, 16)]]

    def fused(rows):
        return GGMLLinear.fuse([GGMLLinear.from_raw(
            torch.from_numpy(raw), int(qtype), (n, k), act8=True, dense_rows=rows)
            for qtype, n, raw in parts])

    return fused(dense_rows), fused(None), parts


@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_hybrid_takes_the_blocks_below_its_threshold_and_bf16_copies_from_it(rng, m):
    """Below `dense_rows` rows a hybrid layer is the q8 layer, bit for bit; from it on,
    the product of bf16-rounded gguf-py weights and bf16-rounded x: f32 sums, the result
    rounded to bf16 on the CPU as the bf16 layout's (2^-8 of it), and within 2^-7 of the
    float64 product."""
    k, threshold = 256, 4
    hybrid, q8, parts = build_hybrid(rng, k, threshold)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = hybrid(x)
    w = torch.cat([dense64(raw, qtype, n, k) for qtype, n, raw in parts])
    if m < threshold:
        assert torch.equal(y, q8(x))
        check_act8(y, x, parts)
    else:
        assert not torch.equal(y, q8(x))  # the copies, not x's 8-bit codes
        xb = x.to(torch.bfloat16).double()
        wb = w.to(torch.bfloat16).double()
        ref = xb @ wb.T
        err = (y.double() - ref).abs()
        assert y.dtype == torch.float32
        assert (err <= 2**-8 * ref.abs() + 2**-12 * (xb.abs() @ wb.abs().T) + 1e-6).all(), \
            float(err.max())
        check(y, x, w, None)
    assert hybrid.wants_xq(m) == (m < threshold) and q8.wants_xq(m)
    assert hybrid.input_dtype(m) == (torch.bfloat16 if m >= threshold else torch.float32)


def test_hybrid_copy_is_the_whole_fused_matrix_and_counts_in_nbytes(rng):
    k = 256
    hybrid, q8, parts = build_hybrid(rng, k, 2)
    assert hybrid.dense.shape == (hybrid.out_features, k)
    assert hybrid.dense.dtype == torch.bfloat16
    assert hybrid.nbytes == q8.nbytes + hybrid.dense.numel() * 2
    w = torch.cat([dense64(raw, qtype, n, k) for qtype, n, raw in parts])
    torch.testing.assert_close(hybrid.dense.double(), w, rtol=2**-8, atol=1e-12)


def test_hybrid_fused_dense_parts_are_views_of_the_copy_not_held_twice(rng):
    """A hybrid fuse of a float matrix (F16, held as BF16) beside Q4_K: the float rows are
    held once (the part is the copy's rows), and the layer's results are unchanged below
    and from its threshold."""
    k = 256
    f16 = rng.standard_normal((16, k)).astype(np.float16)
    q4 = random_raw(T.Q4_K, 8, k, rng)

    def fused(rows):
        return GGMLLinear.fuse([
            GGMLLinear.from_raw(torch.from_numpy(q4), int(T.Q4_K), (8, k), act8=True,
                                dense_rows=rows),
            GGMLLinear.from_raw(torch.from_numpy(f16.view(np.uint8).reshape(-1)),
                                int(T.F16), (16, k), act8=True, dense_rows=rows)])

    hybrid, q8 = fused(2), fused(None)
    dense_part = hybrid.parts[-1]
    assert dense_part.ggml_type == int(T.BF16)
    assert dense_part.weight.data_ptr() == hybrid.dense[8:].data_ptr()
    q4_bytes = hybrid.parts[0].weight.numel()
    assert hybrid.nbytes == q4_bytes + hybrid.dense.numel() * 2
    assert q8.nbytes == q4_bytes + 16 * k * 2
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    assert torch.equal(hybrid(x), q8(x))
    x3 = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    w = torch.cat([dense64(q4, T.Q4_K, 8, k), torch.from_numpy(f16).double()])
    check(hybrid(x3), x3, w, None)


def test_nbytes_counts_views_of_one_buffer_apart(rng):
    """Parts that are views of one buffer (blocks sliced from a file's mapping) each count
    their own bytes; only a range held twice counts once."""
    from engine.layers.ggml_linear import GGMLPart

    k = 256
    buf = torch.from_numpy(random_raw(T.Q4_K, 16, k, rng)).reshape(16, -1)
    dense = torch.zeros(4, k, dtype=torch.bfloat16)
    layer = GGMLLinear([GGMLPart(8, int(T.Q4_K), buf[:8]), GGMLPart(4, None, dense),
                        GGMLPart(8, int(T.Q4_K), buf[8:])], k)
    assert layer.nbytes == buf.numel() + dense.numel() * 2


def test_hybrid_thresholds_must_agree_and_be_given_with_a_copy(rng):
    raw = torch.from_numpy(random_raw(T.Q4_K, 8, 256, rng))
    a = GGMLLinear.from_raw(raw, int(T.Q4_K), (8, 256), act8=True, dense_rows=4)
    b = GGMLLinear.from_raw(raw, int(T.Q4_K), (8, 256), act8=True, dense_rows=8)
    with pytest.raises(ValueError, match="threshold"):
        GGMLLinear.fuse([a, b])
    with pytest.raises(ValueError, match="threshold"):
        GGMLLinear(a.parts, 256, dense=a.dense)
    with pytest.raises(ValueError, match="threshold"):
        GGMLLinear(a.parts, 256, dense_rows=4)
    with pytest.raises(ValueError, match="is not the layer's"):
        GGMLLinear(a.parts, 256, dense=a.dense[:4], dense_rows=4)


def test_blocks_only_sets_the_copies_aside_on_its_thread(rng):
    from engine.layers.ggml_linear import blocks_only

    k = 256
    hybrid, q8, _ = build_hybrid(rng, k, 2)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    assert hybrid.dense_at(3) and not torch.equal(hybrid(x), q8(x))
    with blocks_only():
        assert not hybrid.dense_at(3) and hybrid.wants_xq(3)
        assert torch.equal(hybrid(x), q8(x))
    assert hybrid.dense_at(3)
