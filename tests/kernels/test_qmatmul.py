"""qmatmul's Triton kernels (skinny and tiled, interpreted on the CPU) against gguf-py's
dequantize @ x in float64, on fresh random GGUF blocks of every supported type; outputs
and split partials start as NaN (kernel_worker.py), so an element left unwritten fails.

Bound per element: the kernel rounds each weight and each x to bf16 (relative 2^-9 each)
and accumulates in f32, so |y - ref| <= 2^-8 (|W| @ |x|) up to f32 noise; 2^-7 is asserted.
A wrong nibble, scale or column order is off by about the size of the term itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine.errors import InvalidRequest, UnsupportedTensorType
from kernels.qgemv import MMA_SYNC_TYPES, k_plan, x_left
from kernels.qmatmul import (
    _LUTS,
    SUPPORTED_TYPES,
    QMMConfig,
    default_config,
    qmatmul,
    qmatmul_triton,
)
from kernels.qtiles import GEOMETRY

TYPES = sorted(T(t) for t in SUPPORTED_TYPES)
# Byte offsets of each type's f16 fields (block_* structs in ggml-common.h).
F16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
              T.Q6_K: (208,), T.IQ4_XS: (0,), T.MXFP4: ()}
KERNEL = "kernels.qmatmul:qmatmul_triton"
SKINNY = "kernels.qgemv:qgemv_triton"  # (x, blocks, type, n, code book, config, ticket=)
TILED = "kernels.qmatmul:qmatmul_tiled"  # (x, blocks, type, n, code book, config, num_sms)
LUT = {T(t): torch.tensor(v, dtype=torch.float32) for t, v in _LUTS.items()}


def random_weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, k / block * bytes) uint8 blocks: random bytes with finite random f16 scales
    (BF16: standard normal values)."""
    if qtype == T.BF16:
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        return w.to(torch.bfloat16).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset:offset + 2] = rng.standard_normal((len(raw), 1)).astype(
            np.float16).view(np.uint8)
    if qtype == T.MXFP4:  # e8m0 exponents around 2^0, and the two subnormal codes
        raw[:, 0] = rng.integers(110, 140, len(raw))
        raw[:2, 0] = (0, 1)
    return torch.from_numpy(raw.reshape(n, -1))


def check(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: T) -> None:
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype).astype(np.float64))
    ref = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.isfinite(y).all(), "output not fully written"
    err = (y.double() - ref).abs()
    assert (err <= 2**-7 * bound + 1e-30).all(), float((err / bound).max())


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh inputs every run; the seed is printed (shown when a test fails)."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def randn(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


CASES = [(1, 96, 512), (3, 40, 256), (16, 96, 512), (17, 96, 256)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", CASES, ids=lambda v: str(v))
def test_kernel_matches_gguf(interp, rng, qtype, m, n, k):
    """The default config: the skinny kernel up to 16 rows, the tiled one beyond; N is
    never a multiple of the 64-row tile in two of the cases."""
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, m, k)
    cfg = default_config(qtype, m, n, k)
    # x is the left operand on both paths for X_LEFT types: 64 rows for wgmma on sm_90,
    # 16 for mma.sync (MMA_SYNC_TYPES)
    wgmma_left = x_left(qtype) and int(qtype) not in MMA_SYNC_TYPES
    assert cfg.block_m == (64 if m > 16 or wgmma_left else 16)
    check(interp.call(KERNEL, x, blocks, int(qtype), (n, k), cfg), x, blocks, qtype)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
def test_configs_split_k_and_bf16_x(interp, rng, qtype):
    """Other tile sizes, split-K (ticket sum and second-kernel sum), bf16 x with a row
    stride > in, on both paths."""
    n, k = 40, 1024
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, 5, k + 64).to(torch.bfloat16)[:, :k]  # strided rows
    step = 128 if qtype == T.Q6_K else 64
    for cfg in (QMMConfig(16, 16, step, 4), QMMConfig(16, 128, 256, 2, 8),
                QMMConfig(64, 64, 2 * step, 2, 8)):
        check(interp.call(KERNEL, x, blocks, int(qtype), (n, k), cfg), x.float(), blocks, qtype)
    lut = LUT.get(qtype, torch.zeros(1))
    y = interp.call(SKINNY, x, blocks, int(qtype), n, lut, QMMConfig(16, 32, step, 4), ticket=False)
    check(y, x.float(), blocks, qtype)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
