"""qint's matrix-unit kernel: Q4_K and Q6_K_A rows times many rows of 8-bit x in tiles
(kernels/qint.py's docstring is the definition; it launches this kernel), and the choice
of tile.

The int8 path (wgmma/mma s8 on NVIDIA, WMMA iu8 on RDNA): a sub-block's codes (Q4_K
0..15, Q6_K's q - 32) times x's codes is an exact int32 dot, times the sub-block's
integer scale; the mins' sums of Q4_K one f16 dot of integers (exact). On NVIDIA the codes
are unpacked four to a word (PTX), elsewhere byte by byte; the same values. Rows of x past
M repeat the last row (their sums are not stored): no masks on x's loads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from kernels.qscaled import _sub_dot
from kernels.qtiles import Q4_K, _f16, _f16lo
from kernels.triton_util import HAS_TRITON, await_inputs, helper, tl, triton

__all__ = ["TILE_BOUNDS", "TILE_CANDIDATES", "TILED_MAX_REGS", "TUNED_TILES",
           "compile_options", "forced_tile", "tile_bound", "tile_forced", "tile_options",
           "tiled_tile", "x_masks"]

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
# gfx1151: the int8 kernel builds without spills for both types at 16 x 32, 16 x 64 and
# 32 x 32 with one stage (32 x 64: 21 / 76 VGPRs spilled, 64 x 64: 102 / 146); the
# load-time tuner (engine/tile_tune.py) times those on the box.
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


def tile_forced() -> bool:
    """Whether this thread's matrix-unit launches take a forced tile (forced_tile)."""
    return bool(getattr(_FORCED, "stack", None))


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



if HAS_TRITON:
    from kernels.qgemv import finish_splits
    from kernels.qint_gemv import _col, _k4_head_words, _k4_six, _keep, _stream, _words_at

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
    def _k4_head(w_ptr, blk):
        """_k4_head_words of the super-blocks at byte offsets blk (BN,)."""
        j = tl.arange(0, 4)[None, :]
        return _k4_head_words(_stream(_words_at(w_ptr, blk)[:, None] + j))

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
