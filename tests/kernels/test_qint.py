"""kernels/qint.py (Q4_K and Q6_K with 8-bit activations), interpreted on the CPU, against
gguf-py's dequantize @ the quantized x in float64, on fresh random GGUF blocks.

The kernel's sums per super-block are exact integers; what is left is float32 rounding in
the two fmas per super-block and in gguf-py's own weights (d * sc rounded): 2^-16 of
|W| @ |x_q| bounds it. A wrong nibble, scale, sign or column is off by about the size of
the term itself. x's quantization is checked against a float64 rounding of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from test_qmatmul import random_weight

from engine.errors import InvalidRequest
from kernels.qint import (
    ACT8_STORED,
    GEMV_MAX_M,
    Q4K_ONE_ROW_REGS,
    Q6_K_A,
    Q6K_EARLY_WAVES,
    Q6K_HEAD_BLOCK_N,
    WIDE_N,
    QIntConfig,
    default_qint_config,
    gemv_max_m,
    other_way,
    qint_reference,
    repack_q6k,
    row_bytes,
    unpack_q6k,
)
from kernels.quant_x import (
    INT_SUMS_M,
    dequantized_x_reference,
    empty_quant_x,
    quantize_x_reference,
    sums_dtype,
)

KERNEL = "kernels.qint:qint_triton"


def stored(blocks: torch.Tensor, qtype: T, k: int) -> tuple[torch.Tensor, int]:
    """GGUF blocks as the kernels hold them: Q6_K repacked into aligned rows."""
    kind = ACT8_STORED[int(qtype)]
    return (repack_q6k(blocks, k) if kind == Q6_K_A else blocks), kind


def test_q6k_aligned_rows(rng):
    """Q6_K_A rows: 16-byte multiples, the super-blocks' first 208 bytes in order, then the
    d's, zero padding; unpack_q6k restores the GGUF bytes; the reference reads either."""
    for k in (256, 512, 2048, 3584):
        blocks = random_weight(T.Q6_K, 3, k, rng)
        rows = repack_q6k(blocks, k)
        nsb = k // 256
        assert rows.shape == (3, row_bytes(Q6_K_A, k)) and rows.shape[1] % 16 == 0
        assert rows.shape[1] - nsb * 210 < 16 and not rows[:, nsb * 210:].any()
        sb = blocks.reshape(3, nsb, 210)
        assert torch.equal(rows[:, 208:416] if nsb > 1 else rows[:, :208],
                           sb[:, 1 if nsb > 1 else 0, :208])
        assert torch.equal(rows[:, nsb * 208:nsb * 208 + 2], sb[:, 0, 208:])
        assert torch.equal(unpack_q6k(rows, k), blocks)
    x = torch.randn(2, k)
    assert torch.equal(qint_reference(x, rows, Q6_K_A, (3, k)),
                       qint_reference(x, blocks, int(T.Q6_K), (3, k)))


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def check(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: T) -> None:
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype).astype(np.float64))
    xq = dequantized_x_reference(x)
    ref, bound = xq @ w.T, xq.abs() @ w.abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all(), "output not fully written"
    err = (y.double() - ref).abs()
    assert (err <= 2**-16 * bound + 1e-30).all(), float((err / bound).max())
    # and the product stays that of x itself within the 8-bit quantization's error
    plain = x.double() @ w.T
    assert ((y.double() - plain).abs() <= 2**-5 * (x.double().abs() @ w.abs().T)).all()


def test_quantize_x_definition(rng):
    """q = round(x * 127 / max|x|) per 256 columns (ties may go either way: the float32
    fma decides), |q| <= 127 with 127 at the maximum, zero blocks give q = dx = 0."""
    x = torch.from_numpy(rng.standard_normal((3, 768), dtype=np.float32))
    x[1, 256:512] = 0.0
    q, dx = quantize_x_reference(x)
    xb = x.double().reshape(3, 3, 256)
    a = xb.abs().amax(-1)
    exact = xb * (127.0 / a.clamp_min(1e-30))[..., None]
    assert ((q.double().reshape(3, 3, 256) - exact).abs() <= 0.5 + 1e-6).all()
    assert (q.abs().reshape(3, 3, 256).amax(-1)[a > 0] == 127).all()
    assert (q.reshape(3, 3, 256)[1, 1] == 0).all() and dx[1, 1] == 0
    assert torch.allclose(dx.double(), a / 127.0, rtol=2**-23, atol=0)