def test_batch_invariance(interp, rng, qtype):
    """A row's result is bit-equal alone, in skinny batches of 3 and 16 rows (other tile
    shapes and warps, as the per-M table may pick), with the split partials summed by
    ticket or by the second kernel, and in tiled batches (splits summed in one program or
    as partials): only block_k and split_k reach a row's bits, and they depend on
    (type, N, K) alone."""
    n, k = 72, 1024
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, 33, k)
    plan = k_plan(int(qtype), n, k, "cuda", 0)
    assert all(default_config(qtype, m, n, k)[2:4] == plan for m in (1, 3, 16, 17, 33, 512))
    block_k, split = 256, 4  # as tuned plans may set them
    alone = interp.call(KERNEL, x[5:6], blocks, int(qtype), (n, k),
                        QMMConfig(16, 64, block_k, split, 4))
    three = interp.call(KERNEL, x[3:6], blocks, int(qtype), (n, k),
                        QMMConfig(16, 128, block_k, split, 8))
    sixteen = interp.call(SKINNY, x[:16], blocks, int(qtype), n, LUT.get(qtype, torch.zeros(1)),
                          QMMConfig(16, 32, block_k, split, 2), ticket=False)
    tiled = interp.call(KERNEL, x, blocks, int(qtype), (n, k), QMMConfig(64, 64, block_k, split))
    # The tiled kernel with the splits as programs of their own (partials, then the sum).
    spread = interp.call(TILED, x, blocks, int(qtype), n, LUT.get(qtype, torch.zeros(1)),
                         QMMConfig(32, 64, block_k, split), 10**6)
    assert torch.equal(alone[0], three[2]) and torch.equal(alone[0], sixteen[5])
    assert torch.equal(alone[0], tiled[5]) and torch.equal(alone[0], spread[5])
    check(tiled, x, blocks, qtype)
    # The ticket counters are left at zero for the next launch.
    assert not interp.call("kernels.qgemv:_tickets", torch.device("cpu")).any()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.MXFP4], ids=lambda t: t.name)
def test_kernel_without_matrix_unit(interp, rng, qtype):
    """The experimental decode kernel without the matrix unit: 1 and 3 rows, K split with
    the ticket sum, N not a multiple of the tile."""
    n, k = 40, 1024
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, 3, k)
    lut = LUT.get(qtype, torch.zeros(1))
    for m, cfg in ((1, QMMConfig(1, 16, 256, 4, 4)), (3, QMMConfig(4, 32, 512, 2, 2))):
        y = interp.call(SKINNY, x[:m], blocks, int(qtype), n, lut, cfg, fma=True)
        check(y, x[:m], blocks, qtype)


def test_default_configs_keep_one_instruction_family():
    """On sm_90 every launched config has block_n a multiple of 64 and 4 or 8 warps (wgmma on
    both paths), or for MMA_SYNC_TYPES fewer than 4 warps on the tiled path and 16 rows
    of x on the skinny one (mma.sync on both); block_k and split_k are the same for every
    M and fit K."""
    for qtype in TYPES:
        step = GEOMETRY[int(qtype)][2]
        for n, k in ((4096, 4096), (1024, 4096), (128256, 4096), (4096, 14336), (40, 96 * step)):
            for backend, sms in (("cuda", 132), ("hip", 40), ("cuda", 0)):
                cfgs = [default_config(qtype, m, n, k, backend=backend, num_sms=sms)
                        for m in (1, 2, 4, 8, 16, 17, 64, 4096)]
                assert len({c[2:4] for c in cfgs}) == 1
                block_k, split = cfgs[0][2:4]
                assert block_k % step == 0 and k % (block_k * split) == 0
                if backend == "cuda" and int(qtype) in MMA_SYNC_TYPES:
                    assert all(c.num_warps < 4 if m > 16 else c.block_m == 16
                               for m, c in zip((1, 2, 4, 8, 16, 17, 64, 4096), cfgs,
                                               strict=True))
                elif backend == "cuda":
                    assert all(c.block_n % 64 == 0 and c.num_warps in (4, 8) for c in cfgs)


