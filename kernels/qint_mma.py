"""Q4_K times 8-bit x on NVIDIA's mma.sync, operands loaded straight into registers
(Gluon): an experiment towards a faster 9-16-row product; the engine does not call it.

The same sums, bits and storage as kernels/qint.py's matrix-unit kernel (its docstring is
the definition), for up to 16 rows of x. That kernel is plain Triton: the compiler loads
the weight codes and x's codes in a blocked layout and moves both through shared memory
into the operand layout, with barriers around each 32-column dot. Here the layouts are
explicit: each thread loads the weight bytes its m16n8k32 fragment holds (k_width 8: the
fragment's two 4-byte runs are one 8-byte load, the same relabelling of k on both
operands, so the integer dot is unchanged), and x's codes are staged in shared memory
eight super-blocks at a time (XSMEM; else read from global memory like the weights).

A warp owns RPW (16 or 32) weight rows and all 16 rows of x: per 32-column sub-block one
s8 product each half of x's rows, times the sub-block's 6-bit scale (an integer
multiply-add); the mins' sum one m16n8k16 f16 product of (16 mins, each twice) and x's
16-column sums; then the two fmas of the definition. UNROLL 2 loads two super-blocks'
weights before the first one's products. Rows of x past M repeat the last.

Measured on the H200 (bench/RESULTS.md, 2026-12-01, bench/gpu/qint_mma_bench.py), at 16
rows against qint's kernel: bit-identical at 9 and 16 rows; 4096 x 4096 10.2 against 11.8
us, 6144 x 4096 13.2 against 16.4, 28672 x 4096 44.4 against 46.7, 14336 x 4096 25.8
against 27.2, 4096 x 14336 24.4 against 25.1, 1024 x 4096 6.5 against 6.2. Taking the
latencies out (the same addresses every super-block, results wrong) shows where the
rest goes, at 28672 x 4096 one super-block at a time, x read from global memory: 62.7 us
as is, 40.9 with the weights always cached, 43.7 with x always cached, 17.0 with both: the
products themselves would take 3.9 TB/s; what is missing is enough weight bytes in flight
(a pipeline of asynchronous copies, several super-blocks ahead).

NVIDIA only (Gluon's NVMMA layouts).
"""

from __future__ import annotations

from kernels.triton_util import HAS_TRITON

__all__ = ["HAS_GLUON", "MMA_ROWS"]