def test_empty_quant_x_buffers_are_fresh():
    """Every call its own buffers: the norm, activation and quantize_x launches of one
    shape write into them while earlier results (and graph captures' pools) still hold
    theirs."""
    a, b = (empty_quant_x(2, 512, torch.device("cpu")) for _ in range(2))
    for ta, tb in zip(a, b, strict=True):
        assert ta.untyped_storage().data_ptr() != tb.untyped_storage().data_ptr()
    assert [tuple(t.shape) for t in a] == [(2, 512), (2, 2), (2, 32)]


def test_quantize_kernel_bits(interp, rng):
    """The kernel's q, dx are the reference's bits; the 16-column sums are q's."""
    x = torch.from_numpy(rng.standard_normal((3, 512 + 16), dtype=np.float32))[:, :512]
    x[2, :256] = 0.0
    x[1, 7] = 1e-30  # tiny values round to 0
    for xx in (x, x.to(torch.bfloat16)):
        q, dx, bs = interp.call("kernels.qint:quantize_x", xx)
        q_ref, dx_ref = quantize_x_reference(xx)
        assert q.dtype == torch.int8 and torch.equal(q.int(), q_ref)
        assert torch.equal(dx, dx_ref)
        assert bs.dtype == sums_dtype(3) == torch.float16
        assert torch.equal(bs.int(), q_ref.reshape(3, 32, 16).sum(-1).int())
        # up to INT_SUMS_M rows in int32
        q, dx, bs = interp.call("kernels.qint:quantize_x", xx[:INT_SUMS_M])
        assert bs.dtype == sums_dtype(INT_SUMS_M) == torch.int32
        assert torch.equal(bs, q_ref[:INT_SUMS_M].reshape(INT_SUMS_M, 32, 16).sum(-1).int())
    # past INT_SUMS_M rows in float16 (exact: |sum| <= 16 * 127 = 2032 < 2^11)
    x = torch.full((GEMV_MAX_M + 1, 256), -50.0)  # each row's largest: codes -127
    x[:, 16:] = torch.from_numpy(rng.standard_normal((GEMV_MAX_M + 1, 240), dtype=np.float32))
    q, dx, bs = interp.call("kernels.qint:quantize_x", x)
    assert bs.dtype == sums_dtype(GEMV_MAX_M + 1) == torch.float16
    assert (bs[:, 0] == -2032).all()
    assert torch.equal(bs.int(), quantize_x_reference(x)[0].reshape(-1, 16, 16).sum(-1).int())


@pytest.mark.parametrize("m", [2, 6])
def test_prequantized_x_gives_the_same_bits(interp, rng, m):
    """qint_triton with x quantized beforehand (as a fused producer hands it over) is the
    product of x itself, bit for bit, on both kernels; a mismatched QuantX is refused."""
    n, k = 24, 512
    blocks = random_weight(T.Q4_K, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    xq = interp.call("kernels.qint:quantize_x", x)
    plain = interp.call(KERNEL, x, blocks, int(T.Q4_K), (n, k), QIntConfig(16, 1))
    given = interp.call(KERNEL, torch.empty(m, k), blocks, int(T.Q4_K), (n, k),
                        QIntConfig(16, 1), xq=xq)
    assert torch.equal(plain, given)
    with pytest.raises(InvalidRequest, match="xq"):
        interp.call(KERNEL, x[:1], blocks, int(T.Q4_K), (n, k), xq=xq)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k,cfg", [(1, 40, 512, QIntConfig(16, 1)),
                                       (3, 33, 1024, QIntConfig(16, 2, max_regs=168)),
                                       (16, 20, 512, QIntConfig(8, 2, 2))], ids=str)
