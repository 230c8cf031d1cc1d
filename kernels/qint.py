"""Q4_K and Q6_K products with 8-bit activations: exact integer sums per super-block.

The bf16 kernels (kernels/qmatmul.py) must run one matrix instruction family on every path
to keep a row's bits independent of M, because float sums depend on their order. Here x
is quantized per 256-column super-block (the weight's block) to integers, so every
super-block's product is an exact integer and its order of additions does not matter:
CUDA cores at one row, the matrix unit at many, any split of the work, the same bits. The
float part is two fmas per (row, super-block), in K order on every path.

x is quantized by kernels/quant_x.py (`quantize_x_reference` is the definition: q in
-127 .. 127 and a float32 scale dx per row and super-block). Then, with the GGUF
codes and scales:
- Q4_K: isum = sum over sub-blocks s of sc_s * dot(q4_s, q_s) and msum = sum of
  m_s * sum(q_s); acc = fma(isum, d * dx, acc); acc = fma(-msum, dmin * dx, acc);
- Q6_K: isum = sum over s of sc_s * (dot(q6_s, q_s) - 32 sum(q_s)) (q6 the unsigned 6-bit
  code); acc = fma(isum, d * dx, acc).
|isum| < 2^29 for both (int32); gguf-py's dequantized weights times dx * q in float64 are
the independent reference.

x's quantization costs accuracy (kernels/quant_x.py). Launches: `quantize_x` (one small
kernel, or fused into the norm, gated activation or attention before the product) writes
q (int8), dx and the sums of q over each 16 columns (QuantX); then one product kernel,
whose split partials (the super-blocks of a row cut into `split` ranges, by (type, N, K)
only) are added in split order:
- kernels/qint_gemv.py's `_qint_gemv_kernel` (up to gemv_max_m rows: 4, Q6_K 8 where
  the Triton kernel takes the matrix unit's launches; 2 and 4 where the Gluon kernel
  does) on the CUDA cores;
- kernels/qint_mm.py's `_qint_mm_kernel` (more rows) on the matrix unit's int8 path, in
  tiles chosen by rows of x (tiled_tile). On NVIDIA, Q4_K or Q6_K_A alone at up to 64
  rows runs kernels/qint_mma.py's Gluon kernels instead (`mma_path`): the same sums and
  bits.

Q6_K is held in aligned rows (Q6_K_A, `repack_q6k` at load, the same bytes plus at most
15 of padding a row): a 210-byte super-block is only 2-byte aligned, so its words would
be joined from two loads; in Q6_K_A a row holds its super-blocks' 208-byte records (ql,
qh, scales: 16-byte aligned, read as whole words) and then their f16 d's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from kernels import qint_mma
from kernels.qgemv import _TICKETS, _tickets, ptx
from kernels.qint_mm import (
    TILE_BOUNDS,
    TILE_CANDIDATES,
    compile_options,
    tile_forced,
    tile_options,
    tiled_tile,
    x_masks,
)
from kernels.qtiles import Q4_K, Q6_K
from kernels.quant_x import QK, QuantX, dequantized_x_reference, quantize_x, sums_dtype
from kernels.triton_util import HAS_TRITON, launcher, next_pow2
from kernels.triton_util import num_sms as device_sms

if HAS_TRITON:
    from kernels.qint_gemv import _qint_gemv_kernel
    from kernels.qint_mm import _qint_mm_kernel
    from kernels.quant_x import _quantize_x_kernel

__all__ = ["ACT8_STORED", "MMA_GEMV_MAX_M_OF", "Q6_K_A", "QINT_TYPES", "QIntConfig",
           "default_qint_config", "gemv_max_m", "in_cta_config", "mma_path", "other_way",
           "qint_parts", "qint_reference", "qint_triton", "repack_q6k", "row_bytes",
           "unpack_q6k"]

Q6_K_A = 1014  # Q6_K in aligned rows (not a GGML type: this module's storage of Q6_K)
QINT_TYPES = frozenset({Q4_K, Q6_K_A})
# The GGML type of a file -> the type its blocks are held in for these kernels
ACT8_STORED = {Q4_K: Q4_K, Q6_K: Q6_K_A}

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
# gfx1151 (256 VGPRs a lane): the CUDA-core kernel with 32 rows a program builds without
# spills (64 spill 30-85 VGPRs)
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


def qint_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                   shape: tuple[int, int]) -> torch.Tensor:
    """The definition in float64: dequantize(blocks) (gguf-py) @ (dx * q).T; blocks in a
    GGML type or Q6_K_A."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    if ggml_type == Q6_K_A:
        blocks, ggml_type = unpack_q6k(blocks.reshape(shape[0], -1), shape[1]), Q6_K
    w = dequantize_reference(blocks.reshape(-1), ggml_type, tuple(shape), torch.float64)
    return dequantized_x_reference(x) @ w.t()


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


def mma_rows() -> int:
    """The most rows of x kernels/qint_mma.py's Gluon kernel takes: its MMA_ROWS, or fewer
    with MBUFO_QINT_MMA_ROWS (16: the rows past it on _qint_mm_kernel, as before its wider
    builds); a clear error for anything but a whole number."""
    raw = os.environ.get("MBUFO_QINT_MMA_ROWS", "").strip()
    if not raw:
        return qint_mma.MMA_ROWS
    if not raw.isdigit():
        raise ValueError(f"MBUFO_QINT_MMA_ROWS must be a whole number of rows, got {raw!r}")
    return min(int(raw), qint_mma.MMA_ROWS)


def mma_path(m: int, qtype: int, qtype2: int, backend: str, device: torch.device) -> bool:
    """Whether a matrix-unit launch runs kernels/qint_mma.py's Gluon kernel instead of
    _qint_mm_kernel (the same bits, 15-27% faster at the model's shapes at 16 rows on the
    H200, 12-43% at 64: bench/RESULTS.md, 2026-12-03): Q4_K or Q6_K_A alone or Q4_K's
    q|k with Q6_K_A's v, up to mma_rows() rows of x, on NVIDIA, with Gluon, unless
    MBUFO_QINT_MMA=0 or a tile is forced (the tuner and benches time _qint_mm_kernel's
    tiles)."""
    return (device.type == "cuda" and backend == "cuda"
            and (qtype in QINT_TYPES and not qtype2 or (qtype, qtype2) == (Q4_K, Q6_K_A))
            and m <= mma_rows() and qint_mma.HAS_GLUON
            and not tile_forced()
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
            not type2 or n1 % (16 * qint_mma.WARPS) == 0):
        return qint_mma.qint_mma_launch(
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
