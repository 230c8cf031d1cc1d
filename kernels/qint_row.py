"""Q4_K times one row of 8-bit x on NVIDIA with a weight row a thread (Gluon): the same
sums, bits and storage as kernels/qint.py's one-row product (its docstring is the
definition), in about half its instructions.

qint's one-row loop (Triton) spreads a row's 32 code words over 8 lanes, so that its loads
are coalesced; each super-block then costs a thread 385 instructions on sm_90, 24 of them
shuffles and 6 barriers (bench/RESULTS.md, 2026-12-03). A row a thread (all of its words in
registers) needs no exchange, but loaded straight from global memory it reads 32 rows a
warp instruction and ran twice as slow. Here the words travel through shared memory:
- a program owns ROWS = 32 weight rows (a warp's lanes) and S splits of their super-blocks
  (S warps: warp s takes split s of every row); x's words, sums and scale are the same for
  a warp's lanes (one split), so they are read from global memory as broadcasts;
- the codes (S x 32 rows x 128 bytes) and head words of a super-block are copied into
  shared memory asynchronously (cp.async, 16 bytes a thread, coalesced along each row),
  STAGES super-blocks ahead; the first ones before the programmatic dependent wait;
- a thread reads its row's 32 code words (8 reads of 16 bytes, swizzled by row: no bank
  conflicts) and 4 head words, and multiplies: per 8-word group of a sub-block pair one
  dp4a chain for the low nibbles and one for the high ones, the 6-bit scales and mins
  picked as bytes from four packed words (PRMT), then qint's two fmas;
- the S partials of a row are added in split order through shared memory (qint's
  _finish_in_cta order).

NVIDIA only (cp.async, PRMT); gfx1151 keeps qint's kernel.
"""

from __future__ import annotations

import os
from typing import Any

from kernels.triton_util import HAS_TRITON

__all__ = ["HAS_GLUON", "ROWS", "STAGES", "aot_specs", "qint_row_launch", "row_path",
           "stages_of"]

ROWS = 32  # weight rows a program: one a lane
STAGES = 2  # super-blocks a warp holds in shared memory

HAS_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.ampere import async_copy

        HAS_GLUON = True
    except ImportError:  # a Triton without Gluon
        pass