def test_kernel_matches_gguf(interp, rng, qtype, m, n, k, cfg):
    """N not a multiple of the tile, splits summed by the second kernel, bf16 x with a
    row stride > in, a zero super-block in x (dx = 0)."""
    blocks = random_weight(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k + 32), dtype=np.float32))[:, :k]
    if m > 1:
        x = x.to(torch.bfloat16)
        x[1, 256:512] = 0
    y = interp.call(KERNEL, x, *stored(blocks, qtype, k), (n, k), cfg)
    check(y, x.float(), blocks, qtype)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_independent_of_batch_and_path(interp, rng, qtype):
    """A row's bits are the same alone and among 2 rows (the CUDA-core kernel, any tile
    height), among 5 (the matrix-unit kernel for Q4_K, the CUDA-core one with 8-row tiles
    for Q6_K) and 40 (the matrix-unit kernel: two M tiles, the second partial), at the
    same split: the super-block sums are exact integers and the float fmas run in K order
    on both paths."""
    n, k = 72, 1024
    blocks = random_weight(qtype, n, k, rng)
    held = stored(blocks, qtype, k)
    x = torch.from_numpy(rng.standard_normal((40, k), dtype=np.float32))
    alone = interp.call(KERNEL, x[4:5], *held, (n, k), QIntConfig(16, 2))
    two = interp.call(KERNEL, x[3:5], *held, (n, k), QIntConfig(64, 2, 2))
    five = interp.call(KERNEL, x[:5], *held, (n, k), QIntConfig(8, 2))
    many = interp.call(KERNEL, x, *held, (n, k), QIntConfig(32, 2))
    # the matrix-unit kernel with the splits as programs of their own (partials, summed
    # by the last program of a tile) instead of in one program
    spread = interp.call(KERNEL, x, *held, (n, k), QIntConfig(32, 2), num_sms=10**6)
    assert torch.equal(alone[0], two[1]) and torch.equal(alone[0], five[4])
    assert torch.equal(alone[0], many[4]) and torch.equal(many, spread)
    # x's loads in the loop instead of first (QIntConfig.x_early; Q4_K ignores it)
    late = interp.call(KERNEL, x[4:5], *held, (n, k), QIntConfig(16, 2, x_early=False))
    assert torch.equal(alone, late)
    check(many, x, blocks, qtype)
    check(five, x[:5], blocks, qtype)
    # the split partials were summed by the last program of each tile, counters re-armed
    assert not interp.call("kernels.qgemv:_tickets", torch.device("cpu")).any()


