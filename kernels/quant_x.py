"""x quantized to 8 bits per 256 columns: the input of kernels/qint.py's products.

The definition (`quantize_x_reference`): per row and super-block of 256 columns,
a = max |x|, id = 127 / a and dx = a / 127 (float32, correctly rounded; both 0 where
a = 0), q = floor(fma(x, id, 0.5)) in -127 .. 127. With the sums of q over each 16
columns (QuantX.bs) a weight super-block's product with x is an exact integer
(kernels/qint.py's docstring).

The quantization costs accuracy: q carries about 8 bits per element relative to the
block's largest, as llama.cpp's own quantized-activation kernels (q8_1, q8_K).

`quantize_x` is one small kernel; the norm, gated activation and decode attention kernels
write the same bits in their own epilogues (`quantize_store`), sparing that launch before
most products.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    helper,
    launcher,
    release_first,
    tl,
    triton,
)

__all__ = ["INT_SUMS_M", "QK", "QuantX", "dequantized_x_reference", "empty_quant_x",
           "quant_x_reference", "quantize_x", "quantize_x_reference", "sums_dtype"]

QK = 256  # columns per super-block, and per x scale
# x's 16-column sums are int32 up to this many rows (the CUDA-core kernel's only rows on
# every path), float16 beyond (the matrix-unit kernels' dot operand as loaded); both exact
INT_SUMS_M = 2


class QuantX(NamedTuple):
    """x quantized for the product kernels (quantize_x or a fused producer)."""

    q: torch.Tensor  # (M, K) int8
    dx: torch.Tensor  # (M, K / 256) float32
    # (M, K / 16): the sums of q over each 16 columns (exact in both): int32 up to
    # INT_SUMS_M rows (the CUDA-core kernel reads them as they are), float16 beyond (the
    # matrix-unit kernel's dot operand as loaded: no convert through shared memory; the
    # CUDA-core kernel converts them)
    bs: torch.Tensor


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) int32 in -127..127, dx (M, K / 256) float32), the definition
    above in float32 arithmetic (the fma through float64, exact for these operands)."""
    m, k = x.shape
    xb = x.to(torch.float32).reshape(m, k // QK, QK)
    a = xb.abs().amax(-1)
    pos = a > 0
    one = torch.ones_like(a)
    # the float32 quotients correctly rounded on any device: through float64 (53 >= 2 x 24
    # + 2 bits, so rounding twice rounds as once); torch's CUDA division by a scalar
    # multiplies by its reciprocal, 1 ulp off for some a (H200, bench/gpu/norm_bench.py)
    inv = torch.where(pos, (127.0 / torch.where(pos, a, one).double()).float(), 0.0)
    dx = torch.where(pos, (a.double() / 127.0).float(), 0.0)
    # x * inv is exact in float64 (two 24-bit significands); + 0.5 is exact unless the
    # sum is below 1/2 in magnitude, where any rounding keeps floor() the same.
    v = (xb.double() * inv.double()[..., None] + 0.5).to(torch.float32)
    q = torch.floor(v).clamp(-127, 127).to(torch.int32)
    return q.reshape(m, k), dx


def quant_x_reference(x: torch.Tensor) -> QuantX:
    """quantize_x's result by the definition (quantize_x_reference), on any device."""
    q, dx = quantize_x_reference(x)
    return QuantX(q.to(torch.int8), dx,
                  q.reshape(q.shape[0], -1, 16).sum(-1).to(sums_dtype(q.shape[0])))


def dequantized_x_reference(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels multiply it: dx * q of quantize_x_reference, float64 (M, K)."""
    q, dx = quantize_x_reference(x)
    m, k = q.shape
    return (q.double().reshape(m, k // QK, QK) * dx.double()[..., None]).reshape(m, k)



def empty_quant_x(m: int, k: int, device: torch.device) -> QuantX:
    return QuantX(torch.empty(m, k, dtype=torch.int8, device=device),
                  torch.empty(m, k // QK, dtype=torch.float32, device=device),
                  torch.empty(m, k // 16, dtype=sums_dtype(m), device=device))


def sums_dtype(m: int) -> torch.dtype:
    """QuantX.bs's type for m rows of x."""
    return torch.int32 if m <= INT_SUMS_M else torch.float16



def quantize_x(x: torch.Tensor) -> QuantX:
    """x (M, K) -> QuantX by the kernel (quantize_x_reference's bits)."""
    m, k = x.shape
    out = empty_quant_x(m, k, x.device)
    if m:
        release = {"RELEASE_FIRST": True} if release_first("quantize_x") else {}
        launcher(_quantize_x_kernel, x.device)[(m, k // QK)](x, *out, k, x.stride(0),
                                                              num_warps=2, **release)
    return out



if HAS_TRITON:
    @helper
    def quantize_store(x, b, ok, row, q_ptr, dx_ptr, bs_ptr, K):
        """Quantizes super-blocks b (NB,) of row `row` (x (NB, 256) float32, where `ok`)
        into q (M, K) int8, dx (M, K / 256) and the sums of q over each 16 columns
        (M, K / 16) in bs_ptr's type (int32 or float16: exact, at most 2032 in magnitude):
        the definition of the module docstring (also the epilogue of the norm and gated
        activation kernels: kernels/fused_norm.py, kernels/gated_act.py)."""
        a = tl.max(tl.abs(x), axis=1)
        pos = a > 0
        inv = tl.where(pos, tl.math.div_rn(127.0, tl.where(pos, a, 1.0)), 0.0)
        dx = tl.where(pos, tl.math.div_rn(a, 127.0), 0.0)
        q = tl.floor(tl.fma(x, inv[:, None], 0.5))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
        cols = b[:, None] * 256 + tl.arange(0, 256)[None, :]
        tl.store(q_ptr + row * K + cols, q.to(tl.int8), mask=ok[:, None])
        tl.store(dx_ptr + row * (K // 256) + b, dx, mask=ok)
        sums = tl.sum(tl.reshape(q, (q.shape[0], 16, 16)), axis=2)
        tl.store(bs_ptr + row * (K // 16) + b[:, None] * 16 + tl.arange(0, 16)[None, :],
                 sums.to(bs_ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _quantize_x_kernel(x_ptr, q_ptr, dx_ptr, bs_ptr, K, stride_xm,
                           PDL: tl.constexpr = False, RELEASE_FIRST: tl.constexpr = False):
        """Row m (program 0), super-block b (program 1) of x -> quantize_store.
        RELEASE_FIRST: triton_util.release_first (the product after it reads only weights
        before its wait)."""
        m = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1) + tl.zeros((1,), tl.int32)
        await_inputs(PDL, RELEASE_FIRST)
        cols = b[:, None] * 256 + tl.arange(0, 256)[None, :]
        x = tl.load(x_ptr + m * stride_xm + cols).to(tl.float32)  # (1, 256)
        quantize_store(x, b, b >= 0, m, q_ptr, dx_ptr, bs_ptr, K)