if HAS_GLUON:
    from kernels.qtiles import _f16lo
    from kernels.triton_util import await_inputs

    @gluon.jit
    def _prmt(w, sel):
        """The byte of w that sel (0x4440 + its index) picks, zero-extended (one PRMT)."""
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [w, sel],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _dp4a(a, b, c, SIGNED: gl.constexpr):
        """c + the 4 byte products of a (signed or not) and b (signed)."""
        if SIGNED:
            asm: gl.constexpr = "dp4a.s32.s32 $0, $1, $2, $3;"
        else:
            asm: gl.constexpr = "dp4a.u32.s32 $0, $1, $2, $3;"
        return gl.inline_asm_elementwise(asm, "=r,r,r,r", [a, b, c], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _eight(t):
        """(R, 4, 2, 2, 2) -> eight (R, 4): word i of each group of 8 (in any order: the
        dp4a chain's integer sum does not depend on it)."""
        e0, e1 = gl.split(t)
        a0, a1 = gl.split(e0)
        b0, b1 = gl.split(e1)
        w0, w1 = gl.split(a0)
        w2, w3 = gl.split(a1)
        w4, w5 = gl.split(b0)
        w6, w7 = gl.split(b1)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @gluon.jit
    def _chain(w, x, SIGNED: gl.constexpr):
        """The dp4a chain of 8 word pairs (tuples of (R, 4)): each group's dot."""
        acc = _dp4a(w[0], x[0], 0 * w[0], SIGNED)
        for i in gl.static_range(1, 8):
            acc = _dp4a(w[i], x[i], acc, SIGNED)
        return acc

    @gluon.jit
    def _issue(codes, heads, slot, src_c, src_h, cols_c, cols_h, step, nsb):
        """cp.async of each warp's super-block `step` of its split into stage `slot`: the
        codes (S ROWS, 32) and heads (S ROWS, 4) words; nothing past the split (an empty
        group is committed all the same)."""
        on = (step < nsb).to(gl.int32)
        async_copy.async_copy_global_to_shared(codes.index(slot), src_c + step * 36,
                                               mask=(cols_c < 32 * on)[None, :])
        async_copy.async_copy_global_to_shared(heads.index(slot), src_h + step * 36,
                                               mask=(cols_h < 4 * on)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _rows(t, V: gl.constexpr):
        """(R, 4) -> its four columns as (R,) in layout V."""
        a, b = gl.split(gl.reshape(t, [t.shape[0], 2, 2]))
        c0, c2 = gl.split(a)
        c1, c3 = gl.split(b)
        return (gl.convert_layout(c0, V), gl.convert_layout(c1, V), gl.convert_layout(c2, V),
                gl.convert_layout(c3, V))

    @gluon.jit
    def _groups(t32, L5: gl.constexpr):
        """(R, 32) words, a row a thread -> _eight of its 4 groups of 8."""
        return _eight(gl.convert_layout(gl.reshape(t32, [t32.shape[0], 4, 2, 2, 2]), L5))

    @gluon.jit(do_not_specialize=["N"])
    def _qint_row_kernel(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, N, K, row_bytes,
                         S: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr = False):
        """y[n] = x's row (quantized: q, dx, int32 16-column sums bs) times W's Q4_K row n,
        for the ROWS rows of program pid, in S splits of K / 256 / S super-blocks."""
        R: gl.constexpr = S * 32  # (split, row) pairs: v = 32 s + r
        pid = gl.program_id(0)
        nsb = K // 256 // S
        row_words = row_bytes // 4
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        q32 = q_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        # the copies: codes 8 lanes along a row (coalesced), heads a row a lane
        CP: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [S, 1], [1, 0])
        HP: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [S, 1], [1, 0])
        CODES: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])
        HEADS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        codes = gl.allocate_shared_memory(gl.int32, [STAGES, R, 32], CODES)
        heads = gl.allocate_shared_memory(gl.int32, [STAGES, R, 4], HEADS)
        vc = gl.arange(0, R, layout=gl.SliceLayout(1, CP))
        cols_c = gl.arange(0, 32, layout=gl.SliceLayout(0, CP))
        rows_c = gl.minimum(pid * 32 + vc % 32, N - 1).to(gl.int64)  # past N: the last row
        off_c = (rows_c * row_words + (vc // 32) * nsb * 36 + 4)[:, None] + cols_c[None, :]
        src_c = w32 + gl.max_contiguous(gl.multiple_of(off_c, [4, 4]), [1, 4])  # 16-byte runs
        vh = gl.arange(0, R, layout=gl.SliceLayout(1, HP))
        cols_h = gl.arange(0, 4, layout=gl.SliceLayout(0, HP))
        rows_h = gl.minimum(pid * 32 + vh % 32, N - 1).to(gl.int64)
        off_h = (rows_h * row_words + (vh // 32) * nsb * 36)[:, None] + cols_h[None, :]
        src_h = w32 + gl.max_contiguous(gl.multiple_of(off_h, [4, 4]), [1, 4])
        for i in gl.static_range(STAGES - 1):
            _issue(codes, heads, i, src_c, src_h, cols_c, cols_h, i, nsb)
        await_inputs(PDL)
        # a thread's row: its 32 code words (4 groups of 8) and 4 head words
        L5: gl.constexpr = gl.BlockedLayout([1, 4, 2, 2, 2], [32, 1, 1, 1, 1],
                                            [S, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        RL: gl.constexpr = gl.BlockedLayout([1, 32], [32, 1], [S, 1], [1, 0])
        RH: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [S, 1], [1, 0])
        R16: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [S, 1], [1, 0])
        V: gl.constexpr = gl.SliceLayout(1, RL)
        v = gl.arange(0, R, layout=V)
        cc = gl.arange(0, 32, layout=gl.SliceLayout(0, RL))
        xw = gl.max_contiguous(gl.multiple_of(cc + 8 * (cc // 8), 8), 8)  # group g: 16 g + i
        c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, R16))
        first = (v // 32) * nsb  # the split's first super-block
        first16 = gl.convert_layout(first, gl.SliceLayout(1, R16))
        acc = gl.zeros([R], gl.float32, layout=V)
        for i in range(nsb):
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()  # every thread's copies; the stage read last is free
            _issue(codes, heads, (i + STAGES - 1) % STAGES, src_c, src_h, cols_c, cols_h,
                   i + STAGES - 1, nsb)
            sb = first + i  # (R,): the same for a warp's lanes
            xp = q32 + (sb * 64)[:, None] + xw[None, :]
            xlo = _groups(gl.load(xp), L5)
            xhi = _groups(gl.load(xp + 8), L5)
            w = _groups(codes.index(i % STAGES).load(RL), L5)
            h0, h1, h2, h3 = _rows(heads.index(i % STAGES).load(RH), V)
            t = gl.load(bs_ptr + ((first16 + i) * 16)[:, None] + c16[None, :])  # (R, 16)
            ta, tb = gl.split(gl.reshape(t, [R, 4, 2, 2]))  # sums 4 g + (0, 2), (1, 3)
            t0, t2 = gl.split(ta)
            t1, t3 = gl.split(tb)
            m_lo = _rows(t0 + t1, V)  # sub-block 2g's x sum, group g
            m_hi = _rows(t2 + t3, V)  # 2g + 1's
            p_lo = _rows(_chain([c & 0x0F0F0F0F for c in w], xlo, True), V)
            # the high nibbles in place (16 times their value): the sum / 16, exact
            p_hi = _rows(_chain([c & -0x0F0F0F10 for c in w], xhi, False) >> 4, V)
            # the 8 scales and 8 mins as bytes of four words (get_scale_min_k4's fields)
            sc_a = h1 & 0x3F3F3F3F
            sc_b = (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030)
            mn_a = h2 & 0x3F3F3F3F
            mn_b = ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030)
            dot = 0 * h0
            msum = 0 * h0
            for g in gl.static_range(4):
                if g < 2:
                    scw = sc_a
                    mnw = mn_a
                else:
                    scw = sc_b
                    mnw = mn_b
                lo_sel = 0x4440 + (2 * g) % 4
                dot += _prmt(scw, lo_sel + 0 * h0) * p_lo[g] \
                    + _prmt(scw, lo_sel + 1 + 0 * h0) * p_hi[g]
                msum += _prmt(mnw, lo_sel + 0 * h0) * m_lo[g] \
                    + _prmt(mnw, lo_sel + 1 + 0 * h0) * m_hi[g]
            dx = gl.load(dx_ptr + sb)
            acc = gl.fma(dot.to(gl.float32), _f16lo(h0) * dx, acc)
            acc = gl.fma((-msum).to(gl.float32), _f16lo(h0 >> 16) * dx, acc)
        async_copy.wait_group(0)
        # the S partials of each row added in split order (qint's _finish_in_cta)
        FL: gl.constexpr = gl.BlockedLayout([S, 1], [1, 32], [1, S], [0, 1])
        part = gl.allocate_shared_memory(gl.float32, [S, 32],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        part.store(gl.reshape(acc, [S, 32]))
        gl.thread_barrier()
        a = part.load(FL)
        pick = gl.arange(0, S, layout=gl.SliceLayout(1, FL))[:, None]
        total = gl.sum(gl.where(pick == 0, a, -0.0), axis=0)
        for s in gl.static_range(1, S):
            total += gl.sum(gl.where(pick == s, a, -0.0), axis=0)
        rows = pid * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, FL))
        gl.store(y_ptr + rows, total, mask=rows < N)


def stages_of(splits: int) -> int:
    """Super-blocks a warp holds: 2 at 8 splits and more (8 warps, one program a
    multiprocessor: 135 registers, 72 KB), 3 below (2 splits: 2 warps, 27 KB, 7 programs a
    multiprocessor by registers, gate|up's 896 in one wave)."""
    return STAGES if splits >= 8 else 3


def row_path(m: int, k: int, backend: str, bs_dtype: Any) -> bool:
    """Whether a one-row Q4_K product takes this kernel: on NVIDIA with Gluon, x's sums in
    int32, K a multiple of 256; MBUFO_QINT_ROW=0: never."""
    import torch

    return (HAS_GLUON and backend == "cuda" and m == 1 and k % 256 == 0
            and bs_dtype == torch.int32
            and os.environ.get("MBUFO_QINT_ROW", "1").strip() != "0")


def qint_row_launch(xq: Any, blocks: Any, n: int, k: int, split: int,
                    launch: Any = None) -> Any:
    """y (1, n) float32 = xq's one row (a QuantX, int32 sums) times the Q4_K rows `blocks`
    (n, k / 256 * 144), the super-blocks in `split` ranges (a power of 2 that divides them:
    qint's config, so that the bits are qint's). `launch` maps the kernel to what to
    launch (kernels/triton_util.launcher: the PDL launch in captures)."""
    import torch

    sbs = k // 256
    if k % 256 or split < 1 or split & (split - 1) or sbs % split:
        raise ValueError(f"qint_row: {split} splits of K = {k}")
    y = torch.empty(1, n, dtype=torch.float32, device=xq.q.device)
    kernel = launch(_qint_row_kernel) if launch else _qint_row_kernel
    kernel[(-(-n // ROWS),)](*xq, blocks, y, n, k, blocks.shape[1], S=split,
                             STAGES=stages_of(split), num_warps=split)
    return y


def aot_specs(spec: type) -> list:
    """kernels/aot.py: both launch configurations (8 splits, 2 stages; 2 splits, 3 stages)
    as programmatic dependent launches, for cuda:90 only (cp.async, PRMT)."""
    if not HAS_GLUON:
        return []
    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*i32", "w_ptr": "*u8",
           "y_ptr": "*fp32", "N": "i32", "K": "i32", "row_bytes": "i32", "S": "constexpr",
           "STAGES": "constexpr", "PDL": "constexpr"}
    divisible = ("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr", "K", "row_bytes")
    return [spec(f"qint_row_s{s}", _qint_row_kernel, sig, {"S": s, "STAGES": st, "PDL": True},
                 s, False, "cuda", None, divisible, None)
            for s, st in ((8, stages_of(8)), (2, stages_of(2)))]