def test_two_parts_in_one_launch(interp, rng):
    """qint_parts: q|k-like Q4_K rows and v-like Q6_K rows. Up to 4 rows of x one launch
    when the first part fills whole programs (else one per part); 6 rows one launch per
    part (Q4_K on the matrix unit, Q6_K still on the CUDA cores); 12 rows one matrix-unit
    launch again (the first part fills whole 64-row tiles). The split is the whole
    weight's, so a row's bits are the same every way, each part within 2^-16 of its
    definition."""
    k, n1, n2 = 1024, 64, 24
    b1, g2 = random_weight(T.Q4_K, n1, k, rng), random_weight(T.Q6_K, n2, k, rng)
    b2 = repack_q6k(g2, k)
    parts = [(b1, int(T.Q4_K), n1), (b2, Q6_K_A, n2)]
    x = torch.from_numpy(rng.standard_normal((12, k), dtype=np.float32))
    cfg = QIntConfig(16, 2)
    fused = interp.call("kernels.qint:qint_parts", x[:2], parts, k, cfg)
    apart = interp.call("kernels.qint:qint_parts", x[:2], parts, k,
                        QIntConfig(128, 2))  # 64 % 128: one launch a part
    many = interp.call("kernels.qint:qint_parts", x[:6], parts, k, cfg)
    tiled = interp.call("kernels.qint:qint_parts", x, parts, k, cfg)
    one = torch.cat([interp.call("kernels.qint:qint_triton", x, b, t, (n, k), cfg)
                     for b, t, n in parts], dim=1)
    assert fused.shape == (2, n1 + n2) and torch.equal(fused, apart)
    assert torch.equal(fused, many[:2]) and torch.equal(many, tiled[:6])
    assert tiled.shape == (12, n1 + n2) and torch.equal(tiled, one)
    check(tiled[:, :n1], x, b1, T.Q4_K)
    check(tiled[:, n1:], x, g2, T.Q6_K)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_splits_in_one_program_give_the_same_bits(interp, rng, qtype):
    """QIntConfig.in_cta (a program takes every split of its rows and adds the partials
    itself) gives the bits of the splits as programs of their own, at 1-4 rows of x, N
    not a multiple of the tile, 2-8 splits; and for the fused q|k + v launch."""
    from kernels.qint import in_cta_config

    n, k = 75, 2048
    blocks = random_weight(qtype, n, k, rng)
    held = stored(blocks, qtype, k)
    x = torch.from_numpy(rng.standard_normal((4, k), dtype=np.float32))
    for split, m in ((2, 1), (4, 3), (8, 2), (8, 4)):  # 8, 4, 2 and 2 weight rows a tile
        cfg = QIntConfig(16, split, 2)
        one = in_cta_config(cfg)
        assert one.in_cta and one.split == split and one.block_n * split >= 16
        want = interp.call(KERNEL, x[:m], *held, (n, k), cfg)
        got = interp.call(KERNEL, x[:m], *held, (n, k), one)
        assert torch.equal(got, want), (split, m)
        check(got, x[:m], blocks, qtype)
    b1, g2 = random_weight(T.Q4_K, 64, k, rng), random_weight(T.Q6_K, 24, k, rng)
    parts = [(b1, int(T.Q4_K), 64), (repack_q6k(g2, k), Q6_K_A, 24)]
    cfg = QIntConfig(16, 4, 2)
    want = interp.call("kernels.qint:qint_parts", x[:1], parts, k, cfg)
    got = interp.call("kernels.qint:qint_parts", x[:1], parts, k, in_cta_config(cfg))
    assert torch.equal(got, want)
    check(got[:, 64:], x[:1], g2, T.Q6_K)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_nvidia_branch_gives_the_same_bits(interp, rng, qtype):
    """The one-row product's PTX branch (dp4a chains through their accumulators, Q4_K's high
    nibbles multiplied in place and the sum divided by 16), its dp4a's evaluated with numpy
    (tests/kernels/ptx_emulation.py), gives the portable branch's bits: splits as programs
    and in one program, 1-3 rows of x."""
    from kernels.qint import in_cta_config

    n, k = 75, 1024
    blocks = random_weight(qtype, n, k, rng)
    held = stored(blocks, qtype, k)
    x = torch.from_numpy(rng.standard_normal((3, k), dtype=np.float32))
    for cfg, m in ((QIntConfig(16, 2, 2), 1), (QIntConfig(32, 1, 4), 3),
                   (in_cta_config(QIntConfig(16, 4, 2)), 1)):
        want = interp.call(KERNEL, x[:m], *held, (n, k), cfg)
        got = interp.call("tests.kernels.ptx_emulation:qint_with_ptx", x[:m], *held, (n, k),
                          cfg)
        assert torch.equal(got, want), (cfg, m)
        check(got, x[:m], blocks, qtype)


def parts_with_tile(tile: tuple, *args, **kwargs) -> torch.Tensor:
    """qint_parts with every matrix-unit launch at `tile` (called in the interpreter's worker)."""
    from kernels.qint import qint_parts
    from kernels.qint_mm import forced_tile, tiled_tile

    with forced_tile(tile):
        assert tiled_tile(args[0].shape[0], "cuda", Q6_K_A) == tile
        return qint_parts(*args, **kwargs)


def test_every_candidate_tile_gives_the_same_bits(interp, rng):
    """The load-time tuner (engine/tile_tune.py) may take any tile of TILE_CANDIDATES: each
    gives the default tile's bits, for both types and the fused q|k + v launch, at rows
    that leave the last tile partly filled."""
    from kernels.qint_mm import TILE_CANDIDATES

    k, n1, n2 = 512, 128, 40
    b1, g2 = random_weight(T.Q4_K, n1, k, rng), random_weight(T.Q6_K, n2, k, rng)
    parts = [(b1, int(T.Q4_K), n1), (repack_q6k(g2, k), Q6_K_A, n2)]
    x = torch.from_numpy(rng.standard_normal((40, k), dtype=np.float32))
    cfg = QIntConfig(16, 2)
    tiles = dict.fromkeys(t for by_bound in TILE_CANDIDATES.values()
                          for ts in by_bound.values() for t in ts)
    for m in (12, 40):
        want = interp.call("kernels.qint:qint_parts", x[:m], parts, k, cfg)
        check(want[:, :n1], x[:m], b1, T.Q4_K)
        check(want[:, n1:], x[:m], g2, T.Q6_K)
        for tile in tiles:
            got = interp.call("test_qint:parts_with_tile", tile, x[:m], parts, k, cfg)
            assert torch.equal(got, want), (m, tile)