MMA_ROWS = 16  # rows of x a program multiplies: the mma.sync's n (two n8 halves)

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

    @gluon.jit
    def _nibbles(byte):
        """u8 code bytes -> low and high nibbles as int8, four a word (PTX)."""
        lo = gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [byte],
                                       dtype=gl.int8, is_pure=True, pack=4)
        hi = gl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r", [byte],
            dtype=gl.int8, is_pure=True, pack=4)
        return lo, hi

    @gluon.jit
    def _six(wa, w3, S: gl.constexpr, NIB: gl.constexpr):
        """The 6-bit scale (wa = head word 1, NIB 0) or min (word 2, NIB 4) of sub-block S."""
        if S < 4:
            out = (wa >> (8 * S)) & 63
        else:
            out = ((w3 >> (8 * (S - 4) + NIB)) & 15) | (((wa >> (8 * (S - 4) + 6)) & 3) << 4)
        return out

    @gluon.jit
    def _six_t(wa, w3, s, NIB: gl.constexpr):
        """_six for sub-blocks s given as a tensor."""
        sh = 8 * (s % 4)
        return gl.where(s >= 4, ((w3 >> (sh + NIB)) & 15) | (((wa >> (sh + 6)) & 3) << 4),
                        (wa >> sh) & 63)

    @gluon.jit
    def _f16lo(w):
        return (w & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)


    @gluon.jit
    def _load_q4k(w_ptr, w32, a_off, h_off, f_off, sb):
        """Super-block sb's code bytes (four (BN, 32) groups, A fragments) and head words
        (d | dmin, scales, in the accumulator's rows; the mins' words in the f16 A
        fragment's rows)."""
        base = w_ptr + a_off + sb * 144
        c0 = gl.load(base)
        c1 = gl.load(base + 32)
        c2 = gl.load(base + 64)
        c3 = gl.load(base + 96)
        hp = w32 + (h_off + sb * 144) // 4
        fp = w32 + (f_off + sb * 144) // 4
        return (c0, c1, c2, c3, gl.load(hp), gl.load(hp + 1), gl.load(hp + 3), gl.load(fp + 2),
                gl.load(fp + 3))

    @gluon.jit
    def _x_frag(x_sb, xs, OFF: gl.constexpr, B8: gl.constexpr, XSMEM: gl.constexpr):
        """x's codes of the 32 columns at OFF of the super-block (32, BM), B fragments: from
        the staged super-block xs (BM, padded columns) in shared memory, or global x_sb."""
        if XSMEM:
            out = xs.slice(OFF, 32, dim=1).permute([1, 0]).load(B8)
        else:
            out = gl.load(x_sb + OFF)
        return out

    @gluon.jit
    def _group(byte, x_sb, xs, w1, w3, G: gl.constexpr, isum, zi, B8: gl.constexpr,
               XSMEM: gl.constexpr):
        """isum + the two 32-column sub-blocks 2G, 2G + 1 (the low and high nibbles of
        group G's bytes) times x's codes, each times its scale."""
        lo, hi = _nibbles(byte)
        da = mma_v2(lo, _x_frag(x_sb, xs, 64 * G, B8, XSMEM), zi)
        db = mma_v2(hi, _x_frag(x_sb, xs, 64 * G + 32, B8, XSMEM), zi)
        isum += _six(w1, w3, 2 * G, 0).to(gl.int32)[:, None] * da
        return isum + _six(w1, w3, 2 * G + 1, 0).to(gl.int32)[:, None] * db

    @gluon.jit
    def _sb_q4k(acc, c0, c1, c2, c3, w0, w1, w3, m2, m3, sb, x_ptrs, xs, s_ptrs, dx_ptrs, sub,
                zi, zf, B8: gl.constexpr, XSMEM: gl.constexpr):
        """acc + super-block sb (its loaded words) times x: the definition's two fmas."""
        x_sb = x_ptrs + sb * 256
        isum = _group(c0, x_sb, xs, w1, w3, 0, zi, zi, B8, XSMEM)
        isum = _group(c1, x_sb, xs, w1, w3, 1, isum, zi, B8, XSMEM)
        isum = _group(c2, x_sb, xs, w1, w3, 2, isum, zi, B8, XSMEM)
        isum = _group(c3, x_sb, xs, w1, w3, 3, isum, zi, B8, XSMEM)
        mins = _six_t(m2[:, None], m3[:, None], sub, 4).to(gl.float16)
        msum = mma_v2(mins, gl.load(s_ptrs + sb * 16).to(gl.float16), zf)
        dx = gl.load(dx_ptrs + sb)[None, :]
        acc = gl.fma(isum.to(gl.float32), _f16lo(w0)[:, None] * dx, acc)
        return gl.fma(-msum, _f16lo(w0 >> 16)[:, None] * dx, acc)

    @gluon.jit
    def _finish(acc, cc, rr, y_ptr, part_ptr, ticket_ptr, M, N, split, nsplit, ticket, pid_n):
        """Stores a program's sums as qgemv.finish_splits: into y unsplit, else into its
        split's partials, the last of the tile's programs adding them in split order."""
        offs = cc.to(gl.int64)[None, :] * N + rr[:, None]
        mask = (cc < M)[None, :] & (rr < N)[:, None]
        if nsplit == 1:
            gl.store(y_ptr + offs, acc, mask=mask)
        else:
            plane = M.to(gl.int64) * N
            gl.store(part_ptr + split * plane + offs, acc, mask=mask)
            if ticket != 0:
                gl.thread_barrier()
                arrived = gl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == nsplit - 1:
                    total = gl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    for s in range(1, nsplit):
                        total += gl.load(part_ptr + s * plane + offs, mask=mask, other=0.0,
                                         cache_modifier=".cg")
                    gl.store(y_ptr + offs, total, mask=mask)
                    gl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")


    @gluon.jit
    def _tile_q4k(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K,
                  row_bytes, sb_per_split, nsplit, ticket, pid_n, split, x_smem,
                  WARPS: gl.constexpr, RPW: gl.constexpr, KW: gl.constexpr,
                  UNROLL: gl.constexpr, XSMEM: gl.constexpr):
        """One work item: W's rows of tile pid_n times x over split `split`'s super-blocks,
        stored (finish)."""
        BN: gl.constexpr = RPW * WARPS
        BM: gl.constexpr = 16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        A8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
        B8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
        A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        nsb = K // 256
        # weight codes (BN, 32) in the s8 A fragment's layout
        ra = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, A8))
        ka = gl.arange(0, 32, layout=gl.SliceLayout(0, A8))
        a_off = (gl.where(ra < N, ra, 0).to(gl.int64) * row_bytes)[:, None] + 16 + ka[None, :]
        # x's codes (32, BM) in the B fragment's layout
        kb = gl.arange(0, 32, layout=gl.SliceLayout(1, B8))
        nb = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(0, B8)), M - 1)
        b_off = (nb.to(gl.int64) * K)[None, :] + kb[:, None]
        # the heads of the accumulator's rows
        rr = pid_n * BN + gl.arange(0, BN, layout=ROW)
        h_off = gl.where(rr < N, rr, 0).to(gl.int64) * row_bytes
        # the mins (BN, 16) in the f16 A fragment's layout, x's 16-column sums (16, BM)
        rf = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, A16))
        f_off = gl.where(rf < N, rf, 0).to(gl.int64) * row_bytes
        jf = gl.arange(0, 16, layout=gl.SliceLayout(0, A16))
        sub = (jf // 2)[None, :]
        js = gl.arange(0, 16, layout=gl.SliceLayout(1, B16))
        ns = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(0, B16)), M - 1)
        s_off = (ns.to(gl.int64) * gl.multiple_of(K // 16, 16))[None, :] + js[:, None]
        cc = gl.arange(0, BM, layout=COL)
        cx = gl.minimum(cc, M - 1)
        w32 = w_ptr.to(gl.pointer_type(gl.uint32), bitcast=True)
        acc = gl.zeros((BN, BM), gl.float32, MMA)
        zi = gl.zeros((BN, BM), gl.int32, MMA)
        zf = gl.zeros((BN, BM), gl.float32, MMA)
        sb0 = split * sb_per_split
        # x's codes staged XSB super-blocks at a time, 32-byte pieces swizzled by row: the
        # B fragments' 8-byte reads of a half warp fall in distinct banks
        XSB: gl.constexpr = 8
        XL: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
        xs_r = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
        xs_c = gl.arange(0, 256, layout=gl.SliceLayout(0, XL))
        x_off2 = (xs_r.to(gl.int64) * K)[:, None] + xs_c[None, :]
        for c in range(0, sb_per_split, XSB):
            cnt = gl.minimum(sb_per_split - c, XSB)
            if XSMEM:
                gl.thread_barrier()  # the last chunk's reads are done
                for j in gl.static_range(XSB):
                    if j < cnt:
                        x_smem.index(j).store(gl.load(q_ptr + (sb0 + c + j) * 256 + x_off2))
                gl.thread_barrier()
            # UNROLL super-blocks' weights are loaded before the first one's products
            for i in range(0, cnt, UNROLL):
                sb = sb0 + c + i
                c0, c1, c2, c3, w0, w1, w3, m2, m3 = _load_q4k(w_ptr, w32, a_off, h_off,
                                                                f_off, sb)
                if UNROLL == 2:
                    two = (i + 1 < cnt).to(gl.int32)
                    n0, n1, n2, n3, v0, v1, v3, k2, k3 = _load_q4k(w_ptr, w32, a_off, h_off,
                                                                    f_off, sb + two)
                acc = _sb_q4k(acc, c0, c1, c2, c3, w0, w1, w3, m2, m3, sb, q_ptr + b_off,
                              x_smem.index(i), bs_ptr + s_off, dx_ptr + cx * nsb, sub, zi, zf,
                              B8, XSMEM)
                if UNROLL == 2:  # unconditional (a branch would take the loads in); an odd
                    # count's last pair multiplies its super-block twice and keeps one
                    acc2 = _sb_q4k(acc, n0, n1, n2, n3, v0, v1, v3, k2, k3, sb + two,
                                   q_ptr + b_off, x_smem.index(i + two), bs_ptr + s_off,
                                   dx_ptr + cx * nsb, sub, zi, zf, B8, XSMEM)
                    acc = gl.where(two != 0, acc2, acc)
        _finish(acc, cc, rr, y_ptr, part_ptr, ticket_ptr, M, N, split, nsplit, ticket, pid_n)

    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit", "tiles"])
    def _qint_mma_q4k_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, tiles, WARPS: gl.constexpr, RPW: gl.constexpr = 16,
        KW: gl.constexpr = 8, UNROLL: gl.constexpr = 2, XSMEM: gl.constexpr = True,
        PERSIST: gl.constexpr = False,
    ):
        """y[m, n] for x's rows m < M (<= 16) and W's rows n: the work items (N tile,
        split) as grid (tiles, nsplit), or PERSIST: each program takes every grid-th item
        (the items split-major); the splits' partials added in split order by the last
        program of a tile (as qgemv.finish_splits)."""
        x_smem = gl.allocate_shared_memory(gl.int8, [8, 16, 256],
                                           gl.SwizzledSharedLayout(32, 1, 8, order=[1, 0]))
        if PERSIST:
            for w in range(gl.program_id(0), tiles * nsplit, gl.num_programs(0)):
                _tile_q4k(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K,
                          row_bytes, sb_per_split, nsplit, ticket, w % tiles, w // tiles,
                          x_smem, WARPS, RPW, KW, UNROLL, XSMEM)
        else:
            _tile_q4k(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K,
                      row_bytes, sb_per_split, nsplit, ticket, gl.program_id(0),
                      gl.program_id(1), x_smem, WARPS, RPW, KW, UNROLL, XSMEM)
    @gluon.jit
    def _issue(codes, heads, xs, bss, dxs, buf, c_src, h_src, x_src, s_src, d_src, sb, ok,
               cols, hrows, xcols, scols, drows):
        """Asynchronous copies of super-block sb's operands into stage `buf`: the codes
        (BN, 128), the 4 head words (BN,) each, x's codes (BM, 256), 16-column sums
        (BM, 16) and scales (BM,); nothing where not `ok` (past the split)."""
        on = ok.to(gl.int32)
        async_copy.async_copy_global_to_shared(codes.index(buf), c_src + sb * 144,
                                               mask=(cols < 128 * on)[None, :])
        for j in gl.static_range(4):
            async_copy.async_copy_global_to_shared(heads.index(buf * 4 + j),
                                                   h_src + (sb * 36 + j),
                                                   mask=hrows < hrows.shape[0] * on)
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
            lo, hi = _nibbles(codes.slice(32 * g, 32, dim=1).load(A8))
            da = mma_v2(lo, xs.slice(64 * g, 32, dim=1).permute([1, 0]).load(B8), zi)
            db = mma_v2(hi, xs.slice(64 * g + 32, 32, dim=1).permute([1, 0]).load(B8), zi)
            isum += _six(w1, w3, 2 * g, 0).to(gl.int32)[:, None] * da
            isum += _six(w1, w3, 2 * g + 1, 0).to(gl.int32)[:, None] * db
        m2 = heads.index(buf * 4 + 2).load(FROW)[:, None]
        m3 = heads.index(buf * 4 + 3).load(FROW)[:, None]
        mins = _six_t(m2, m3, sub, 4).to(gl.float16)
        msum = mma_v2(mins, bss.permute([1, 0]).load(B16), zf)
        dx = dxs.load(COL)[None, :]
        acc = gl.fma(isum.to(gl.float32), _f16lo(w0)[:, None] * dx, acc)
        return gl.fma(-msum, _f16lo(w0 >> 16)[:, None] * dx, acc)

    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit"])
    def _qint_mma_q4k_async_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, WARPS: gl.constexpr, RPW: gl.constexpr = 16,
        STAGES: gl.constexpr = 3,
    ):
        """_qint_mma_q4k_kernel with every operand of a super-block (weights, x's codes,
        sums and scales) copied asynchronously into shared memory, STAGES - 1 super-blocks
        ahead of the products."""
        BN: gl.constexpr = RPW * WARPS
        BM: gl.constexpr = 16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        A8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B16: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)
        FROW: gl.constexpr = gl.SliceLayout(1, A16)
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        HL: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        XL: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [WARPS, 1], [1, 0])
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        nsb = K // 256
        sb0 = split * sb_per_split
        # the copies' sources: codes 16 bytes a thread, head words, x's codes 16 bytes a
        # thread, sums 4 bytes, scales
        rc = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, CL))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, CL))
        c_src = w_ptr + (gl.where(rc < N, rc, 0).to(gl.int64) * row_bytes)[:, None] + 16 \
            + cols[None, :]
        hrows = gl.arange(0, BN, layout=HL)
        rh = pid_n * BN + hrows
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        h_src = w32 + gl.where(rh < N, rh, 0).to(gl.int64) * (row_bytes // 4)
        xr = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
        xcols = gl.arange(0, 256, layout=gl.SliceLayout(0, XL))
        x_src = q_ptr + (xr.to(gl.int64) * K)[:, None] + xcols[None, :]
        sr = gl.minimum(gl.arange(0, BM, layout=gl.SliceLayout(1, SL)), M - 1)
        scols = gl.arange(0, 16, layout=gl.SliceLayout(0, SL))
        s_src = bs_ptr + (sr.to(gl.int64) * gl.multiple_of(K // 16, 16))[:, None] \
            + scols[None, :]
        drows = gl.arange(0, BM, layout=HL)
        d_src = dx_ptr + gl.minimum(drows, M - 1) * nsb
        # stages: codes and x's codes swizzled (the fragments' 8-byte reads of a half warp
        # in distinct banks), head words one row of BN a word
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
        jf = gl.arange(0, 16, layout=gl.SliceLayout(0, A16))
        sub = (jf // 2)[None, :]
        acc = gl.zeros((BN, BM), gl.float32, MMA)
        zi = gl.zeros((BN, BM), gl.int32, MMA)
        zf = gl.zeros((BN, BM), gl.float32, MMA)
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
        cc = gl.arange(0, BM, layout=COL)
        rr = pid_n * BN + gl.arange(0, BN, layout=ROW)
        _finish(acc, cc, rr, y_ptr, part_ptr, ticket_ptr, M, N, split, nsplit, ticket, pid_n)


def qint_mma_launch(xq, blocks, n: int, k: int, split: int, *, warps: int = 4,
                    rows_per_warp: int = 16, k_width: int = 8, tickets=None,
                    unroll: int = 2, xsmem: bool = True, stages: int = 0,
                    programs: int = 0, max_regs: int | None = None):
    """y (M, n) float32 = xq's rows (M <= 16) times the Q4_K rows `blocks` (n, k / 256 *
    144): `split` ranges of super-blocks, their partials added by the last program of each
    tile where `tickets` (qgemv's counters) are given, else by qmatmul.sum_splits."""
    import torch

    m = xq.q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=xq.q.device)
    bn = rows_per_warp * warps
    tiles = -(-n // bn)
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    use_ticket = tickets is not None and split > 1
    args = (*xq, blocks, y, part, tickets if use_ticket else y, m, n, k, blocks.shape[1],
            k // 256 // split, split, int(use_ticket))
    extra = {"maxnreg": max_regs} if max_regs else {}
    if stages:  # the asynchronous copies' kernel
        _qint_mma_q4k_async_kernel[(tiles, split)](*args, WARPS=warps, RPW=rows_per_warp,
                                                   STAGES=stages, num_warps=warps, **extra)
    else:
        grid = (min(programs, tiles * split),) if programs else (tiles, split)
        _qint_mma_q4k_kernel[grid](*args, tiles, WARPS=warps, RPW=rows_per_warp, KW=k_width,
                                   UNROLL=unroll, XSMEM=xsmem, PERSIST=bool(programs),
                                   num_warps=warps, **extra)
    if split > 1 and not use_ticket:
        from kernels.qmatmul import sum_splits

        sum_splits(part, y)
    return y
