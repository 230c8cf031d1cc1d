"""qmatmul's Triton kernel (interpreted on the CPU) against gguf-py's dequantize @ x in
float64, on fresh random GGUF blocks of every supported type.

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
from kernels.qmatmul import SUPPORTED_TYPES, QMMConfig, default_config, qmatmul, qmatmul_triton

TYPES = sorted(T(t) for t in SUPPORTED_TYPES)
# Byte offsets of each type's f16 fields (block_* structs in ggml-common.h).
F16_FIELDS = {T.Q4_0: (0,), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
              T.Q6_K: (208,), T.IQ4_XS: (0,), T.MXFP4: ()}
KERNEL = "kernels.qmatmul:qmatmul_triton"


def random_weight(qtype: T, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, k / block * bytes) uint8 blocks: random bytes with finite random f16 scales."""
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


CASES = [(1, 96, 512), (3, 32, 256), (17, 96, 256)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", CASES, ids=lambda v: str(v))
def test_kernel_matches_gguf(interp, rng, qtype, m, n, k):
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, m, k)
    cfg = default_config(qtype, m, n, k)
    check(interp.call(KERNEL, x, blocks, int(qtype), (n, k), cfg), x, blocks, qtype)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_configs_split_k_and_bf16_x(interp, rng, qtype):
    """Other tile sizes, split-K with its ordered sum, bf16 x with a row stride > in."""
    n, k = 40, 512
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, 5, k + 64).to(torch.bfloat16)[:, :k]  # strided rows
    step = 128 if qtype == T.Q6_K else 64
    for cfg in (QMMConfig(16, 16, step, 2), QMMConfig(64, 64, min(2 * step, 128), 2, 8)):
        check(interp.call(KERNEL, x, blocks, int(qtype), (n, k), cfg), x.float(), blocks, qtype)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_batch_invariance(interp, rng, qtype):
    """A row's result is bit-equal alone, in a skinny batch and in a tiled batch: every
    config field but block_m depends on (type, N, K) only."""
    n, k = 32, 512
    blocks = random_weight(qtype, n, k, rng)
    x = randn(rng, 33, k)
    split = 2
    configs = {m: default_config(qtype, m, n, k)._replace(split_k=split) for m in (1, 3, 33)}
    assert configs[1].block_m == 16 and configs[33].block_m == 64
    assert configs[1]._replace(block_m=64) == configs[33]
    alone = interp.call(KERNEL, x[5:6], blocks, int(qtype), (n, k), configs[1])
    skinny = interp.call(KERNEL, x[3:6], blocks, int(qtype), (n, k), configs[3])
    tiled = interp.call(KERNEL, x, blocks, int(qtype), (n, k), configs[33])
    assert torch.equal(alone[0], skinny[2]) and torch.equal(alone[0], tiled[5])
    check(tiled, x, blocks, qtype)


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
    with pytest.raises(InvalidRequest):  # Q6_K tiles are 128 columns wide
        qmatmul_triton(x, q6, int(T.Q6_K), (32, 256), QMMConfig(16, 32, 256, 1))


def test_cpu_path_is_the_reference(rng):
    """Without the interpreter the public entry point runs the torch reference."""
    blocks = random_weight(T.Q4_K, 32, 256, rng)
    x = randn(rng, 3, 256)
    check(qmatmul(x, blocks, int(T.Q4_K), (32, 256)), x, blocks, T.Q4_K)
