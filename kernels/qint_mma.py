"""Q4_K and Q6_K times 8-bit x on NVIDIA's mma.sync for 5-64 rows of x (Gluon): every
operand copied asynchronously into shared memory one super-block ahead of the products.

The same sums, bits and storage as kernels/qint_mm.py's matrix-unit kernel (kernels/qint.py's
docstring is the definition; kernels/qint.py launches these in its place on NVIDIA). That kernel is
plain Triton: at 16 rows it waits on memory with few warps resident (ncu: 3.6 active and
0.4 eligible warps a scheduler, long-scoreboard stalls first), its loads issued where
their super-block's products begin. Here the layouts are explicit:
- a program (4 warps) owns 64 weight rows and all BM rows of x (16, 32 or 64: TILE_ROWS,
  the launch's rows rounded up; the text below counts 16); while it multiplies
  super-block i, the copies of super-block i + 1 are in flight (cp.async): the codes
  (64 x 128 bytes, 16 a thread), the 4 head words of each row, x's codes (16 x 256), its
  16-column sums and scales. Two stages in 28 KB of shared memory and 80 registers a thread
  leave 6 programs a multiprocessor (more stages, fewer programs: slower);
- each warp reads its m16n8k32 s8 fragments from shared memory (k_width 8: a fragment's
  two 4-byte runs as one 8-byte read; the same relabelling of k on both operands, so the
  integer dot is unchanged; 16- and 32-byte pieces swizzled by row so that a half warp's
  reads fall in distinct banks);
- Q4_K: per 32-column sub-block one s8 product each half of x's rows, times the
  sub-block's 6-bit scale (an integer multiply-add); the mins' sum one m16n8k16 f16
  product of (16 mins, each twice) and x's 16-column sums; then the two fmas of the
  definition. Rows of x past M repeat the last (their sums are not stored);
- Q6_K_A (ql, qh and the 16 int8 scales copied; d, in the row's tail, loaded one
  super-block ahead): the codes enter unsigned (0..63, four instructions a word), and x is
  copied twice, each copy zero-filled (by the copy's mask) outside one 16-column half of
  every 32-column run, so a run's two s8 products (one a sub-block) read their operand as
  stored; each times its int8 scale (read from shared memory as bytes in the
  accumulator's layout). The codes' offset, -32 x the scale x x's sub-block sum, is one
  f16 product of the scales and x's 16-column sums (integers under 2^24: exact),
  subtracted as an integer before isum's conversion: the definition's bits. 96 registers
  and 44 KB: 5 programs a multiprocessor;
- a layer's q|k (Q4_K) and v (Q6_K_A) in one launch: each tile runs its type's loop, the
  Q4_K one in the Q6_K one's shared memory (its head words in qh's).

H200, 16 rows, against qint's kernel (bench/RESULTS.md, 2026-12-01): Q4_K 35.2 against
44.5 us at 28672 x 4096, 22.4 / 26.7 at 14336 x 4096, 20.2 / 25.1 at 4096 x 14336, 12.7 /
16.1 at 6144 x 4096, 10.0 / 11.8 at 4096 x 4096, 6.3 / 6.2 at 1024 x 4096; Q6_K 29.0 /
35.7 at 4096 x 14336, 184.6 / 253.2 at 128256 x 4096, 7.5 / 7.7 at 1024 x 4096.

At 64 rows (uncapped: 183 registers and 55 KB a program on 4 warps, two programs a
multiprocessor): Q4_K 79.1 against 96.4 us at 28672 x 4096, 44.9 / 51.2 at 4096 x 14336,
23.9 / 26.9 at 4096 x 4096; Q6_K 65.0 / 98.8 at 4096 x 14336, 452 / 745 at 128256 x 4096;
the q|k + v pair 34.3 / 59.8 (bench/RESULTS.md, 2026-12-03). Q4_K's 64-row build now runs
under WIDE_Q4K_MAX_REGS (three programs a multiprocessor: 74.0 us at 28672 x 4096).

NVIDIA only (Gluon's NVMMA layouts, cp.async); gfx1151 keeps qint's kernel.
"""

from __future__ import annotations

import os
from typing import Any

from kernels.triton_util import HAS_TRITON

__all__ = ["FUSED_MAX_REGS", "HAS_GLUON", "MMA_ROWS", "STAGES", "TILE_ROWS", "WARPS",
           "aot_specs", "qint_mma_launch", "tile_rows"]