def test_rejects_bad_input(interp, rng):
    blocks = random_weight(T.Q4_K, 8, 256, rng)
    with pytest.raises(InvalidRequest, match="no kernel"):
        interp.call(KERNEL, torch.zeros(1, 256), blocks, int(T.Q8_0), (8, 256))
    with pytest.raises(InvalidRequest, match="repack_q6k"):
        interp.call(KERNEL, torch.zeros(1, 256), random_weight(T.Q6_K, 8, 256, rng),
                    int(T.Q6_K), (8, 256))
    with pytest.raises(InvalidRequest, match="multiple of 256"):
        interp.call(KERNEL, torch.zeros(1, 128), blocks, int(T.Q4_K), (8, 128))
    with pytest.raises(InvalidRequest, match="blocks"):
        interp.call(KERNEL, torch.zeros(1, 256), blocks[:4], int(T.Q4_K), (8, 256))
    with pytest.raises(InvalidRequest, match="divide"):
        interp.call(KERNEL, torch.zeros(1, 256), blocks, int(T.Q4_K), (8, 256), QIntConfig(16, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gpu_kernels_at_llama_shapes(rng, qtype):
    """On the GPU (dp4a up to gemv_max_m rows, the matrix unit beyond: each of its tiles,
    partly filled ones too), at Llama-3.1-8B's shapes: within 2^-16 of the definition,
    and row 0's bits the same at every M."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    for n, k in ((4096, 4096), (1024, 14336)):
        blocks = random_weight(qtype, n, k, rng)
        x = torch.from_numpy(rng.standard_normal((64, k), dtype=np.float32))
        held, kind = stored(blocks.cuda(), qtype, k)
        ys = {m: interp_free(x[:m].cuda(), held, kind, n, k).cpu()
              for m in (1, 2, 3, 9, 16, 32, 33, 64)}
        for y in ys.values():
            check(y, x[:y.shape[0]], blocks, qtype)
        assert all(torch.equal(ys[1][0], y[0]) for y in ys.values())


@pytest.mark.gpu
def test_gpu_every_candidate_tile_gives_the_same_bits(rng):
    """On the GPU, whose builds take the PTX paths the interpreter never runs (packed code
    words) and whose launches split K by the device's compute units: every tile of the
    device's TILE_CANDIDATES gives the default tile's bits, each type alone and the fused
    q|k + v launch, at rows that leave the last tile partly filled; the default within
    2^-16 of the definition."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    from kernels.qint import qint_parts
    from kernels.qint_mm import TILE_CANDIDATES, forced_tile

    backend = "hip" if torch.version.hip else "cuda"
    k, n1, n2 = 4096, 1024, 512
    b1, g2 = random_weight(T.Q4_K, n1, k, rng), random_weight(T.Q6_K, n2, k, rng)
    parts = [(b1.cuda(), int(T.Q4_K), n1), (repack_q6k(g2, k).cuda(), Q6_K_A, n2)]
    x = torch.from_numpy(rng.standard_normal((72, k), dtype=np.float32))
    tiles = dict.fromkeys(t for ts in TILE_CANDIDATES[backend].values() for t in ts)
    for m in (9, 16, 40, 72):
        xm = x[:m].cuda()
        want = [qint_parts(xm, parts, k).cpu(), qint_parts(xm, parts[:1], k).cpu(),
                qint_parts(xm, parts[1:], k).cpu()]
        check(want[1], x[:m], b1, T.Q4_K)
        check(want[2], x[:m], g2, T.Q6_K)
        for tile in tiles:
            with forced_tile(tile):
                got = [qint_parts(xm, parts, k).cpu(), qint_parts(xm, parts[:1], k).cpu(),
                       qint_parts(xm, parts[1:], k).cpu()]
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (m, tile)


def interp_free(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int):
    from kernels.qint import qint_triton

    return qint_triton(x, blocks, qtype, (n, k))


def test_default_config_rows_a_program_leave_the_split_alone():
    """From WIDE_N rows a program takes 128 rows on CUDA (Q4_K with up to 2 rows of x: 64
    on 2 warps at any N, capped in registers at one row alone); the split (a row's bits)
    counts 64-row tiles whatever the rows of x: while fewer than 4 programs a compute
    unit, up to 8, dividing the super-blocks evenly; Q4_K at one row takes a tile's
    splits in one program (in_cta_config). Q6_K's wide programs load x early
    at one row only where they fill Q6K_EARLY_WAVES waves of 3 a compute unit, and there
    take Q6K_HEAD_BLOCK_N rows."""
    sms = 132
    want = {1024: (64, 8), 4096: (64, 8), WIDE_N - 1: (64, 8), WIDE_N: (128, 8), 14336: (128, 4),
            28672: (128, 2), 128256: (128, 1)}
    for n, (block_n, split) in want.items():
        early = block_n == 64 or -(-n // 128) * split >= Q6K_EARLY_WAVES * 3 * sms
        assert early == (n in (1024, 4096, WIDE_N - 1, 128256)), n  # the head: early
        head = early and block_n == 128  # the output head's shape: fewer rows a program
        assert default_qint_config(Q6_K_A, n, 4096, sms) == QIntConfig(
            Q6K_HEAD_BLOCK_N if head else block_n, split, x_early=early), n
        for m in (3, 8):
            assert default_qint_config(Q6_K_A, n, 4096, sms, m=m) == QIntConfig(block_n, split)
        # one row: a tile's splits in one program of the same 64 rows a split
        assert default_qint_config(T.Q4_K, n, 4096, sms) == QIntConfig(
            64 // split, split, 2, None, Q4K_ONE_ROW_REGS, in_cta=split > 1), n
        assert default_qint_config(T.Q4_K, n, 4096, sms, qtype2=Q6_K_A) == QIntConfig(
            64 // split, split, 2, in_cta=split > 1), n  # two types: capped, it spills
        one_row = default_qint_config(T.Q4_K, n, 4096, sms)
        if split > 1:  # qint_bench --other-way: the splits as programs of their own, and back
            assert other_way(one_row) == QIntConfig(64, split, 2, None, Q4K_ONE_ROW_REGS), n
            assert other_way(other_way(one_row)) == one_row, n
        assert default_qint_config(T.Q4_K, n, 4096, sms, m=2) == QIntConfig(64, split, 2), n
        assert default_qint_config(T.Q4_K, n, 4096, sms, m=3) == QIntConfig(block_n, split), n
        hip = default_qint_config(T.Q4_K, n, 4096, sms, backend="hip")
        assert hip.split == split and hip.block_n < 64, n
    assert default_qint_config(T.Q4_K, 4096, 14336, sms).split == 8  # 56 super-blocks
    assert default_qint_config(T.Q4_K, 4096, 4096).split == 1  # no compute units given


def test_q6k_stays_on_the_cuda_cores_up_to_8_rows(monkeypatch):
    """Which kernel each part runs, by rows: Q4_K up to GEMV_MAX_M on the CUDA cores,
    Q6_K up to 8; two parts share a launch up to GEMV_MAX_M and past 8 rows where the
    first fills whole tiles of the matrix-unit kernel."""
    import kernels.qint as qint
    import kernels.quant_x as quant_x

    launches = []
    monkeypatch.setattr(qint, "_launch", lambda xq, parts, m, k, cfg, sms, backend, gemv:
                        launches.append((tuple(p[1] for p in parts), gemv))
                        or torch.zeros(m, sum(p[2] for p in parts)))
    assert gemv_max_m(int(T.Q4_K)) == GEMV_MAX_M == 4 and gemv_max_m(Q6_K_A) == 8
    k = 256
    parts = [(torch.zeros(64, row_bytes(int(T.Q4_K), k), dtype=torch.uint8), int(T.Q4_K), 64),
             (torch.zeros(32, row_bytes(Q6_K_A, k), dtype=torch.uint8), Q6_K_A, 32)]
    for m, want in ((4, [((12, Q6_K_A), True)]),
                    (5, [((12,), False), ((Q6_K_A,), True)]),
                    (8, [((12,), False), ((Q6_K_A,), True)]),
                    (9, [((12, Q6_K_A), False)]),  # 64 rows fill the 16-row tile's 64
                    (17, [((12,), False), ((Q6_K_A,), False)])):  # the 32-row tile's 128
        launches.clear()
        qint.qint_parts(torch.zeros(m, k), parts, k, QIntConfig(64, 1),
                        xq=quant_x.empty_quant_x(m, k, torch.device("cpu")))
        assert launches == want, m