def test_checks_inputs():
    blocks = torch.zeros(32, 8 * 34, dtype=torch.uint8)
    x = torch.randn(2, 256)
    with pytest.raises(UnsupportedTensorType):
        qmatmul(x, blocks, int(T.Q2_K), (32, 256))
    with pytest.raises(InvalidRequest):
        qmatmul(x[:, :128], blocks, int(T.Q8_0), (32, 256))  # in mismatch
    with pytest.raises(InvalidRequest):
        qmatmul(x, blocks[:, :-1], int(T.Q8_0), (32, 256))  # wrong byte count
    with pytest.raises(InvalidRequest):
        qmatmul(x.double(), blocks, int(T.Q8_0), (32, 256))
    with pytest.raises(InvalidRequest):
        qmatmul(x.t().contiguous().t(), blocks, int(T.Q8_0), (32, 256))  # column-major x
    q6 = torch.zeros(32, 210, dtype=torch.uint8)
    with pytest.raises(InvalidRequest):  # Q6_K tiles are multiples of 128 columns
        qmatmul_triton(x, q6, int(T.Q6_K), (32, 256), QMMConfig(16, 64, 64, 1))
    with pytest.raises(InvalidRequest):  # the skinny kernel covers all rows in one block_m
        qmatmul_triton(torch.randn(12, 256), q6, int(T.Q6_K), (32, 256),
                       QMMConfig(8, 64, 128, 1))
    unaligned = torch.zeros(32 * 210 + 2, dtype=torch.uint8)[2:].view(32, 210)
    with pytest.raises(InvalidRequest):  # fields are read as aligned words
        qmatmul_triton(x, unaligned, int(T.Q6_K), (32, 256))


def test_cpu_path_is_the_reference(rng):
    """Without the interpreter the public entry point runs the torch reference."""
    blocks = random_weight(T.Q4_K, 32, 256, rng)
    x = randn(rng, 3, 256)
    check(qmatmul(x, blocks, int(T.Q4_K), (32, 256)), x, blocks, T.Q4_K)


def test_kernels_do_not_compile_again_for_each_row_count():
    """A new row count must not build a new variant of either qmatmul kernel (Triton
    specializes integer arguments divisible by 16): that compile would stall a step."""
    from kernels import qgemv, qmatmul
    from kernels.triton_util import compiled

    for kernel in (qgemv._qgemv_kernel, qmatmul._qmm_kernel):
        jit_fn = compiled(kernel)
        names = jit_fn.arg_names
        unspecialized = {names[i] if isinstance(i, int) else i for i in jit_fn.do_not_specialize}
        assert "M" in unspecialized, kernel


def exact_error(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: T) -> float:
    """max |y - x_bf16 @ W| / (|x_bf16| @ |W|), in float64: W dequantized by gguf-py, x
    rounded to bf16 as the kernels round it."""
    w = torch.from_numpy(gguf_dequantize(blocks.cpu().numpy(), qtype).astype(np.float64))
    xb = x.cpu().bfloat16().double()
    return float(((y.cpu().double() - xb @ w.T).abs() / (xb.abs() @ w.abs().T)).max())


@pytest.mark.parametrize("m", [1, 17], ids=lambda v: f"m{v}")
def test_q4_k_codes_reach_the_matrix_unit_exactly(interp, rng, m):
    """Q4_K's scaled step (kernels/qscaled.py) multiplies the exact codes and applies the
    float32 scales on the accumulator: within float32 rounding of gguf-py's product, where
    a weight rounded to bf16 first is 2^-9 off."""
    n, k = 40, 512
    blocks = random_weight(T.Q4_K, n, k, rng)
    # bf16 x: the interpreter rounds float32 to bf16 by truncation (the GPU to nearest)
    x = randn(rng, m, k).bfloat16()
    y = interp.call(KERNEL, x, blocks, int(T.Q4_K), (n, k), default_config(T.Q4_K, m, n, k))
    assert exact_error(y, x, blocks, T.Q4_K) < 2**-16


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_gpu_kernels_at_llama_shapes(rng, qtype):
    """On the GPU, at Llama-3.1-8B's shapes and 1, 16 and 64 rows: close to gguf-py's
    product (Q4_K through its PTX code decoding within float32 rounding), and row 0's bits
    the same at every M."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    n, k = 4096, 4096
    blocks = random_weight(qtype, n, k, rng).cuda()
    x = randn(rng, 64, k).cuda()
    ys = {m: qmatmul(x[:m], blocks, int(qtype), (n, k)) for m in (1, 16, 64)}
    bound = 2**-16 if qtype == T.Q4_K else 2**-7
    for y in ys.values():
        assert exact_error(y, x[:y.shape[0]], blocks, qtype) < bound
    assert torch.equal(ys[1][0], ys[16][0]) and torch.equal(ys[1][0], ys[64][0])