MMA_ROWS = 64  # the most rows of x a launch multiplies (a program takes them all)
TILE_ROWS = (16, 32, 64)  # the builds' rows of x (the mma.sync's n, in n8 pieces)
WARPS = 4  # a program's warps, 16 weight rows each
STAGES = 2  # super-blocks in shared memory: the one multiplied and the one in flight
# the two-type kernel's register cap at 16 rows: 126 uncapped (4 programs a
# multiprocessor), at 96 (5, as Q6_K's) 8 bytes spilled outside the loops (the row offsets
# kept for the finish); the wider builds are not capped (at 96: 112 and 416 bytes spilled)
FUSED_MAX_REGS = 96
# Q4_K's 64-row build capped: 164 registers instead of 183, nothing spilled, three programs
# a multiprocessor instead of two (its 56 KB of shared memory allow three). Q6_K's (97 KB:
# two programs by shared memory) and the two-type one's would spill. H200 (bench/RESULTS.md,
# 2026-12-03): gate|up 74.0 against 77.9 us uncapped, 64 streams 8104-8127 against
# 7944-8035 tok/s steady. MBUFO_QINT_MMA_CAP=0: uncapped.
WIDE_Q4K_MAX_REGS = 168

HAS_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

        HAS_GLUON = True
    except ImportError:  # a Triton without Gluon
        pass

