"""Q4_K and Q6_K products with 8-bit activations: exact integer sums per super-block.

The bf16 kernels (kernels/qmatmul.py) must run one matrix instruction family on every path
to keep a row's bits independent of M, because float sums depend on their order. Here x
is quantized per 256-column super-block (the weight's block) to integers, so every
super-block's product is an exact integer and its order of additions does not matter:
CUDA cores at one row, the matrix unit at many, any split of the work, the same bits. The
float part is two fmas per (row, super-block), in K order on every path.

x's quantization (`quantize_x_reference` is the definition): per row and super-block,
a = max |x|, id = 127 / a and dx = a / 127 (float32, correctly rounded; both 0 where
a = 0), q = floor(fma(x, id, 0.5)) in -127 .. 127. Then, with the GGUF codes and scales:
- Q4_K: isum = sum over sub-blocks s of sc_s * dot(q4_s, q_s) and msum = sum of
  m_s * sum(q_s); acc = fma(isum, d * dx, acc); acc = fma(-msum, dmin * dx, acc);
- Q6_K: isum = sum over s of sc_s * (dot(q6_s, q_s) - 32 sum(q_s)) (q6 the unsigned 6-bit
  code); acc = fma(isum, d * dx, acc).
|isum| < 2^29 for both (int32); gguf-py's dequantized weights times dx * q in float64 are
the independent reference.

The x quantization costs accuracy: q carries about 8 bits per element relative to the
block's largest, as llama.cpp's own quantized-activation kernels (q8_1, q8_K).

Launches: `quantize_x` (one small kernel, or fused into the norm or gated activation
before the product) writes q (int8), dx and the sums of q over each 16 columns (int32 up
to INT_SUMS_M rows, float16 beyond: QuantX); then
one product kernel, whose split partials (the super-blocks of a row cut into `split`
ranges, by (type, N, K) only) are added in split order by the last program of each tile:
- `_qint_gemv_kernel` (up to gemv_max_m rows: 4, Q6_K 8 where qint's Triton kernel takes
  the matrix unit's launches; 2 and 4 where the Gluon kernel does) on the CUDA cores: a
  program owns BLOCK_N weight rows, the codes stay packed four to a u32 word against a
  word of x's int8 codes (dp4a on NVIDIA, byte by byte elsewhere: the same integer), each
  row of x in turn;
- `_qint_mm_kernel` (more rows) on the matrix unit's int8 path (wgmma/mma s8 on NVIDIA,
  WMMA iu8 on RDNA): a sub-block's codes (Q4_K 0..15, Q6_K's q - 32) times x's codes is
  an exact int32 dot, times the sub-block's integer scale; the mins' sums of Q4_K one f16
  dot of integers (exact). On NVIDIA the codes are unpacked four to a word (PTX), elsewhere
  byte by byte; the same values. Rows of x past M repeat the last row (their sums are not
  stored): no masks on x's loads. On NVIDIA, Q4_K or Q6_K_A alone at up to 16 rows runs
  kernels/qint_mma.py's Gluon kernels instead (`mma_path`): the same sums and bits.

Q6_K is held in aligned rows (Q6_K_A, `repack_q6k` at load, the same bytes plus at most
15 of padding a row): a 210-byte super-block is only 2-byte aligned, so its words would
be joined from two loads; in Q6_K_A a row holds its super-blocks' 208-byte records (ql,
qh, scales: 16-byte aligned, read as whole words) and then their f16 d's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from kernels.qgemv import _TICKETS, _tickets, ptx
from kernels.qscaled import _sub_dot
from kernels.qtiles import Q4_K, Q6_K, _f16, _f16lo, _p32
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    helper,
    launcher,
    next_pow2,
    release_first,
    tl,
    triton,
)
from kernels.triton_util import num_sms as device_sms

__all__ = ["ACT8_STORED", "INT_SUMS_M", "MMA_GEMV_MAX_M_OF", "Q6_K_A", "QINT_TYPES",
           "QIntConfig", "default_qint_config", "in_cta_config", "other_way",
           "TILE_BOUNDS", "TILE_CANDIDATES", "TUNED_TILES", "forced_tile", "tile_bound",
           "tile_options", "tiled_tile",
           "QuantX", "dequantized_x_reference", "empty_quant_x", "qint_parts", "sums_dtype",
           "qint_reference", "qint_triton", "quant_x_reference", "quantize_x",
           "quantize_x_reference", "repack_q6k", "row_bytes", "unpack_q6k"]

Q6_K_A = 1014  # Q6_K in aligned rows (not a GGML type: this module's storage of Q6_K)
QINT_TYPES = frozenset({Q4_K, Q6_K_A})
# The GGML type of a file -> the type its blocks are held in for these kernels
ACT8_STORED = {Q4_K: Q4_K, Q6_K: Q6_K_A}

QK = 256  # columns per super-block, and per x scale
# Rows of x up to which the CUDA-core kernel runs (its cost grows with each row), the
# matrix unit's beyond. H200 (bench/RESULTS.md, "int8 matrix-unit path"), Q4_K at 4 rows:
# 30.9 against 26.8 us at 14336 x 4096 but 11.1 against 13.0 at 4096 x 4096; at 8 rows
# even (27.9 / 28.0 at 14336 x 4096).
GEMV_MAX_M = 4  # rows up to which Q4_K (and a launch of two types) runs on the CUDA cores
# Q6_K's matrix-unit step takes two int8 dots a 32-column run (its 16-column sub-blocks):
# qint's Triton kernel stays slower than the CUDA-core one up to 8 rows (H200 at 8 rows:
# 41 against 64 us at 4096 x 14336, 310 against 486 on the head before the packed code
# decode that took 16 rows from 65 to 46 us). The bits are the same on every path.
GEMV_MAX_M_OF = {Q6_K_A: 8}
# Where kernels/qint_mma.py's Gluon kernel takes the matrix unit's launches (its time flat
# over 1-16 rows: one 16-row tile), the CUDA cores keep fewer rows. H200, 4096 x 14336:
# Q4_K on the CUDA cores 16.2 / 21.7 / 23.5 / 27.3 us at 1 / 2 / 3 / 4 rows, the Gluon
# kernel 20.8-23.1; Q6_K 19.2 / 23.4 / 25.1 / 28.4 and 41.5 at 8, the Gluon kernel
# 28.6-29.8; the engine's 4-row step 4.19 ms on the CUDA cores, its 8-row one 3.76 on the
# Gluon kernel.
MMA_GEMV_MAX_M_OF = {Q4_K: 2, Q6_K_A: 4}
# x's 16-column sums are int32 up to this many rows (the CUDA-core kernel's only rows on
# every path), float16 beyond (the matrix-unit kernels' dot operand as loaded); both exact
INT_SUMS_M = 2
# The matrix-unit kernel's tiles, (block_m, block_n, num_warps[, num_stages[, max_regs]]),
# by rows of x: the first bound of TILE_BOUNDS that holds picks the tile, the tuned one
# (TUNED_TILES, set at load by engine/tile_tune.py from measured times of the candidates)
# or else the first candidate. The sums are exact, so the tile may depend on M and on
# measurements without changing a bit.
# Swept on the H200 (int8 kernel, Q4_K 14336 x 4096 and 4096 x 14336, Q6_K 4096 x 14336):
# 16 x 64 best at 16 rows; 32 x 128 at 32 (43 / 39 / 60 us against 46 / 51 / 67 at
# 32 x 64); 64 x 128 at 64 (73 / 65 / 102 against 74 / 70 / 101 at 64 x 64) and at 512
# (413 / 430 / 653 against 458 / 485 / 710).
# The 16-row tile builds in at most 120 registers a thread (TILED_MAX_REGS): without the cap
# the sm_90 build takes 133 (Q4_K) / 136 (Q6_K), so 3 programs of 4 warps fit a
# multiprocessor's 64K registers; at 120 (no spills, 4% more instructions a super-block in
# SASS) 4 fit. The 32 x 128 and 64 x 128 tiles on 4 warps spill in their sm_90 builds (24-840
# bytes a thread); 32 x 64 on 4 warps does not: a candidate beside them. Timed by the tuner
# on the H200 and left out (bench/RESULTS.md, 2026-12-01): 64 x 64 on 8 warps (1.4-1.7x
# slower at 64 rows and more), 16 x 32 (1.4x at 16), Q4_K's scales inside the weight operand
# (two 256-column dots a super-block: 1.4x at 16), and the splits of a tile in one program
# from one tile a multiprocessor (the Q4_K linears at 16 rows 3.16 against 3.08 ms).
TILED_MAX_REGS = 120
TILE_BOUNDS = (16, 32, 64, 1 << 62)
# gfx1151 (256 VGPRs a lane): the CUDA-core kernel with 32 rows a program builds without
# spills (64 spill 30-85 VGPRs); the int8 matrix-unit one builds without spills for both
# types at 16 x 32, 16 x 64 and 32 x 32 with one stage (32 x 64: 21 / 76 VGPRs spilled,
# 64 x 64: 102 / 146; the f16 kernel before it spilled 29-267 at 16 x 32): the load-time
# tuner (engine/tile_tune.py) times those on the box, where prefill's many rows would
# rather take the larger ones.
HIP_BLOCK_N = 32
# From this many weight rows the CUDA-core kernel takes 128 rows a program: 10-20% faster
# on the H200 at 14336 x 4096 (bench/RESULTS.md, 2026-11-30). Q4_K at up to
# Q4K_NARROW_M rows of x takes 64 rows on 2 warps at any N instead (more programs
# resident: 22.7 against 23.4 us at 28672 x 4096, 8.7 against 10.1 for the fused q|k|v
# at one row; 30-40% slower from 3 rows); Q6_K is slower on 2 warps.
WIDE_N = 8192
Q4K_NARROW_M = 2
# Q6_K's wide one-row build with x's loads first takes 162 registers (3 programs a
# multiprocessor), 128 with them in the loop (4). Loads first pay where its programs fill
# at least this many waves of 3 (the output head: 138 against 146 us, and the one-stream
# step 2.263 against 2.311 ms); with fewer the last wave runs part-empty (Q6_K 28672 x
# 4096: 43.0 against 35.4 us; H200, bench/RESULTS.md 2026-12-01).
Q6K_EARLY_WAVES = 2
# ... and where they do, 32 rows a program: 118.5 against 165.0 us for the output head
# (Q6_K 128256 x 4096, qint_bench; 64 rows on 8 warps 121.5) and one stream 470 against
# 465 tok/s (H200, bench/RESULTS.md 2026-12-02).
Q6K_HEAD_BLOCK_N = 32
# Q4_K at one row of x on NVIDIA: the 2-warp build capped at this many registers a thread
# (165 uncapped once x's loads were issued beside the weights': _sb_q4k; no spills at 128):
# 8 programs a multiprocessor instead of 6. Since the dp4a chains (_dp4a_chain) the builds
# stay under it uncapped (the splits-in-one-program one 112: 9 programs; as programs 128),
# and lifting it measured as noise (one stream 481.5 against 478.5 / 480.0 tok/s): kept as
# a guard. (Before those loads moved, 126 uncapped and a cap of 112: 23.5 against 24.5 us
# at 28672 x 4096 on the H200, bits unchanged; bench/RESULTS.md, 2026-12-01 and -02.)
Q4K_ONE_ROW_REGS = 128
# More splits than this cost more in partial sums than they gain in programs (H200, 4096 x
# 4096 at one row: 8.5 us at 8 splits, 9.6 at 16).
MAX_SPLIT = 8
HIP_TILED_TILE = (16, 32, 4, 1)
_CAPPED_16 = (16, 64, 4, None, TILED_MAX_REGS)
# 32 x 64 on 4 warps: Q4_K's sm_90 build takes 181 registers (2 programs a multiprocessor),
# capped at 168 without spills (3); Q6_K's 145 uncapped (capped: 168 and 32 stack bytes)
_CAPPED_32 = (32, 64, 4, None, 168)
# Tighter caps for more programs a multiprocessor (latency-bound: 36% of issue slots used at
# 16 rows with 4 programs, bench/RESULTS.md): the sm_90 builds keep every loop free of local
# memory (16-40 stack bytes spilled outside the loops): 16 x 64 on 2 stages at 96
# registers, 5 programs a multiprocessor (3 stages at 96: no faster); 32 x 64 at 128, 4 of
# Q4_K instead of 3. H200, the model's Q4_K linears: 2.92 against 3.06 ms at 16 rows, 3.72
# against 3.87 at 32, 5.79 against 6.11 at 64; Q6_K within 2%.
_CAPPED_16_96 = (16, 64, 4, 2, 96)
_CAPPED_32_128 = (32, 64, 4, None, 128)
# backend -> row bound -> the tiles engine/tile_tune.py times, the default first
TILE_CANDIDATES: dict[str, dict[int, tuple[tuple, ...]]] = {
    "cuda": {16: (_CAPPED_16, (16, 64, 4), _CAPPED_16_96),
             32: ((32, 128, 4), (32, 64, 4), _CAPPED_32, _CAPPED_32_128, _CAPPED_16),
             64: ((64, 128, 4), (32, 64, 4), _CAPPED_32, _CAPPED_32_128, _CAPPED_16),
             1 << 62: ((64, 128, 4), (32, 64, 4), _CAPPED_32)},
    "hip": {16: (HIP_TILED_TILE, (16, 64, 4, 1)),
            **{bound: (HIP_TILED_TILE, (16, 64, 4, 1), (32, 32, 4, 1))
               for bound in TILE_BOUNDS[1:]}},
}
# (backend, held type, row bound) -> the tile measured fastest on this process's device
TUNED_TILES: dict[tuple[str, int, int], tuple] = {}
_FORCED = threading.local()  # forced_tile's stack, per thread (a tuner beside a server)


class QIntConfig(NamedTuple):
    block_n: int
    split: int  # the super-blocks of a row are cut into `split` equal ranges
    num_warps: int = 4
    num_stages: int | None = None
    max_regs: int | None = None  # the CUDA-core kernel's register cap (NVIDIA's maxnreg)
    # Q6_K at one row on the CUDA cores: x's loads ahead of the scales' decode (else in
    # the product's loop, where they wait behind it)
    x_early: bool = True
    # The CUDA-core kernel: a program takes every split of its block_n rows (on num_warps
    # warps), summing the partials itself after a barrier instead of a ticket's last
    # program (_finish_in_cta: the same bits)
    in_cta: bool = False


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


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of K columns held as `qtype` (Q4_K or Q6_K_A)."""
    if qtype == Q4_K:
        return k // QK * 144
    return -(-(k // QK) * 210 // 16) * 16


def repack_q6k(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF Q6_K rows (N, K / 256 * 210) uint8 -> Q6_K_A rows (N, row_bytes): each row's
    super-blocks without their d (bytes 0..207), then the d's in order, zero padding."""
    n, nsb = blocks.shape[0], k // QK
    b = blocks.reshape(n, nsb, 210)
    out = torch.zeros(n, row_bytes(Q6_K_A, k), dtype=torch.uint8, device=blocks.device)
    out[:, :nsb * 208] = b[:, :, :208].reshape(n, nsb * 208)
    out[:, nsb * 208:nsb * 210] = b[:, :, 208:].reshape(n, nsb * 2)
    return out


def unpack_q6k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """repack_q6k's inverse: Q6_K_A rows -> GGUF Q6_K rows (N, K / 256 * 210)."""
    n, nsb = rows.shape[0], k // QK
    return torch.cat([rows[:, :nsb * 208].reshape(n, nsb, 208),
                      rows[:, nsb * 208:nsb * 210].reshape(n, nsb, 2)], dim=2).reshape(n, -1)


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


def qint_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                   shape: tuple[int, int]) -> torch.Tensor:
    """The definition in float64: dequantize(blocks) (gguf-py) @ (dx * q).T; blocks in a
    GGML type or Q6_K_A."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    if ggml_type == Q6_K_A:
        blocks, ggml_type = unpack_q6k(blocks.reshape(shape[0], -1), shape[1]), Q6_K
    w = dequantize_reference(blocks.reshape(-1), ggml_type, tuple(shape), torch.float64)
    return dequantized_x_reference(x) @ w.t()


if HAS_TRITON:
    from kernels.qgemv import finish_splits

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

    @helper
    def _dp4a(a, b):
        """The sum of the 4 byte products of int32 words a (unsigned bytes < 128) and b
        (signed bytes), byte by byte (NVIDIA's dp4a gives the same integer: _dp4a_chain)."""
        return ((a & 255) * ((b << 24) >> 24) + ((a >> 8) & 255) * ((b << 16) >> 24)
                + ((a >> 16) & 255) * ((b << 8) >> 24) + ((a >> 24) & 255) * (b >> 24))

    @helper
    def _stream(p):
        """Weight words: read once, so they should not push x's codes out of the cache."""
        return tl.load(p, eviction_policy="evict_first")

    @helper
    def _keep(p):
        """x's codes: every program of the launch reads them."""
        return tl.load(p, eviction_policy="evict_last")

    @helper
    def _sums(p):
        """x's 16-column sums at p as int32 (held in int32, or float16: exact)."""
        return tl.load(p).to(tl.int32)

    @helper
    def _quad_dots(w, x, PTX: tl.constexpr):
        """(BN, 32) code words and x's words -> (BN, 8) int32: each quad of 4 words' dp4a
        sums (a quad lies in one thread: no exchange)."""
        if PTX:
            return _dp4a_chain(w, x, True)
        return tl.sum(tl.reshape(_dp4a(w, x), (w.shape[0], 8, 4)), axis=2)

    @helper
    def _high_quad_dots(w, x, PTX: tl.constexpr):
        """_quad_dots of the high nibbles of w: on NVIDIA the bytes' high nibbles in place
        (16 times their value, unsigned), each quad's sum then divided by 16 (exact): no
        shift a word."""
        if PTX:
            return _dp4a_chain(w & -0x0F0F0F10, x, False) >> 4  # 0xF0F0F0F0 as an int32
        return _quad_dots((w >> 4) & 0x0F0F0F0F, x, PTX)

    @helper
    def _dp4a_chain(w, x, SIGNED: tl.constexpr):
        """NVIDIA: (BN, 32) words -> (BN, 8) int32, each quad's 4 dp4a's one chain through
        the accumulator (no adds); w's bytes signed (dp4a.s32.s32) or not (dp4a.u32.s32),
        x's signed."""
        w0, w1, w2, w3 = _quad_words(w)
        x0, x1, x2, x3 = _quad_words(x)
        acc = _dp4a_acc(w0, x0, 0 * w0, SIGNED)
        acc = _dp4a_acc(w1, x1, acc, SIGNED)
        acc = _dp4a_acc(w2, x2, acc, SIGNED)
        return _dp4a_acc(w3, x3, acc, SIGNED)

    @helper
    def _dp4a_acc(a, b, c, SIGNED: tl.constexpr):
        """c + the sum of the 4 products of a's bytes (signed or not) and b's signed bytes."""
        if SIGNED:
            asm: tl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            asm: tl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        return tl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @helper
    def _quad_words(t):
        """(BN, 32) words -> four (BN, 8): word i of each quad of 4 (a quad lies in one
        thread: the splits move no data)."""
        a, b = tl.split(tl.reshape(t, (t.shape[0], 8, 2, 2)))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return a0, b0, a1, b1

    @helper
    def _k4_head_words(head):
        """The 16-byte heads (BN, 4) of Q4_K super-blocks: word 0 (BN,) = d | dmin << 16,
        words 1-3 (BN, 1) = scales[12] (qtiles._scales_k4)."""
        j = tl.arange(0, 4)[None, :]
        return (_col(head, j, 0), _col(head, j, 1)[:, None], _col(head, j, 2)[:, None],
                _col(head, j, 3)[:, None])

    @helper
    def _words_at(w_ptr, off):
        """The u32 words from the 4-byte aligned byte offsets `off` of the weights: the
        offsets added as bytes (as words, off // 4, they cost the build a signed division
        and a mask per load: 479 -> 441 instructions in the one-row Q4_K loop on sm_90)."""
        return (w_ptr + off).to(tl.pointer_type(tl.uint32), bitcast=True)

    @helper
    def _k4_head(w_ptr, blk):
        """_k4_head_words of the super-blocks at byte offsets blk (BN,)."""
        j = tl.arange(0, 4)[None, :]
        return _k4_head_words(_stream(_words_at(w_ptr, blk)[:, None] + j))

    @helper
    def _ld_q4k(w_ptr, row_off, sb):
        """Super-block sb's raw words of the Q4_K rows at row_off (BN,): codes (BN, 32) and
        head (BN, 4), as int32."""
        blk = row_off + sb * 144  # (BN,) 16-byte aligned super-blocks
        c = tl.arange(0, 32)[None, :]
        zero = 0 * blk[:, None].to(tl.int32)  # (BN, 1): the indices below in the codes' shape
        p = _words_at(w_ptr, blk)[:, None]
        w = _stream(p + 4 + (c + zero)).to(tl.int32, bitcast=True)
        head = _stream(p + tl.arange(0, 4)[None, :]).to(tl.int32, bitcast=True)
        return w, head

    @helper
    def _ld_q6k(w_ptr, row_off, sb, K):
        """Super-block sb's raw words of the Q6_K_A rows at row_off (BN,): ql (BN, 32), qh
        (BN, 32) in ql's word order (see _sb_q6k), scale words (BN, 4), d (BN,) f32."""
        base = row_off + sb * 208  # (BN,)
        c = tl.arange(0, 32)[None, :]
        s = c // 4
        r = c % 4
        zero = 0 * base[:, None].to(tl.int32)
        # words by a shift, not _words_at: from byte offsets the sm_90 builds hold more
        # registers (the late wide build 128 -> 168, a program fewer a multiprocessor)
        p = _p32(w_ptr) + (base >> 2)[:, None]
        ql = _stream(p + (c + zero)).to(tl.int32, bitcast=True)
        qh = _stream(p + (32 + 8 * (s // 4) + 4 * (s % 2) + r + zero)).to(tl.int32,
                                                                          bitcast=True)
        sw = _stream(p + 48 + tl.arange(0, 4)[None, :]).to(tl.int32, bitcast=True)
        d = _stream((w_ptr + row_off + (K // 256) * 208 + 2 * sb).to(tl.pointer_type(tl.uint16),
                                                                     bitcast=True))
        return ql, qh, sw, d.to(tl.float16, bitcast=True).to(tl.float32)

    @helper
    def _k4_six(wa, w3, s, NIB: tl.constexpr):
        """The 6-bit scale (wa = head word 1, NIB 0) or min (word 2, NIB 4) of Q4_K
        sub-block s (uint32, any shape) from the head words (BN, 1)."""
        sh = 8 * (s % 4)
        return tl.where(s >= 4, ((w3 >> (sh + NIB)) & 15) | (((wa >> (sh + 6)) & 3) << 4),
                        (wa >> sh) & 63).to(tl.int32)

    @helper
    def _put(acc, col, m, isum, scale):
        """acc[:, m] = fma(isum, scale, acc[:, m]) for (BN,) sums and scales; the other
        columns unchanged."""
        v = tl.fma(isum.to(tl.float32)[:, None], scale[:, None], acc)
        return tl.where(col == m, v, acc)

    @helper
    def _x_scale(dx_ptr, m, sb, K, BN: tl.constexpr, VROWS: tl.constexpr):
        """x's scale of row m at super-block sb: a scalar, or with VROWS (sb (BN, 1), a
        super-block a row) (BN,)."""
        dx = tl.load(dx_ptr + m * (K // 256) + sb)
        if VROWS:
            dx = tl.reshape(dx, (BN,))
        return dx

    @helper
    def _x_q4k(q32, bs_ptr, dx_ptr, xw, j, m, sb, K, VROWS: tl.constexpr):
        """Row m of the quantized x at Q4_K super-block sb: its words against the codes'
        low nibbles (xw: their indices) and high nibbles, the four pairs of 16-column sums
        (2 a sub-block) and the scale (_x_scale)."""
        xrow = q32 + m * (K // 4) + sb * 64 + xw
        bs = bs_ptr + m * (K // 16) + sb * 16 + j * 4
        return (_keep(xrow), _keep(xrow + 8),  # 32 elements on: the high nibbles' sub-block
                _sums(bs), _sums(bs + 1), _sums(bs + 2), _sums(bs + 3),
                _x_scale(dx_ptr, m, sb, K, xw.shape[0], VROWS))

    @helper
    def _sb_q4k(acc, w, head, sb, q_ptr, dx_ptr, bs_ptr, K, M, BLOCK_M: tl.constexpr,
                PTX: tl.constexpr, VROWS: tl.constexpr = False):
        """acc (BN, BM) + super-block sb of BN Q4_K rows (its words from _ld_q4k) times the
        quantized x rows. The codes stay packed: word c (of 32) holds 4 bytes of group
        g = c // 8, low nibbles 4 codes of sub-block 2g, high nibbles 4 of 2g + 1, against
        one word of x's int8 codes each. The words lie flat, (BN, 32): a thread holds 4
        words of several rows, which share x's words (loaded once) and a group's scales.
        VROWS: sb is (BN, 1), a super-block a row (_qint_gemv_kernel's IN_CTA)."""
        c = tl.arange(0, 32)[None, :]
        zero = tl.zeros((w.shape[0], 1), tl.int32)  # (BN, 1): indices in the codes' shape
        j = tl.arange(0, 4)[None, :]
        q32 = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        xw = c + 8 * (c // 8) + zero  # x's word for word c's low nibbles: elements 64 g + 4 i
        if BLOCK_M == 1:
            # x's words, 16-column sums and scale first: they wait on nothing, while the
            # scales' decode below waits on the head's words (and passes them through
            # shared memory), so issued after it they would add their latency to the
            # weights' (more rows keep their loads in the loop: registers)
            xa0, xb0, t00, t01, t02, t03, dx0 = _x_q4k(q32, bs_ptr, dx_ptr, xw, j, 0, sb, K,
                                                       VROWS)
        lo = w & 0x0F0F0F0F
        w0, w1, w2, w3 = _k4_head_words(head)
        q = tl.arange(0, 8)[None, :]  # quad of words q: words 4 q .. 4 q + 3, group q // 2
        s_lo = (2 * (q // 2)).to(tl.uint32)  # sub-block of the quad's low nibbles
        sc_lo = _k4_six(w1, w3, s_lo, 0)  # (BN, 8)
        sc_hi = _k4_six(w1, w3, s_lo + 1, 0)
        g2 = (2 * j).to(tl.uint32)
        mn0 = _k4_six(w2, w3, g2, 4)  # (BN, 4): the mins of sub-blocks 2g, 2g + 1
        mn1 = _k4_six(w2, w3, g2 + 1, 4)
        d = _f16lo(w0)
        dmin = _f16lo(w0 >> 16)
        col = tl.arange(0, BLOCK_M)[None, :]
        for m in tl.static_range(BLOCK_M):
            if m < M:
                if BLOCK_M == 1:
                    xa, xb, t0, t1, t2, t3, dx = xa0, xb0, t00, t01, t02, t03, dx0
                else:
                    xa, xb, t0, t1, t2, t3, dx = _x_q4k(q32, bs_ptr, dx_ptr, xw, j, m, sb, K,
                                                        VROWS)
                p_lo = _quad_dots(lo, xa, PTX)
                p_hi = _high_quad_dots(w, xb, PTX)
                dot = sc_lo * p_lo + sc_hi * p_hi  # (BN, 8)
                msum = mn0 * (t0 + t1) + mn1 * (t2 + t3)  # (BN, 4)
                acc = _put(acc, col, m, tl.sum(dot, axis=1), d * dx)
                acc = _put(acc, col, m, -tl.sum(msum, axis=1), dmin * dx)
        return acc

    @helper
    def _q6k_scales(sw, j, s):
        """Q6_K_A scales (int32) of sub-blocks sub(s) and sub(s) + 4 (s: any shape) from
        the scale words sw (BN, 4): sub(s) is byte s % 4 of word 2 (s // 4), sub(s) + 4 of
        the word after."""
        low = s < 4
        sh = 24 - 8 * (s % 4)
        sc_a = (tl.where(low, _col(sw, j, 0)[:, None], _col(sw, j, 2)[:, None]) << sh) >> 24
        sc_b = (tl.where(low, _col(sw, j, 1)[:, None], _col(sw, j, 3)[:, None]) << sh) >> 24
        return sc_a, sc_b

    @helper
    def _x_q6k(q32, bs_ptr, dx_ptr, xw, sub, m, sb, K, VROWS: tl.constexpr):
        """Row m of the quantized x at Q6_K super-block sb: its words against the codes'
        low nibbles (xw (BN, 32): their indices) and high nibbles, the 16-column sums of
        sub-blocks sub (1, 8) and sub + 4, and the scale (_x_scale)."""
        xrow = q32 + m * (K // 4) + sb * 64 + xw
        bs = bs_ptr + m * (K // 16) + sb * 16 + sub
        return (_keep(xrow), _keep(xrow + 16), _sums(bs), _sums(bs + 4),
                _x_scale(dx_ptr, m, sb, K, xw.shape[0], VROWS))

    @helper
    def _sb_q6k(acc, ql, qh, sw, d, sb, q_ptr, dx_ptr, bs_ptr, K, M, BLOCK_M: tl.constexpr,
                PTX: tl.constexpr, X_EARLY: tl.constexpr = True, VROWS: tl.constexpr = False):
        """acc (BN, BM) + super-block sb of BN Q6_K_A rows (its words from _ld_q6k) times
        the quantized x rows. Its 208-byte record (ql[128], qh[64], scales[16]) is 16-byte
        aligned and read as u32 words; d sits in the row's tail. Word c = 4 s + r (s < 8,
        r < 4) of ql holds, in its low nibbles, 4 codes of 16-element sub-block
        sub(s) = s + 4 (s // 4) and in its high nibbles 4 of sub(s) + 4; their top 2 bits
        are bits 2 a (4 + 2 a) of qh word 8 (s // 4) + 4 (s % 2) + r, a = s // 2 % 2 (qh
        arrives in ql's order). The words lie flat, (BN, 32), as in _sb_q4k. X_EARLY: at one
        row, x's loads before the decode (QIntConfig.x_early). VROWS: as _sb_q4k's."""
        c = tl.arange(0, 32)[None, :]
        s = c // 4
        r = c % 4
        zero = tl.zeros((ql.shape[0], 1), tl.int32)  # (BN, 1): indices in the codes' shape
        i = tl.arange(0, 8)[None, :]
        sub = i + 4 * (i // 4)  # (1, 8)
        q32 = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        xw = 4 * (s + 4 * (s // 4)) + r + zero  # x's word for word c's low nibbles
        EARLY: tl.constexpr = BLOCK_M == 1 and X_EARLY
        if EARLY:  # x's words, sums and scale before the decode (see _sb_q4k)
            xa0, xb0, t0a, t0b, dx0 = _x_q6k(q32, bs_ptr, dx_ptr, xw, sub, 0, sb, K, VROWS)
        a2 = 2 * (s // 2 % 2)
        q_lo = (ql & 0x0F0F0F0F) | (((qh >> a2) & 0x03030303) << 4)
        q_hi = ((ql >> 4) & 0x0F0F0F0F) | (((qh >> (a2 + 4)) & 0x03030303) << 4)
        j = tl.arange(0, 4)[None, :]
        sc_a, sc_b = _q6k_scales(sw, j, i)  # (BN, 8): sub(i) and sub(i) + 4
        col = tl.arange(0, BLOCK_M)[None, :]
        for m in tl.static_range(BLOCK_M):
            if m < M:
                if EARLY:
                    xa, xb, ta, tb, dx = xa0, xb0, t0a, t0b, dx0
                else:
                    xa, xb, ta, tb, dx = _x_q6k(q32, bs_ptr, dx_ptr, xw, sub, m, sb, K,
                                                VROWS)
                p_lo = _quad_dots(q_lo, xa, PTX)
                p_hi = _quad_dots(q_hi, xb, PTX)
                # codes are q - 32: minus 32 times x's sum over the sub-block
                isum = (sc_a * (p_lo - 32 * ta) + sc_b * (p_hi - 32 * tb))
                acc = _put(acc, col, m, tl.sum(isum, axis=1), d * dx)
        return acc

    @helper
    def _col(t, g, gi):
        """Column gi of a (BN, G) tensor as (BN,)."""
        return tl.sum(tl.where(g == gi, t, 0), axis=1)

    @helper
    def _gemv_sbs(acc, w_ptr, row_off, sb0, count, q_ptr, dx_ptr, bs_ptr, K, M,
                  QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, PTX: tl.constexpr,
                  PDL: tl.constexpr, X_EARLY: tl.constexpr = True, VROWS: tl.constexpr = False):
        """acc + super-blocks sb0 .. sb0 + count - 1 (count >= 1) of the rows at row_off
        (VROWS: sb0 (BN,), each row's own).
        The first super-block's words are loaded before the wait for x (await_inputs;
        later waits return at once). (Loading each next super-block's words before the
        current one's product measured slower, and so did asking the L2 cache for the next
        super-blocks before the wait, alone and in the step: bench/RESULTS.md 2026-12-01
        and 2026-12-02.)"""
        for i in range(0, count):
            sb = sb0 + i
            if VROWS:
                sbx = sb[:, None]
            else:
                sbx = sb
            if QTYPE == 12:  # Q4_K
                w, head = _ld_q4k(w_ptr, row_off, sb)
                await_inputs(PDL)
                acc = _sb_q4k(acc, w, head, sbx, q_ptr, dx_ptr, bs_ptr, K, M, BLOCK_M,
                              PTX, VROWS)
            else:
                ql, qh, sw, d = _ld_q6k(w_ptr, row_off, sb, K)
                await_inputs(PDL)
                acc = _sb_q6k(acc, ql, qh, sw, d, sbx, q_ptr, dx_ptr, bs_ptr, K, M,
                              BLOCK_M, PTX, X_EARLY, VROWS)
        return acc

    @helper
    def _finish_in_cta(acc, y_ptr, part_ptr, pid_n, M, N, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, S: tl.constexpr):
        """y's tile of the program's partials acc (BLOCK_N, BLOCK_M): row v split v % S
        of weight row v // S. acc as (rows, S, BLOCK_M) (the sm_90 build reshapes it in
        registers: no layout conversion, no barrier; the sums are warp shuffles), then each
        row's partials added in split order, as finish_splits adds them: partial s picked
        by a sum whose other terms are -0.0 (exact: x + -0.0 = x for every x). part_ptr
        unused."""
        TILE: tl.constexpr = BLOCK_N // S
        a = tl.reshape(acc, (TILE, S, BLOCK_M))
        pick = tl.arange(0, S)[None, :, None]
        total = tl.sum(tl.where(pick == 0, a, -0.0), axis=1)
        for s in tl.static_range(1, S):
            total += tl.sum(tl.where(pick == s, a, -0.0), axis=1)
        rm = tl.arange(0, BLOCK_M)
        rt = pid_n * TILE + tl.arange(0, TILE)
        tl.store(y_ptr + rm.to(tl.int64)[None, :] * N + rt[:, None], total,
                 mask=(rm < M)[None, :] & (rt < N)[:, None])

    @triton.jit(do_not_specialize=["M", "N"])
    def _qint_gemv_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, w2_ptr, n1, row_bytes2,
        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PTX: tl.constexpr = False, QTYPE2: tl.constexpr = 0, PDL: tl.constexpr = False,
        X_EARLY: tl.constexpr = True, IN_CTA: tl.constexpr = 0,
    ):
        """y[m, n] = the product of x's row m (quantized: q, dx, 16-column sums bs) and W's
        row n; grid (N tiles, splits), a program's sum over its range of super-blocks
        finished by qgemv.finish_splits. With QTYPE2, W's rows from n1 on (a multiple of
        the tile) are the second part's (w2_ptr, row_bytes2, QTYPE2): q|k and v of two
        types in one launch, into one output. X_EARLY: QIntConfig.x_early (Q6_K).
        IN_CTA (= nsplit > 1): grid (N tiles, 1), a program's BLOCK_N rows are the
        IN_CTA splits of its BLOCK_N / IN_CTA weight rows, finished by _finish_in_cta:
        the same partials, summed in the same order. Row v is split v % IN_CTA of weight
        row v // IN_CTA: rows a multiple of IN_CTA apart share a split and x's words, and
        a thread's rows are such in the builds' layouts (with split-major rows the q|k + v
        pair's sm_90 build of 32 weight rows on 8 warps took 226 registers, 161 so)."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        if IN_CTA > 0:
            TILE: tl.constexpr = BLOCK_N // IN_CTA
            v = tl.arange(0, BLOCK_N)
            rn = pid_n * TILE + v // IN_CTA
            sb0 = (v % IN_CTA) * sb_per_split
        else:
            TILE: tl.constexpr = BLOCK_N
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            sb0 = split * sb_per_split
        if QTYPE2 != 0:
            second = pid_n * TILE >= n1
        else:
            second = False
        if second:
            row_off = tl.where(rn < N, rn - n1, 0).to(tl.int64) * row_bytes2  # past N: row 0
            acc = _gemv_sbs(acc, w2_ptr, row_off, sb0, sb_per_split, q_ptr, dx_ptr, bs_ptr, K,
                            M, QTYPE2, BLOCK_M, PTX, PDL, X_EARLY, IN_CTA > 0)
        else:
            row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
            acc = _gemv_sbs(acc, w_ptr, row_off, sb0, sb_per_split, q_ptr, dx_ptr, bs_ptr, K,
                            M, QTYPE, BLOCK_M, PTX, PDL, X_EARLY, IN_CTA > 0)
        if IN_CTA > 0:
            _finish_in_cta(acc, y_ptr, part_ptr, pid_n, M, N, BLOCK_M, BLOCK_N, IN_CTA)
        else:
            offs = rm.to(tl.int64)[None, :] * N + rn[:, None]
            finish_splits(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, offs,
                          (rm < M)[None, :] & (rn < N)[:, None], ticket)

    def _q6_codes_asm(j: int, signed: bool) -> str:
        """PTX: 4 ql bytes ($1) and 4 qh bytes ($2) -> 4 Q6_K codes of a 32-column run j:
        nibble j // 2 of ql, bits 2 j of qh above it; `signed`: q - 32 (q ^ 32 sign-extended
        from 6 bits), else q (0..63)."""
        if signed:
            return ("{ .reg .b32 a, b; "
                    f"shr.b32 a, $1, {4 * (j // 2)}; and.b32 a, a, 0x0F0F0F0F; "
                    f"shr.b32 b, $2, {2 * j}; and.b32 b, b, 0x03030303; shl.b32 b, b, 4; "
                    "or.b32 a, a, b; xor.b32 a, a, 0x20202020; and.b32 b, a, 0x20202020; "
                    "mul.lo.u32 b, b, 6; or.b32 $0, a, b; }")
        nib = "and.b32 a, $1, 0x0F0F0F0F; " if j < 2 else \
            "shr.b32 a, $1, 4; and.b32 a, a, 0x0F0F0F0F; "
        top = {0: "shl.b32 b, $2, 4; ", 1: "shl.b32 b, $2, 2; ", 2: "mov.b32 b, $2; ",
               3: "shr.b32 b, $2, 2; "}[j]
        return "{ .reg .b32 a, b; " + nib + top + "and.b32 b, b, 0x30303030; or.b32 $0, a, b; }"

    _Q6_CODES = tl.constexpr(tuple(_q6_codes_asm(j, True) for j in range(4)))
    _Q6_UCODES = tl.constexpr(tuple(_q6_codes_asm(j, False) for j in range(4)))

    @helper
    def _q6_codes(ql, qh, J: tl.constexpr, PTX: tl.constexpr, SIGNED: tl.constexpr = True):
        """u8 ql and qh bytes (BN, 32) of run J -> the signed codes (q - 32) as int8, or
        the unsigned ones (0..63: kernels/qint_mma.py's Q6_K kernel)."""
        if PTX:
            if SIGNED:
                asm: tl.constexpr = _Q6_CODES[J]
            else:
                asm: tl.constexpr = _Q6_UCODES[J]
            out = tl.inline_asm_elementwise(asm, "=r,r,r", [ql, qh], dtype=tl.int8,
                                            is_pure=True, pack=4)
        else:
            a = ql.to(tl.int32)
            b = qh.to(tl.int32)
            q = ((a >> (4 * (J // 2))) & 15) | (((b >> (2 * J)) & 3) << 4)
            out = (q - 32 * SIGNED).to(tl.int8)
        return out

    @helper
    def _nibbles_i8(byte, PTX: tl.constexpr):
        """u8 code bytes -> their low and high nibbles as int8 (0..15); with PTX four at a
        time (one and, one shift and and per 32-bit word)."""
        if PTX:
            lo = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [byte],
                                           dtype=tl.int8, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                [byte], dtype=tl.int8, is_pure=True, pack=4)
        else:
            lo = (byte & 15).to(tl.int8)
            hi = (byte >> 4).to(tl.int8)
        return lo, hi

    @helper
    def _mm_q4k(acc, w_ptr, row_off, sb, q_ptr, dx_ptr, bs_ptr, K, rx, DOT_F64: tl.constexpr,
                PTX: tl.constexpr):
        """The tiled kernel's super-block step for Q4_K: acc (BN, BM) + the same sums as
        _sb_q4k for x's rows rx (BM,), on the matrix unit's int8 path: each 32-column
        sub-block's codes (0..15) times x's codes is one exact int32 dot, times its 6-bit
        scale. The mins' sum is an f16 dot: (BN, 16) mins (each twice) times x's 16-column
        sums (<= 2032, held in f16 and read as the dot's operand as they are: no convert
        through shared memory and no barrier; the dot's partial sums below 2^24)."""
        blk = row_off + sb * 144
        ll = tl.arange(0, 32)
        w0, w1, w2, w3 = _k4_head(w_ptr, blk)
        x_rows = q_ptr + rx.to(tl.int64)[None, :] * K + sb * 256  # (1, BM)
        isum = tl.zeros(acc.shape, tl.int32)
        for g in tl.static_range(4):
            byte = _stream((w_ptr + blk + 16 + 32 * g)[:, None] + ll[None, :])  # (BN, 32)
            lo, hi = _nibbles_i8(byte, PTX)
            xa = _keep(x_rows + 64 * g + ll[:, None])
            xb = _keep(x_rows + 64 * g + 32 + ll[:, None])
            s0 = tl.full((1, 1), 2 * g, tl.uint32)  # sub-blocks 2 g (low nibbles), 2 g + 1
            isum += _k4_six(w1, w3, s0, 0) * tl.dot(lo, xa, out_dtype=tl.int32)
            isum += _k4_six(w1, w3, s0 + 1, 0) * tl.dot(hi, xb, out_dtype=tl.int32)
        j = tl.arange(0, 16)[None, :]
        mins = _k4_six(w2, w3, (j // 2).to(tl.uint32), 4).to(tl.float16)  # (BN, 16)
        # rows of K / 16 sums (a multiple of 16: the load is vectorized and pipelined)
        bs = _keep(bs_ptr + rx.to(tl.int64)[None, :] * tl.multiple_of(K // 16, 16) + sb * 16
                   + j.T)  # (16, BM) float16
        msum = _sub_dot(mins, bs.to(tl.float16), DOT_F64)  # an exact integer
        dx = tl.load(dx_ptr + rx.to(tl.int64) * (K // 256) + sb)[None, :]
        acc = tl.fma(isum.to(tl.float32), _f16lo(w0)[:, None] * dx, acc)
        return tl.fma(-msum, _f16lo(w0 >> 16)[:, None] * dx, acc)

    @helper
    def _mm_q6k(acc, w_ptr, row_off, sb, q_ptr, dx_ptr, bs_ptr, K, rx, PTX: tl.constexpr,
                MASKED_LOADS: tl.constexpr):
        """The tiled kernel's super-block step for Q6_K: acc (BN, BM) + the same sums as
        _sb_q6k for x's rows rx (BM,), on the matrix unit's int8 path: a 32-column run's
        signed codes (-32..31) times x's codes of the run's first 16 columns, then of its
        last 16 (x zeroed elsewhere; the int8 dot's K step is 32), two exact int32 dots,
        each times its 16-column sub-block's int8 scale. MASKED_LOADS: x's run is loaded
        twice, zeroed outside each sub-block by the loads' masks, so each is the dot's
        operand as loaded (no convert through shared memory, no barrier a dot; H200 at 16
        rows: 36.6 against 43.6 us at 4096 x 14336, 260 against 330 on the head); else once
        and zeroed in registers (at 64 rows the doubled x tiles' shared memory costs more:
        114 against 95 us; on gfx1151 the masked loads spill 70 VGPRs at its 16 x 32 tile)."""
        base = row_off + sb * 208  # the record; d in the row's tail
        ll = tl.arange(0, 32)
        x_rows = q_ptr + rx.to(tl.int64)[None, :] * K + sb * 256
        first = (ll < 16)[:, None]  # x's columns of a run's first sub-block
        isum = tl.zeros(acc.shape, tl.int32)
        for h in tl.static_range(2):
            qh = _stream((w_ptr + base + 128 + 32 * h)[:, None] + ll[None, :])
            sw = _stream((w_ptr + base + 192 + 8 * h)[:, None] + tl.arange(0, 8)[None, :])
            sw = sw.to(tl.int8, bitcast=True).to(tl.int32)  # (BN, 8)
            for j in tl.static_range(4):
                # element 128 h + 32 j + l: nibble j // 2 of ql[64 h + 32 (j % 2) + l], top
                # bits 2 j of qh[32 h + l]; sub-blocks 8 h + 2 j (l < 16) and the next
                ql = _stream((w_ptr + base + 64 * h + 32 * (j % 2))[:, None] + ll[None, :])
                code = _q6_codes(ql, qh, j, PTX)
                xp = x_rows + 128 * h + 32 * j + ll[:, None]
                if MASKED_LOADS:
                    xa = tl.load(xp, mask=first, other=0, eviction_policy="evict_last")
                    xb = tl.load(xp, mask=~first, other=0, eviction_policy="evict_last")
                else:
                    xt = _keep(xp)
                    xa = tl.where(first, xt, 0).to(tl.int8)
                    xb = tl.where(first, 0, xt).to(tl.int8)
                da = tl.dot(code, xa, out_dtype=tl.int32)
                db = tl.dot(code, xb, out_dtype=tl.int32)
                isum += _col(sw, tl.arange(0, 8)[None, :], 2 * j)[:, None] * da
                isum += _col(sw, tl.arange(0, 8)[None, :], 2 * j + 1)[:, None] * db
        dx = tl.load(dx_ptr + rx.to(tl.int64) * (K // 256) + sb)[None, :]
        d = _f16(w_ptr + row_off + (K // 256) * 208 + 2 * sb)
        return tl.fma(isum.to(tl.float32), d[:, None] * dx, acc)

    @helper
    def _mm_splits(w_ptr, row_off, rm, q_ptr, dx_ptr, bs_ptr, M, K, sb_per_split,
                   splits_per_program, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_F64: tl.constexpr, PTX: tl.constexpr,
                   PDL: tl.constexpr, X_MASKS: tl.constexpr):
        """_qint_mm_kernel's sum (BLOCK_N, BLOCK_M) over its program's splits, of the QTYPE
        rows at row_off (BLOCK_N,) and x's rows rm (BLOCK_M,)."""
        total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        rx = tl.minimum(rm, M - 1)  # rows past M repeat the last (their sums not stored)
        await_inputs(PDL)
        for v in range(0, splits_per_program):
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # each split starts at 0
            sb0 = (tl.program_id(2) * splits_per_program + v) * sb_per_split
            for i in range(0, sb_per_split):
                if QTYPE == 12:  # Q4_K
                    acc = _mm_q4k(acc, w_ptr, row_off, sb0 + i, q_ptr, dx_ptr, bs_ptr, K, rx,
                                  DOT_F64, PTX)
                else:
                    acc = _mm_q6k(acc, w_ptr, row_off, sb0 + i, q_ptr, dx_ptr, bs_ptr, K, rx,
                                  PTX, X_MASKS)
            total = tl.where(v == 0, acc, total + acc)  # (p0 + p1) + p2 ..., as split sums
        return total

    @triton.jit(do_not_specialize=["M", "N"])
    def _qint_mm_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, splits_per_program, w2_ptr, n1, row_bytes2,
        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_F64: tl.constexpr = False, PTX: tl.constexpr = False, PDL: tl.constexpr = False,
        X_MASKS: tl.constexpr = False, QTYPE2: tl.constexpr = 0,
    ):
        """The tiled path (many rows of x): grid (M tiles, N tiles, nsplit), else as
        _qint_gemv_kernel, with the same bits (QTYPE2: its second part). A program sums
        `splits_per_program` consecutive splits itself, each from zero and added in split
        order as the split sum would (nsplit counts the programs along K). X_MASKS: Q6_K's
        MASKED_LOADS (x_masks)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if QTYPE2 != 0:
            second = pid_n * BLOCK_N >= n1
        else:
            second = False
        if second:
            row_off = tl.where(rn < N, rn - n1, 0).to(tl.int64) * row_bytes2  # past N: row 0
            acc = _mm_splits(w2_ptr, row_off, rm, q_ptr, dx_ptr, bs_ptr, M, K, sb_per_split,
                             splits_per_program, QTYPE2, BLOCK_M, BLOCK_N, DOT_F64, PTX, PDL,
                             X_MASKS)
        else:
            row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
            acc = _mm_splits(w_ptr, row_off, rm, q_ptr, dx_ptr, bs_ptr, M, K, sb_per_split,
                             splits_per_program, QTYPE, BLOCK_M, BLOCK_N, DOT_F64, PTX, PDL,
                             X_MASKS)
        offs = rm.to(tl.int64)[None, :] * N + rn[:, None]
        finish_splits(acc, y_ptr, part_ptr, ticket_ptr, pid_m * tl.num_programs(1) + pid_n,
                      tl.program_id(2), nsplit, M, N, offs,
                      (rm < M)[None, :] & (rn < N)[:, None], ticket)


def tile_bound(m: int) -> int:
    """The TILE_BOUNDS entry whose tiles serve m rows of x."""
    return next(bound for bound in TILE_BOUNDS if m <= bound)


def tiled_tile(m: int, backend: str = "cuda", qtype: int = Q4_K) -> tuple:
    """The matrix-unit kernel's (block_m, block_n, num_warps[, num_stages[, max_regs]]) for
    m rows of x and weights of `qtype` (as held: Q4_K or Q6_K_A)."""
    forced = getattr(_FORCED, "stack", None)
    if forced:
        return forced[-1]
    bound = tile_bound(m)
    return TUNED_TILES.get((backend, int(qtype), bound)) or TILE_CANDIDATES[backend][bound][0]


@contextlib.contextmanager
def forced_tile(tile: tuple) -> Iterator[None]:
    """Every matrix-unit launch of this thread inside takes `tile` (timing candidates: the
    tuner, benches; other threads' launches keep theirs)."""
    if not hasattr(_FORCED, "stack"):
        _FORCED.stack = []
    _FORCED.stack.append(tuple(tile))
    try:
        yield
    finally:
        _FORCED.stack.pop()


def x_masks(block_m: int, backend: str) -> bool:
    """Whether Q6_K's matrix-unit step zeroes x by its loads' masks (_mm_q6k's MASKED_LOADS):
    up to 32 rows a tile, not on HIP (the gfx1151 build spills)."""
    return block_m <= 32 and backend != "hip"


def compile_options(num_stages: int | None, max_regs: int | None,
                    backend: str) -> dict[str, int]:
    """Launch options: num_stages where set, and maxnreg (a register cap per thread,
    NVIDIA's only: HIP's compiler has no such option)."""
    out = {} if num_stages is None else {"num_stages": num_stages}
    if max_regs is not None and backend == "cuda":
        out["maxnreg"] = max_regs
    return out


def tile_options(tile: tuple[int, ...], backend: str) -> dict[str, int]:
    """compile_options of a tile's fields past its first three (num_stages, max_regs)."""
    return compile_options(*(*tile[3:], None, None)[:2], backend)


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


@functools.lru_cache(maxsize=4096)
def default_qint_config(ggml_type: int, n: int, k: int, num_sms: int = 0,
                        backend: str = "cuda", m: int = 1, qtype2: int = 0) -> QIntConfig:
    """64 rows a program, 128 from WIDE_N rows on, 4 warps (Q4_K with up to Q4K_NARROW_M
    rows of x: 64 rows on 2 warps, at one row and alone (no `qtype2`, the second part of
    a two-type launch: capped it spills) capped at Q4K_ONE_ROW_REGS registers, and at one
    row a tile's splits in one program (in_cta_config); HIP_BLOCK_N on "hip"); the
    super-blocks split while 64-row tiles alone give fewer than 4 programs per compute
    unit, up to MAX_SPLIT (num_sms 0: no split). The split never depends on `m` (x's
    rows): it is in a row's bits (the rows and warps a program takes are not, nor is
    x_early: Q6K_EARLY_WAVES, nor in_cta; Q6_K's programs filling those waves at one row
    take Q6K_HEAD_BLOCK_N rows).
    Splits in one program measured faster for Q4_K at one row (H200: 28672 x 4096 21.5
    against 25.3 us, 4096 x 14336 14.5 against 15.9; one stream 430 -> 450 tok/s) but
    slower for Q6_K (4096 x 14336 20.1 against 18.5) and mixed at two rows
    (bench/RESULTS.md, 2026-12-01)."""
    sbs = k // QK
    split = 1
    tiles = -(-n // 64)
    while tiles * split < 4 * num_sms and sbs % (2 * split) == 0 and split < MAX_SPLIT:
        split *= 2
    if backend == "hip":
        return QIntConfig(HIP_BLOCK_N, split)
    if ggml_type == Q4_K and m <= Q4K_NARROW_M:
        cfg = QIntConfig(64, split, 2, None, Q4K_ONE_ROW_REGS if m == 1 and not qtype2 else None)
        return in_cta_config(cfg) if m == 1 else cfg
    if n < WIDE_N:
        return QIntConfig(64, split)
    early = ggml_type != Q6_K_A or m > 1 or -(-n // 128) * split >= Q6K_EARLY_WAVES * 3 * num_sms
    if ggml_type == Q6_K_A and m == 1 and early and num_sms:  # the output head's shape
        return QIntConfig(Q6K_HEAD_BLOCK_N, split)
    return QIntConfig(128, split, x_early=early)


def in_cta_config(cfg: QIntConfig) -> QIntConfig:
    """`cfg` with its splits in one program (QIntConfig.in_cta) of the same rows and
    warps: block_n / split weight rows, each in every split. Unchanged without a split,
    where the split does not divide block_n, or taken already."""
    if cfg.split == 1 or cfg.in_cta or cfg.block_n % cfg.split:
        return cfg
    return cfg._replace(block_n=cfg.block_n // cfg.split, in_cta=True)


def other_way(cfg: QIntConfig) -> QIntConfig:
    """`cfg` with its splits the other way: as programs of their own where in one program
    (in_cta), else in one program (in_cta_config); a bench's comparison."""
    if cfg.in_cta:
        return cfg._replace(block_n=cfg.block_n * cfg.split, in_cta=False)
    return in_cta_config(cfg)


def qint_triton(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                config: QIntConfig | None = None, *, num_sms: int | None = None,
                xq: QuantX | None = None) -> torch.Tensor:
    """y = x @ W.T (float32, (M, N)) for x (M, K) float32 or bf16 with contiguous rows,
    with the 8-bit activations of the module docstring (the interpreter on CPU tensors).
    `xq`: x already quantized (quantize_x or a fused producer; x then only gives the
    shape). `num_sms` (default: the device's; 0 on the CPU) decides whether the
    matrix-unit kernel runs the splits as programs of their own; the bits are the same
    either way."""
    n, k = (int(s) for s in shape)
    return qint_parts(x, [(blocks, ggml_type, n)], k, config, num_sms=num_sms, xq=xq)


def qint_parts(x: torch.Tensor, parts: Sequence[tuple[torch.Tensor, int, int]], k: int,
               config: QIntConfig | None = None, *, num_sms: int | None = None,
               xq: QuantX | None = None) -> torch.Tensor:
    """qint_triton of the weight whose rows are the parts' (blocks, type, rows) in order:
    y (M, sum of rows). The split is the whole weight's (default_qint_config of its rows),
    so each part's bits are the same on every path; a part of up to gemv_max_m(type)
    rows runs on the CUDA cores, more on the matrix unit. Two parts whose first fills whole
    programs run as one launch (a fused q|k|v of two types) where both take the same kernel:
    up to GEMV_MAX_M rows the CUDA cores', past both parts' gemv_max_m the matrix unit's;
    else one launch each and a concatenation."""
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or k % QK or x.stride(1) != 1:
        raise InvalidRequest(f"qint: x must be (M, {k}) with K a multiple of 256 and "
                             f"contiguous rows, got {tuple(x.shape)}")
    for blocks, ggml_type, n in parts:
        if int(ggml_type) not in QINT_TYPES:
            hint = " (repack Q6_K with repack_q6k: Q6_K_A)" if int(ggml_type) == Q6_K else ""
            raise InvalidRequest(f"qint: no kernel for GGML type {ggml_type}{hint}")
        width = row_bytes(int(ggml_type), k)
        if tuple(blocks.shape) != (n, width) or blocks.data_ptr() % 4:
            raise InvalidRequest(f"qint: blocks must be ({n}, {width}) uint8 at a 4-byte "
                                 "aligned address")
    n_all = sum(n for _, _, n in parts)
    sms = device_sms(x.device) if num_sms is None else int(num_sms)
    backend = "hip" if x.device.type == "cuda" and torch.version.hip else "cuda"
    cfg = config or default_qint_config(int(parts[0][1]), n_all, k, sms, backend, m,
                                        int(parts[1][1]) if len(parts) == 2 else 0)
    if (k // QK) % cfg.split:
        raise InvalidRequest(f"qint: {cfg} does not divide {k // QK} super-blocks")
    if m == 0 or n_all == 0:
        return torch.empty(m, n_all, dtype=torch.float32, device=x.device)
    if xq is not None and (tuple(xq.q.shape) != (m, k) or xq.q.dtype != torch.int8):
        raise InvalidRequest(f"qint: xq must hold ({m}, {k}) int8 codes")
    xq = xq if xq is not None else quantize_x(x)
    gemv = [m <= gemv_max_m(t, backend, x.device) for _, t, _ in parts]
    if len(parts) == 2 and not gemv[0] and mma_path(m, int(parts[0][1]), int(parts[1][1]),
                                                    backend, x.device):
        gemv = [False, False]  # the Gluon kernel's two-type launch takes the second too
    if len(parts) == 1 or all(gemv) and len(parts) == 2 and m <= GEMV_MAX_M \
            and parts[0][2] % cfg.block_n == 0:
        return _launch(xq, parts, m, k, cfg, sms, backend, gemv[0])
    if not any(gemv) and len(parts) == 2 \
            and parts[0][2] % tiled_tile(m, backend, int(parts[0][1]))[1] == 0:
        return _launch(xq, parts, m, k, cfg, sms, backend, False)
    outs = [_launch(xq, [part], m, k, cfg, sms, backend, g)
            for part, g in zip(parts, gemv, strict=True)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _qint_mma():
    """kernels/qint_mma.py (imported late: it takes helpers from this module)."""
    from kernels import qint_mma

    return qint_mma


def mma_rows() -> int:
    """The most rows of x kernels/qint_mma.py's Gluon kernel takes: its MMA_ROWS, or fewer
    with MBUFO_QINT_MMA_ROWS (16: the rows past it on _qint_mm_kernel, as before its wider
    builds); a clear error for anything but a whole number."""
    raw = os.environ.get("MBUFO_QINT_MMA_ROWS", "").strip()
    if not raw:
        return _qint_mma().MMA_ROWS
    if not raw.isdigit():
        raise ValueError(f"MBUFO_QINT_MMA_ROWS must be a whole number of rows, got {raw!r}")
    return min(int(raw), _qint_mma().MMA_ROWS)


def mma_path(m: int, qtype: int, qtype2: int, backend: str, device: torch.device) -> bool:
    """Whether a matrix-unit launch runs kernels/qint_mma.py's Gluon kernel instead of
    _qint_mm_kernel (the same bits, 15-27% faster at the model's shapes at 16 rows on the
    H200, 12-43% at 64: bench/RESULTS.md, 2026-12-03): Q4_K or Q6_K_A alone or Q4_K's
    q|k with Q6_K_A's v, up to mma_rows() rows of x, on NVIDIA, with Gluon, unless
    MBUFO_QINT_MMA=0 or a tile is forced (the tuner and benches time _qint_mm_kernel's
    tiles)."""
    qint_mma = _qint_mma()
    return (device.type == "cuda" and backend == "cuda"
            and (qtype in QINT_TYPES and not qtype2 or (qtype, qtype2) == (Q4_K, Q6_K_A))
            and m <= mma_rows() and qint_mma.HAS_GLUON
            and not getattr(_FORCED, "stack", None)
            and os.environ.get("MBUFO_QINT_MMA", "1") != "0")


def gemv_max_m(qtype: int, backend: str = "", device: torch.device | None = None) -> int:
    """The most rows of x a weight of `qtype` multiplies on the CUDA cores (on `backend`
    and `device`: MMA_GEMV_MAX_M_OF's where the Gluon kernel takes the rows past it)."""
    bound = MMA_GEMV_MAX_M_OF.get(int(qtype))
    if device is not None and bound and mma_path(bound + 1, int(qtype), 0, backend, device):
        return bound
    return GEMV_MAX_M_OF.get(int(qtype), GEMV_MAX_M)


def _launch(xq: QuantX, parts: Sequence[tuple[torch.Tensor, int, int]], m: int, k: int,
            cfg: QIntConfig, sms: int, backend: str, gemv: bool) -> torch.Tensor:
    """One product kernel over checked inputs (two parts: the first fills whole programs)."""
    (blocks, ggml_type, n1), device = parts[0], xq.q.device
    n = sum(p[2] for p in parts)
    blocks2, type2, _ = parts[1] if len(parts) == 2 else (blocks, 0, 0)
    y = torch.empty(m, n, dtype=torch.float32, device=device)
    stages = compile_options(cfg.num_stages, cfg.max_regs, backend)
    in_cta = gemv and cfg.in_cta and cfg.split > 1
    if gemv:
        grid = (-(-n // cfg.block_n), 1 if in_cta else cfg.split)
        kernel, extra = _qint_gemv_kernel, {"BLOCK_M": next_pow2(m),
                                            "BLOCK_N": cfg.block_n * (cfg.split if in_cta
                                                                      else 1),
                                            "num_warps": cfg.num_warps, "QTYPE2": int(type2),
                                            "X_EARLY": cfg.x_early, **stages}
        if in_cta:
            extra["IN_CTA"] = cfg.split
        own = (blocks2, n1, blocks2.shape[1])  # the second part (or the first again)
    elif mma_path(m, int(ggml_type), int(type2), backend, device) and (
            not type2 or n1 % (16 * _qint_mma().WARPS) == 0):
        return _qint_mma().qint_mma_launch(
            xq, blocks, n, k, cfg.split, _tickets(device), q6=int(ggml_type) == Q6_K_A,
            second=(blocks2, n1) if type2 else None,
            launch=lambda kernel: launcher(kernel, device))
    else:
        tile = tiled_tile(m, backend, int(ggml_type))
        bm, bn, warps = tile[:3]
        tiles = -(-m // bm) * -(-n // bn)
        # the splits as programs of their own (partials) only while the tiles alone would
        # leave compute units idle: no (split, M, N) buffer for prefill-sized M
        per_program = 1 if tiles < 4 * sms else cfg.split
        grid = (-(-m // bm), -(-n // bn), cfg.split // per_program)
        kernel, extra = _qint_mm_kernel, {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                                          "DOT_F64": device.type == "cpu",
                                          "X_MASKS": x_masks(bm, backend),
                                          **tile_options(tile, backend)}
        # splits a program sums itself, then the second part (or the first again)
        own = (cfg.split // grid[-1], blocks2, n1, blocks2.shape[1])
        extra["QTYPE2"] = int(type2)
    splits = grid[-1]  # in_cta: the partials stay in the program
    part = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=device)
    tiles = grid[0] * (grid[1] if len(grid) == 3 else 1)
    ticket = tiles <= _TICKETS
    launcher(kernel, device)[grid](
        *xq, blocks, y, part, _tickets(device), m, n, k, blocks.shape[1],
        k // QK // cfg.split, splits, int(ticket), *own, QTYPE=int(ggml_type),
        PTX=ptx(device), **extra)
    if splits > 1 and not ticket and not in_cta:
        from kernels.qmatmul import sum_splits

        sum_splits(part, y)
    return y


def _tiled_spec(spec: type, name: str, sig: dict, divisible: tuple, qtype: int, qtype2: int,
                tile: tuple, backend: str):
    """aot_specs' KernelSpec of the matrix-unit kernel at `tile` on `backend`."""
    bm, bn, warps = tile[:3]
    opts = tile_options(tile, backend)
    consts = {"QTYPE": qtype, "BLOCK_M": bm, "BLOCK_N": bn, "DOT_F64": False,
              "PTX": backend == "cuda", "PDL": backend == "cuda", "X_MASKS": x_masks(bm, backend),
              "QTYPE2": qtype2}
    return spec(name, _qint_mm_kernel,
                {**sig, "splits_per_program": "i32", "w2_ptr": "*u8", "n1": "i32",
                 "row_bytes2": "i32", **{k: "constexpr" for k in consts}},
                consts, warps, True, backend, opts.get("num_stages"),
                divisible + ("w2_ptr", "row_bytes2"), opts.get("maxnreg"))


def aot_specs(spec: type) -> list:
    """kernels/aot.py: x's quantization; the CUDA-core kernel of each type and of the
    Q4_K + Q6_K pair at 1 and GEMV_MAX_M rows (dp4a on cuda), and the matrix-unit one at
    its 16-row tile (int8 dots: WMMA iu8 on gfx1151, wgmma s8 on sm_90); the sm_90 builds as
    programmatic dependent launches (kernels/triton_util.py); every other tile of
    TILE_CANDIDATES as `qint_<type>_cand_<tile>_tiled`."""
    if not HAS_TRITON:
        return []
    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*fp16", "w_ptr": "*u8",
           "y_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "row_bytes": "i32", "sb_per_split": "i32", "nsplit": "i32",
           "ticket": "i32"}
    divisible = ("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr", "part_ptr", "ticket_ptr", "K",
                 "row_bytes")
    out = [spec("qint_quantize_x", _quantize_x_kernel,
                {"x_ptr": "*bf16", "q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*fp16",
                 "K": "i32", "stride_xm": "i32"}, {}, 2, False, None, None,
                ("x_ptr", "q_ptr", "dx_ptr", "bs_ptr", "K", "stride_xm"))]
    gemv_sig = {**sig, "bs_ptr": "*i32", "w2_ptr": "*u8", "n1": "i32", "row_bytes2": "i32"}
    # each type alone, and q|k in Q4_K with v in Q6_K in one launch (Q4_K_M's attention)
    for qtype, qtype2, name in ((Q4_K, 0, "Q4_K"), (Q6_K_A, 0, "Q6_K"),
                                (Q4_K, Q6_K_A, "Q4_K_Q6_K")):
        for bm in sorted({1, GEMV_MAX_M, GEMV_MAX_M if qtype2 else gemv_max_m(qtype)}):
            for backend, n in (("hip", 4096), ("cuda", 4096), ("hip", WIDE_N), ("cuda", WIDE_N)):
                if n == WIDE_N and qtype2:
                    continue  # a fused q|k|v of two types is never that wide
                cfg = default_qint_config(qtype, n, 4096, backend=backend, m=bm, qtype2=qtype2)
                wide = "_wide" if n == WIDE_N else ""
                sums = "*i32" if sums_dtype(bm) == torch.int32 else "*fp16"
                # Q6_K's wide one-row build both ways (x_early: Q6K_EARLY_WAVES), and the
                # output head's on CUDA (early, Q6K_HEAD_BLOCK_N rows; built for gfx1151 too
                # so that it stays buildable there)
                x_early = (True, False, "head") if qtype == Q6_K_A and bm == 1 and wide \
                    else (True,)
                for early in x_early:
                    head = early == "head"
                    consts = {"QTYPE": qtype, "BLOCK_M": bm,
                              "BLOCK_N": Q6K_HEAD_BLOCK_N if head else cfg.block_n,
                              "PTX": backend == "cuda", "QTYPE2": qtype2,
                              "PDL": backend == "cuda", "X_EARLY": bool(early), "IN_CTA": 0}
                    tag = "_head" if head else "" if early else "_late"
                    out.append(spec(f"qint_{name}_m{bm}{wide}{tag}",
                                    _qint_gemv_kernel,
                                    {**gemv_sig, "bs_ptr": sums,
                                     **{k: "constexpr" for k in consts}},
                                    consts, cfg.num_warps, False, backend, cfg.num_stages,
                                    divisible + ("w2_ptr", "row_bytes2"), cfg.max_regs))
        if qtype == Q4_K:  # one row: a tile's splits in one program (in_cta_config;
            # NVIDIA's default, built for gfx1151 too so that it stays buildable there)
            cfg = default_qint_config(qtype, 4096, 4096, 132, "cuda", 1, qtype2)
            for backend in ("hip", "cuda"):
                consts = {"QTYPE": qtype, "BLOCK_M": 1, "BLOCK_N": cfg.block_n * cfg.split,
                          "PTX": backend == "cuda", "QTYPE2": qtype2,
                          "PDL": backend == "cuda", "X_EARLY": True, "IN_CTA": cfg.split}
                out.append(spec(f"qint_{name}_m1_in_cta",
                                _qint_gemv_kernel,
                                {**gemv_sig, **{k: "constexpr" for k in consts}}, consts,
                                cfg.num_warps, False, backend, cfg.num_stages,
                                divisible + ("w2_ptr", "row_bytes2"), cfg.max_regs))
        if qtype2:
            continue
        for backend in ("hip", "cuda"):
            default = TILE_CANDIDATES[backend][TILE_BOUNDS[0]][0]
            # the 16-row default (alone, and Q4_K's q|k with Q6_K's v in one launch), then
            # every other candidate the load-time tuner may take
            tiles = dict.fromkeys(t for ts in TILE_CANDIDATES[backend].values() for t in ts)
            for tile in tiles:
                pairs = (("", 0), ("_Q6_K", Q6_K_A)) if qtype == Q4_K and tile == default \
                    else (("", 0),)
                tag = "" if tile == default else "_cand_" + "x".join(
                    str(v) for v in tile if v is not None)
                for suffix, second in pairs:
                    out.append(_tiled_spec(spec, f"qint_{name}{suffix}{tag}_tiled", sig,
                                           divisible, qtype, second, tile, backend))
    return out
