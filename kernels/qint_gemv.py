"""qint's one-row kernel: Q4_K and Q6_K_A rows times up to a few rows of 8-bit x on the
CUDA cores (kernels/qint.py's docstring is the definition; it launches this kernel).

A program owns BLOCK_N weight rows; the codes stay packed four to a u32 word against a
word of x's int8 codes (dp4a on NVIDIA, byte by byte elsewhere: the same integer), each
row of x in turn. Its split partials are added in split order by the last program of each
tile (qgemv.finish_splits), or, with IN_CTA, by the program that holds every split of its
rows (_finish_in_cta). The word helpers here also serve the matrix-unit kernel
(kernels/qint_mm.py) and the Gluon kernels (kernels/qint_mma.py).
"""

from __future__ import annotations

from kernels.qtiles import _f16lo, _p32
from kernels.triton_util import HAS_TRITON, await_inputs, helper, tl, triton

__all__: list[str] = []

if HAS_TRITON:
    from kernels.qgemv import finish_splits

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