if HAS_GLUON:
    # Triton helpers run inside Gluon kernels
    from kernels.qgemv import finish_splits
    from kernels.qint_gemv import _k4_six
    from kernels.qint_mm import _nibbles_i8, _q6_codes
    from kernels.qtiles import _f16lo
    from kernels.triton_util import await_inputs

    @gluon.jit
    def _issue_q4k(codes, heads, buf, c_src, h_src, sb, ok, cols, hrows):
        """Asynchronous copies of Q4_K super-block sb's weights into stage `buf`: the
        codes (BN, 128) and the 4 head words (BN,) each; nothing where not `ok` (past the
        split)."""
        on = ok.to(gl.int32)
        async_copy.async_copy_global_to_shared(codes.index(buf), c_src + sb * 144,
                                               mask=(cols < 128 * on)[None, :])
        for j in gl.static_range(4):
            async_copy.async_copy_global_to_shared(heads.index(buf * 4 + j),
                                                   h_src + (sb * 36 + j),
                                                   mask=hrows < hrows.shape[0] * on)

    @gluon.jit
    def _issue(codes, heads, xs, bss, dxs, buf, c_src, h_src, x_src, s_src, d_src, sb, ok,
               cols, hrows, xcols, scols, drows):
        """Asynchronous copies of super-block sb's operands into stage `buf`: the weights
        (_issue_q4k), x's codes (BM, 256), 16-column sums (BM, 16) and scales (BM,);
        nothing where not `ok` (past the split)."""
        _issue_q4k(codes, heads, buf, c_src, h_src, sb, ok, cols, hrows)
        on = ok.to(gl.int32)
        async_copy.async_copy_global_to_shared(xs.index(buf), x_src + sb * 256,
                                               mask=(xcols < 256 * on)[None, :])
        async_copy.async_copy_global_to_shared(bss.index(buf), s_src + sb * 16,
                                               mask=(scols < 16 * on)[None, :])
        async_copy.async_copy_global_to_shared(dxs.index(buf), d_src + sb,
                                               mask=drows < drows.shape[0] * on)

    @gluon.jit
    def _sb_staged(acc, codes, heads, buf, xs, bss, dxs, sub, zi, zf, A8: gl.constexpr,
                   B8: gl.constexpr, B16: gl.constexpr, ROW: gl.constexpr, COL: gl.constexpr,
                   FROW: gl.constexpr):
        """acc + one super-block from shared memory: codes (BN, 128), head words (stage
        `buf`'s 4 rows of BN), x's codes (BM, 256), 16-column sums (BM, 16), scales (BM,)."""
        w0 = heads.index(buf * 4).load(ROW)
        w1 = heads.index(buf * 4 + 1).load(ROW)
        w3 = heads.index(buf * 4 + 3).load(ROW)
        isum = zi
        for g in gl.static_range(4):
            lo, hi = _nibbles_i8(codes.slice(32 * g, 32, dim=1).load(A8), True)
            da = mma_v2(lo, xs.slice(64 * g, 32, dim=1).permute([1, 0]).load(B8), zi)
            db = mma_v2(hi, xs.slice(64 * g + 32, 32, dim=1).permute([1, 0]).load(B8), zi)
            isum += _k4_six(w1, w3, 2 * g, 0)[:, None] * da
            isum += _k4_six(w1, w3, 2 * g + 1, 0)[:, None] * db
        m2 = heads.index(buf * 4 + 2).load(FROW)[:, None]
        m3 = heads.index(buf * 4 + 3).load(FROW)[:, None]
        mins = _k4_six(m2, m3, sub, 4).to(gl.float16)
        msum = mma_v2(mins, bss.permute([1, 0]).load(B16), zf)
        dx = dxs.load(COL)[None, :]
        acc = gl.fma(isum.to(gl.float32), _f16lo(w0)[:, None] * dx, acc)
        return gl.fma(-msum, _f16lo(w0 >> 16)[:, None] * dx, acc)

    @gluon.constexpr_function
    def _mma_layout(warps, operand=None, k_width=None):
        """The mma.sync accumulator's layout (warps stacked along the weight rows, each
        16 x 8 a instruction) or, with `operand`, that operand's fragments'."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1],
                                        instr_shape=[16, 8])
        if operand is None:
            return mma
        return gl.DotOperandLayout(operand_index=operand, parent=mma, k_width=k_width)

    @gluon.jit
    def _x_sources(q_ptr, dx_ptr, bs_ptr, M, K, WARPS: gl.constexpr, BM: gl.constexpr):
        """The copies' sources in x (a super-block's offsets added by the issue): its codes
        (BM, 256), 16 bytes a thread; 16-column sums (BM, 16), 4 bytes; scales (BM,); rows
        past M repeat the last. Returned with the column (row) indices the masks use."""
        XL: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [WARPS, 1], [1, 0])
        HL: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        xr = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
        xcols = gl.arange(0, 256, layout=gl.SliceLayout(0, XL))
        x_src = q_ptr + (xr.to(gl.int64) * K)[:, None] + xcols[None, :]
        sr = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(1, SL)), M - 1)
        scols = gl.arange(0, 16, layout=gl.SliceLayout(0, SL))
        s_src = bs_ptr + (sr.to(gl.int64) * gl.multiple_of(K // 16, 16))[:, None] \
            + scols[None, :]
        drows = gl.arange(0, BM, layout=HL)
        d_src = dx_ptr + gl.minimum(drows, M - 1) * (K // 256)
        return x_src, xcols, s_src, scols, d_src, drows

    @gluon.jit
    def _q4k_sum(q_ptr, dx_ptr, bs_ptr, w_ptr, row0, n_rows, M, K, row_bytes, sb0,
                 sb_per_split, codes, heads, xs, bss, dxs, WARPS: gl.constexpr,
                 STAGES: gl.constexpr, PDL: gl.constexpr, BM: gl.constexpr):
        """The (16 WARPS, BM) sums of Q4_K rows row0 .. of n_rows (rows past it read row
        0) over super-blocks sb0 .. sb0 + sb_per_split - 1, the operands staged in the
        given shared memory (STAGES deep): codes (BN, 128) u8, heads (4 STAGES, BN) int32,
        xs (BM, 256) int8, bss (BM, 16) f16, dxs (BM,) f32, each with a leading STAGES."""
        BN: gl.constexpr = 16 * WARPS
        MMA: gl.constexpr = _mma_layout(WARPS)
        A8: gl.constexpr = _mma_layout(WARPS, 0, 8)  # s8 fragments (k relabelled, 8 bytes)
        B8: gl.constexpr = _mma_layout(WARPS, 1, 8)
        A16: gl.constexpr = _mma_layout(WARPS, 0, 2)  # f16 fragments
        B16: gl.constexpr = _mma_layout(WARPS, 1, 2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        FROW: gl.constexpr = gl.SliceLayout(1, A16)
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        HL: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        # the copies' sources: codes 16 bytes a thread, head words; x's (_x_sources)
        rc = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, CL))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, CL))
        c_src = w_ptr + (gl.where(rc < n_rows, rc, 0).to(gl.int64) * row_bytes)[:, None] + 16 \
            + cols[None, :]
        hrows = gl.arange(0, BN, layout=HL)
        rh = row0 + hrows
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        h_src = w32 + gl.where(rh < n_rows, rh, 0).to(gl.int64) * (row_bytes // 4)
        x_src, xcols, s_src, scols, d_src, drows = _x_sources(q_ptr, dx_ptr, bs_ptr, M, K,
                                                              WARPS, BM)
        jf = gl.arange(0, 16, layout=gl.SliceLayout(0, A16))
        sub = (jf // 2)[None, :]
        acc = gl.zeros((BN, BM), gl.float32, MMA)
        zi = gl.zeros((BN, BM), gl.int32, MMA)
        zf = gl.zeros((BN, BM), gl.float32, MMA)
        await_inputs(PDL)
        for s in gl.static_range(STAGES - 1):
            _issue(codes, heads, xs, bss, dxs, s, c_src, h_src, x_src, s_src, d_src, sb0 + s,
                   s < sb_per_split, cols, hrows, xcols, scols, drows)
            async_copy.commit_group()
        for i in range(0, sb_per_split):
            async_copy.wait_group(STAGES - 2)  # this thread's copies of super-block i
            gl.thread_barrier()  # everyone's; and the stage read last is free
            nxt = i + STAGES - 1
            _issue(codes, heads, xs, bss, dxs, nxt % STAGES, c_src, h_src, x_src, s_src, d_src,
                   sb0 + nxt, nxt < sb_per_split, cols, hrows, xcols, scols, drows)
            async_copy.commit_group()
            buf = i % STAGES
            acc = _sb_staged(acc, codes.index(buf), heads, buf, xs.index(buf), bss.index(buf),
                             dxs.index(buf), sub, zi, zf, A8, B8, B16, ROW, COL, FROW)
        async_copy.wait_group(0)
        return acc

    @gluon.jit
    def _q4k_smem(WARPS: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr):
        """_q4k_sum's shared memory: codes and x's codes swizzled (the fragments' 8-byte
        reads of a half warp in distinct banks), head words one row of BN a word."""
        BN: gl.constexpr = 16 * WARPS
        codes = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128],
                                          gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0]))
        heads = gl.allocate_shared_memory(gl.int32, [STAGES * 4, BN],
                                          gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        xs = gl.allocate_shared_memory(gl.int8, [STAGES, BM, 256],
                                       gl.SwizzledSharedLayout(32, 1, 8, order=[1, 0]))
        bss = gl.allocate_shared_memory(gl.float16, [STAGES, BM, 16],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        dxs = gl.allocate_shared_memory(gl.float32, [STAGES, BM],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        return codes, heads, xs, bss, dxs

    @gluon.jit
    def _finish(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, ticket,
                WARPS: gl.constexpr, BM: gl.constexpr):
        """Stores a program's sums (its tile pid_n of y's N columns) as
        qgemv.finish_splits."""
        MMA: gl.constexpr = _mma_layout(WARPS)
        cc = gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
        rr = pid_n * (16 * WARPS) + gl.arange(0, 16 * WARPS, layout=gl.SliceLayout(1, MMA))
        offs = cc.to(gl.int64)[None, :] * N + rr[:, None]
        finish_splits(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, offs,
                      (cc < M)[None, :] & (rr < N)[:, None], ticket)

    # M, N and the split are plain arguments (not specialized on their values): one build
    # serves every batch of up to BM rows and every split
    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit"])
    def _qint_mma_q4k_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, WARPS: gl.constexpr = 4, STAGES: gl.constexpr = 2,
        PDL: gl.constexpr = False, BM: gl.constexpr = 16,
    ):
        """y[m, n] for x's rows m < M (<= BM) and W's rows n; grid (N / (16 WARPS), nsplit),
        the splits' partials added in split order by the last program of a tile (as
        qgemv.finish_splits). Every operand of a super-block is copied asynchronously into
        shared memory, STAGES - 1 super-blocks ahead of the products."""
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        codes, heads, xs, bss, dxs = _q4k_smem(WARPS, STAGES, BM)
        acc = _q4k_sum(q_ptr, dx_ptr, bs_ptr, w_ptr, pid_n * 16 * WARPS, N, M, K, row_bytes,
                       split * sb_per_split, sb_per_split, codes, heads, xs, bss, dxs, WARPS,
                       STAGES, PDL, BM)
        _finish(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, ticket, WARPS,
                BM)

    @gluon.jit
    def _issue6(ql, qh, scb, xa, xb, bss, dxs, buf, l_src, h_src, b_src, x_src, s_src, d_src,
                sb, ok, lcols, hcols, bcols, xcols, scols, drows):
        """Asynchronous copies of Q6_K_A super-block sb's ql (BN, 128), qh (BN, 64) and 16
        scales (BN, 16), and of x's codes (BM, 256:
        into xa the first 16 columns of each 32, into xb the last 16, zeros elsewhere),
        16-column sums (BM, 16) and scales (BM,), into stage `buf`; nothing where not `ok`."""
        on = ok.to(gl.int32)
        async_copy.async_copy_global_to_shared(ql.index(buf), l_src + sb * 208,
                                               mask=(lcols < 128 * on)[None, :])
        async_copy.async_copy_global_to_shared(qh.index(buf), h_src + sb * 208,
                                               mask=(hcols < 64 * on)[None, :])
        async_copy.async_copy_global_to_shared(scb.index(buf), b_src + sb * 208,
                                               mask=(bcols < 16 * on)[None, :])
        first = (xcols % 32 < 16)[None, :]
        inside = (xcols < 256 * on)[None, :]
        async_copy.async_copy_global_to_shared(xa.index(buf), x_src + sb * 256,
                                               mask=first & inside)
        async_copy.async_copy_global_to_shared(xb.index(buf), x_src + sb * 256,
                                               mask=~first & inside)
        async_copy.async_copy_global_to_shared(bss.index(buf), s_src + sb * 16,
                                               mask=(scols < 16 * on)[None, :])
        async_copy.async_copy_global_to_shared(dxs.index(buf), d_src + sb,
                                               mask=drows < drows.shape[0] * on)

    @gluon.jit
    def _sb6_staged(acc, ql, qh, scb, xa, xb, bss, dxs, d, zi, zf, MMA: gl.constexpr,
                    A8: gl.constexpr, B8: gl.constexpr, A16: gl.constexpr, B16: gl.constexpr,
                    COL: gl.constexpr):
        """acc + one Q6_K_A super-block from shared memory, with its d (BN,): each 32-column
        run's unsigned codes (0..63) times xa's run (x's first 16 columns, zeros after) and
        xb's (zeros, then the last 16), two exact int32 products, each times its sub-block's
        int8 scale; minus 32 times the scales' f16 product with x's 16-column sums (exact
        integers under 2^24): the definition's isum, then its fma."""
        isum = zi
        for h in gl.static_range(2):
            qhf = qh.slice(32 * h, 32, dim=1).load(A8)
            lo = ql.slice(64 * h, 32, dim=1).load(A8)
            hi = ql.slice(64 * h + 32, 32, dim=1).load(A8)
            for j in gl.static_range(4):
                if j % 2 == 0:
                    code = _q6_codes(lo, qhf, j, True, False)
                else:
                    code = _q6_codes(hi, qhf, j, True, False)
                da = mma_v2(code, xa.slice(128 * h + 32 * j, 32, dim=1).permute([1, 0]).load(B8),
                            zi)
                db = mma_v2(code, xb.slice(128 * h + 32 * j, 32, dim=1).permute([1, 0]).load(B8),
                            zi)
                sa = scb.slice(8 * h + 2 * j, 1, dim=1).load(MMA).to(gl.int32)  # (BN, 1)
                sbb = scb.slice(8 * h + 2 * j + 1, 1, dim=1).load(MMA).to(gl.int32)
                isum += sa * da
                isum += sbb * db
        scales = scb.load(A16).to(gl.float16)  # (BN, 16) int8, exact in f16
        corr = mma_v2(scales, bss.permute([1, 0]).load(B16), zf)  # sum of sc_s x's sums
        isum -= 32 * corr.to(gl.int32)
        dx = dxs.load(COL)[None, :]
        return gl.fma(isum.to(gl.float32), d[:, None] * dx, acc)

    @gluon.jit
    def _q6k_sum(q_ptr, dx_ptr, bs_ptr, w_ptr, row0, n_rows, M, K, row_bytes, sb0,
                 sb_per_split, ql, qh, scb, xa, xb, bss, dxs, WARPS: gl.constexpr,
                 STAGES: gl.constexpr, PDL: gl.constexpr, BM: gl.constexpr):
        """_q4k_sum for Q6_K_A rows (kernels/qint.py's storage): ql, qh and the scales of
        a super-block copied asynchronously with x's codes (twice, each half of a run
        beside zeros), 16-column sums and scales into ql (BN, 128) u8, qh (BN, 64) u8, scb
        (BN, 16) int8, xa and xb (BM, 256) int8, bss, dxs; d (in the row's tail) loaded one
        super-block ahead into registers."""
        BN: gl.constexpr = 16 * WARPS
        MMA: gl.constexpr = _mma_layout(WARPS)
        A8: gl.constexpr = _mma_layout(WARPS, 0, 8)  # s8 fragments (k relabelled, 8 bytes)
        B8: gl.constexpr = _mma_layout(WARPS, 1, 8)
        A16: gl.constexpr = _mma_layout(WARPS, 0, 2)  # f16 fragments
        B16: gl.constexpr = _mma_layout(WARPS, 1, 2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        LL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        QL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [WARPS, 1], [1, 0])
        nsb = K // 256
        # the copies' sources: ql and qh 16 bytes a thread, the scales 8; x's (_x_sources)
        rl = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LL))
        lcols = gl.arange(0, 128, layout=gl.SliceLayout(0, LL))
        l_src = w_ptr + (gl.where(rl < n_rows, rl, 0).to(gl.int64) * row_bytes)[:, None] \
            + lcols[None, :]
        rq = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, QL))
        hcols = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
        h_src = w_ptr + (gl.where(rq < n_rows, rq, 0).to(gl.int64) * row_bytes)[:, None] \
            + 128 + hcols[None, :]
        rb = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, BL))
        bcols = gl.arange(0, 16, layout=gl.SliceLayout(0, BL))
        b_src = w_ptr.to(gl.pointer_type(gl.int8), bitcast=True) + \
            (gl.where(rb < n_rows, rb, 0).to(gl.int64) * row_bytes)[:, None] + 192 \
            + bcols[None, :]
        x_src, xcols, s_src, scols, d_src, drows = _x_sources(q_ptr, dx_ptr, bs_ptr, M, K,
                                                              WARPS, BM)
        rr = row0 + gl.arange(0, BN, layout=ROW)
        w16 = w_ptr.to(gl.pointer_type(gl.uint16), bitcast=True)
        dw = w16 + (gl.where(rr < n_rows, rr, 0).to(gl.int64) * row_bytes + nsb * 208) // 2
        acc = gl.zeros((BN, BM), gl.float32, MMA)
        zi = gl.zeros((BN, BM), gl.int32, MMA)
        zf = gl.zeros((BN, BM), gl.float32, MMA)
        await_inputs(PDL)
        for s in gl.static_range(STAGES - 1):
            _issue6(ql, qh, scb, xa, xb, bss, dxs, s, l_src, h_src, b_src, x_src, s_src, d_src,
                    sb0 + s, s < sb_per_split, lcols, hcols, bcols, xcols, scols, drows)
            async_copy.commit_group()
        d = gl.load(dw + sb0).to(gl.float16, bitcast=True).to(gl.float32)
        for i in range(0, sb_per_split):
            nxt_d = gl.load(dw + sb0 + gl.minimum(i + 1, sb_per_split - 1)).to(
                gl.float16, bitcast=True).to(gl.float32)
            async_copy.wait_group(STAGES - 2)  # this thread's copies of super-block i
            gl.thread_barrier()  # everyone's; and the stage read last is free
            nxt = i + STAGES - 1
            _issue6(ql, qh, scb, xa, xb, bss, dxs, nxt % STAGES, l_src, h_src, b_src, x_src,
                    s_src, d_src, sb0 + nxt, nxt < sb_per_split, lcols, hcols, bcols, xcols,
                    scols, drows)
            async_copy.commit_group()
            buf = i % STAGES
            acc = _sb6_staged(acc, ql.index(buf), qh.index(buf), scb.index(buf), xa.index(buf),
                              xb.index(buf), bss.index(buf), dxs.index(buf), d, zi, zf, MMA, A8,
                              B8, A16, B16, COL)
            d = nxt_d
        async_copy.wait_group(0)
        return acc

    @gluon.jit
    def _q6k_smem(WARPS: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr):
        """_q6k_sum's shared memory (ql, qh, scb, xa, xb, bss, dxs)."""
        BN: gl.constexpr = 16 * WARPS
        ql = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128],
                                       gl.SwizzledSharedLayout(16, 1, 8, order=[1, 0]))
        qh = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 64],
                                       gl.SwizzledSharedLayout(16, 1, 4, order=[1, 0]))
        scb = gl.allocate_shared_memory(gl.int8, [STAGES, BN, 16],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        xa = gl.allocate_shared_memory(gl.int8, [STAGES, BM, 256],
                                       gl.SwizzledSharedLayout(32, 1, 8, order=[1, 0]))
        xb = gl.allocate_shared_memory(gl.int8, [STAGES, BM, 256],
                                       gl.SwizzledSharedLayout(32, 1, 8, order=[1, 0]))
        bss = gl.allocate_shared_memory(gl.float16, [STAGES, BM, 16],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        dxs = gl.allocate_shared_memory(gl.float32, [STAGES, BM],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        return ql, qh, scb, xa, xb, bss, dxs

    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit"])
    def _qint_mma_q6k_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, WARPS: gl.constexpr = 4, STAGES: gl.constexpr = 2,
        PDL: gl.constexpr = False, BM: gl.constexpr = 16,
    ):
        """_qint_mma_q4k_kernel for Q6_K_A rows."""
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        ql, qh, scb, xa, xb, bss, dxs = _q6k_smem(WARPS, STAGES, BM)
        acc = _q6k_sum(q_ptr, dx_ptr, bs_ptr, w_ptr, pid_n * 16 * WARPS, N, M, K, row_bytes,
                       split * sb_per_split, sb_per_split, ql, qh, scb, xa, xb, bss, dxs, WARPS,
                       STAGES, PDL, BM)
        _finish(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, ticket, WARPS,
                BM)

    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit", "n1"])
    def _qint_mma_q4k_q6k_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, w2_ptr, n1, row_bytes2, WARPS: gl.constexpr = 4,
        STAGES: gl.constexpr = 2, PDL: gl.constexpr = False, BM: gl.constexpr = 16,
    ):
        """Q4_K rows (w_ptr, the first n1 of y's N columns, n1 a multiple of 16 WARPS) and
        Q6_K_A rows (w2_ptr, the rest) in one launch (a layer's q|k and v), each tile
        as its type's kernel. Q4_K's buffers are Q6_K's (its head words in qh's)."""
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        ql, qh, scb, xa, xb, bss, dxs = _q6k_smem(WARPS, STAGES, BM)
        row0 = pid_n * 16 * WARPS
        if row0 >= n1:
            acc = _q6k_sum(q_ptr, dx_ptr, bs_ptr, w2_ptr, row0 - n1, N - n1, M, K, row_bytes2,
                           split * sb_per_split, sb_per_split, ql, qh, scb, xa, xb, bss, dxs,
                           WARPS, STAGES, PDL, BM)
        else:
            heads = qh._reinterpret(gl.int32, [STAGES * 4, 16 * WARPS],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            acc = _q4k_sum(q_ptr, dx_ptr, bs_ptr, w_ptr, row0, n1, M, K, row_bytes,
                           split * sb_per_split, sb_per_split, ql, heads, xa, bss, dxs, WARPS,
                           STAGES, PDL, BM)
        _finish(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, ticket, WARPS,
                BM)


def tile_rows(m: int) -> int:
    """The build (TILE_ROWS) whose rows of x hold `m` (<= MMA_ROWS): a program multiplies
    all of them, past m repeating the last."""
    for rows in TILE_ROWS:
        if m <= rows:
            return rows
    raise ValueError(f"qint_mma: at most {MMA_ROWS} rows of x, got {m}")


def max_regs_of(rows: int, q6: bool, fused: bool) -> int | None:
    """The register cap a thread of the build at `rows` rows of x (None: none): the
    two-type kernel's FUSED_MAX_REGS at 16 rows, Q4_K's WIDE_Q4K_MAX_REGS at 64."""
    if fused:
        return FUSED_MAX_REGS if rows == 16 else None
    if not q6 and rows == 64 and os.environ.get("MBUFO_QINT_MMA_CAP", "").strip() != "0":
        return WIDE_Q4K_MAX_REGS
    return None


def qint_mma_launch(xq: Any, blocks: Any, n: int, k: int, split: int, tickets: Any = None, *,
                    q6: bool = False, second: tuple[Any, int] | None = None, launch: Any = None,
                    warps: int = WARPS, stages: int = STAGES,
                    max_regs: int | None = None) -> Any:
    """y (M, n) float32 = xq's rows (M <= MMA_ROWS, a QuantX) times the Q4_K rows `blocks`
    (n, k / 256 * 144; `q6`: Q6_K_A rows, kernels/qint.py's row_bytes; `second`: (Q6_K_A
    rows, n1): `blocks` holds the first n1 of the n rows in Q4_K, a multiple of 16 warps,
    and these the rest): `split` ranges of super-blocks, their partials added by the last
    program of each tile where `tickets` (qgemv's counters) are given and count enough
    tiles (n / (16 warps)), else by qmatmul.sum_splits. `launch` maps the kernel to what to
    launch (kernels/triton_util.launcher: the PDL launch in captures). `max_regs`: a
    register cap a thread (None: max_regs_of's)."""
    import torch

    m = xq.q.shape[0]
    rows = tile_rows(m)
    y = torch.empty(m, n, dtype=torch.float32, device=xq.q.device)
    tiles = -(-n // (16 * warps))
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    use_ticket = tickets is not None and split > 1 and tiles <= tickets.numel()
    extra: dict[str, Any] = {}
    if second is not None:
        blocks2, n1 = second
        if n1 % (16 * warps) or not 0 < n1 < n:
            raise ValueError(f"qint_mma: the Q4_K part's {n1} rows must be a multiple of "
                             f"{16 * warps} below {n}")
        kernel = _qint_mma_q4k_q6k_kernel
        extra = {"w2_ptr": blocks2, "n1": n1, "row_bytes2": blocks2.shape[1]}
    else:
        kernel = _qint_mma_q6k_kernel if q6 else _qint_mma_q4k_kernel
    cap = max_regs or max_regs_of(rows, q6, second is not None)
    if cap:
        extra["maxnreg"] = cap
    kernel = launch(kernel) if launch else kernel
    kernel[(tiles, split)](*xq, blocks, y, part, tickets if use_ticket else y, m, n, k,
                           blocks.shape[1], k // 256 // split, split, int(use_ticket),
                           WARPS=warps, STAGES=stages, BM=rows, num_warps=warps, **extra)
    if split > 1 and not use_ticket:
        from kernels.qmatmul import sum_splits

        sum_splits(part, y)
    return y

def aot_specs(spec: type) -> list:
    """kernels/aot.py: the kernel at its launch configuration, plain and as a programmatic
    dependent launch, for cuda:90 only (NVMMA layouts)."""
    if not HAS_GLUON:
        return []
    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*fp16", "w_ptr": "*u8",
           "y_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "row_bytes": "i32", "sb_per_split": "i32", "nsplit": "i32",
           "ticket": "i32", "WARPS": "constexpr", "STAGES": "constexpr", "PDL": "constexpr"}
    divisible = ("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr", "part_ptr", "ticket_ptr", "K",
                 "row_bytes")
    fused = {**sig, "w2_ptr": "*u8", "n1": "i32", "row_bytes2": "i32"}
    fused = {**{k: v for k, v in fused.items() if v != "constexpr"},
             **{k: v for k, v in fused.items() if v == "constexpr"}}  # the kernel's order
    sig["BM"] = fused["BM"] = "constexpr"
    # the 16-row builds plain and as programmatic dependent launches; the wider ones as
    # the engine launches them (PDL)
    return [spec(f"qint_mma_{name}{'' if rows == 16 else f'_m{rows}'}{'_pdl' if pdl else ''}"
                 "_tiled", kernel, s, {"WARPS": WARPS, "STAGES": STAGES, "PDL": pdl, "BM": rows},
                 WARPS, True, "cuda", None, divisible + extra,
                 max_regs_of(rows, name == "Q6_K", name == "Q4_K_Q6_K"))
            for name, kernel, s, extra in (
                ("Q4_K", _qint_mma_q4k_kernel, sig, ()),
                ("Q6_K", _qint_mma_q6k_kernel, sig, ()),
                ("Q4_K_Q6_K", _qint_mma_q4k_q6k_kernel, fused, ("w2_ptr", "row_bytes2")))
            for rows in TILE_ROWS for pdl in ((False, True) if rows == 16 else (True,))]
