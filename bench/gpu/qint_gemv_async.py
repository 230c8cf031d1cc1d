"""An experiment for one row of x: qint's CUDA-core Q4_K product with its weight words
copied asynchronously into shared memory several super-blocks ahead (Gluon, NVIDIA).

    python3 bench/gpu/qint_gemv_async.py [--variants "2,4;4,3"] [--out DIR]

At one row qint's `_qint_gemv_kernel` reads 2.7-2.9 TB/s on the model's large Q4_K shapes
(64-69% of the H200's copy ceiling) and 1.5-1.6 on q|k|v and o: its build takes 126
registers on 2 warps, so a multiprocessor holds 8 programs with one super-block of
weights (64 rows x 144 bytes) in flight each, and each program waits on its loads where
its products begin. Here every program keeps STAGES - 1 super-blocks in flight (cp.async
into shared memory, as kernels/qint_mma.py does for 5-16 rows) and multiplies the one that
has arrived from there: the same layout of the words as qint's kernel (a thread holds a
quad of 4 words of one row and their x words), the same integer sums a super-block and the
same two fmas in K order, so the bits must be qint's. Not called by the engine: this
script checks the bits against qint's kernel and times both (variants: warps, stages) on
Llama-3.1-8B's Q4_K shapes, as CUDA-graph replays over weight copies that miss the L2,
with qint's own kernel also under register caps (--caps: more programs a multiprocessor),
and writes $OUT/qint_gemv_async.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

from kernels.qint_mma import HAS_GLUON  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (14336, 4096), (4096, 14336)]

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from kernels.qgemv import finish_splits
    from kernels.qint import _dp4a, _k4_six
    from kernels.qint_mma import _issue_q4k
    from kernels.qtiles import _f16lo
    from kernels.triton_util import await_inputs

    @gluon.jit
    def _issue_x(xs, bss, dxs, buf, x_src, s_src, d_src, sb, ok, xcols, scols, one):
        """Asynchronous copies of x's part of super-block sb into stage `buf`: its 64 code
        words (low nibbles' 8 x 4, high nibbles' 8 x 4), 16 sums (the first and second of
        each sub-block's pair, 8 each) and its scale."""
        on = ok.to(gl.int32)
        for h in gl.static_range(2):
            async_copy.async_copy_global_to_shared(xs.index(2 * buf + h),
                                                   x_src + (sb * 64 + 8 * h),
                                                   mask=xcols < 64 * on)
            async_copy.async_copy_global_to_shared(bss.index(2 * buf + h),
                                                   s_src + (sb * 16 + h),
                                                   mask=scols < 16 * on)
        async_copy.async_copy_global_to_shared(dxs.index(buf), d_src + sb, mask=one < on)

    @gluon.jit(do_not_specialize=["M", "N", "sb_per_split", "nsplit"])
    def _gemv1_q4k_kernel(
        q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, row_bytes,
        sb_per_split, nsplit, ticket, BN: gl.constexpr = 64, WARPS: gl.constexpr = 2,
        STAGES: gl.constexpr = 4, PDL: gl.constexpr = False,
    ):
        """y[0, n] for one row of x (M = 1, int32 16-column sums: qint.sums_dtype(1)) and
        W's Q4_K rows n; grid (N / BN, nsplit), the split's partials finished as qint's."""
        # the words as (BN, 8 quads, 4): a thread holds quads of its rows, a warp 4 rows
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [4, 8, 1], [WARPS, 1, 1], [2, 1, 0])
        Q2: gl.constexpr = gl.SliceLayout(2, L3)  # (BN, 8)
        ROWS: gl.constexpr = gl.SliceLayout(1, Q2)  # (BN,)
        QUADS: gl.constexpr = gl.SliceLayout(0, Q2)  # (8,)
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        HL: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        sb0 = split * sb_per_split
        rc = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, CL))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, CL))
        c_src = w_ptr + (gl.where(rc < N, rc, 0).to(gl.int64) * row_bytes)[:, None] + 16 \
            + cols[None, :]
        hrows = gl.arange(0, BN, layout=HL)
        rh = pid_n * BN + hrows
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        h_src = w32 + gl.where(rh < N, rh, 0).to(gl.int64) * (row_bytes // 4)
        # x's words as quad q's: code word c = 4 q + i holds, in its low nibbles, elements
        # 64 g + 4 (c % 8) + b (g = c // 8), byte b of x's word 16 (q // 2) + 4 (q % 2) + i;
        # in its high nibbles those 32 on, word + 8
        X2: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])
        xqd = gl.arange(0, 8, layout=gl.SliceLayout(1, X2))[:, None]
        xi = gl.arange(0, 4, layout=gl.SliceLayout(0, X2))[None, :]
        xcols = 16 * (xqd // 2) + 4 * (xqd % 2) + xi  # (8, 4): the low nibbles' words
        x_src = q_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + xcols
        # x's 16-column sums: the first (then, one on, the second) of each sub-block q
        scols = 2 * gl.arange(0, 8, layout=HL)
        s_src = bs_ptr + scols
        one = gl.arange(0, 1, layout=HL)
        d_src = dx_ptr + one
        codes8 = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 128],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        codes = codes8._reinterpret(gl.int32, [STAGES, BN, 8, 4],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
        heads = gl.allocate_shared_memory(gl.int32, [STAGES * 4, BN], FLAT)
        # x's words and sums, two rows a stage (low / high nibbles' words, the sums' pairs)
        xs = gl.allocate_shared_memory(gl.int32, [STAGES * 2, 8, 4],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        bss = gl.allocate_shared_memory(gl.int32, [STAGES * 2, 8], FLAT)
        dxs = gl.allocate_shared_memory(gl.float32, [STAGES, 1], FLAT)
        q = gl.arange(0, 8, layout=QUADS)
        s_lo = (2 * (q // 2)).to(gl.uint32)[None, :]  # sub-block of a quad's low nibbles
        sub = q.to(gl.uint32)[None, :]  # the sub-block whose min a quad takes
        acc = gl.zeros((BN,), gl.float32, ROWS)
        for s in gl.static_range(STAGES - 1):  # the weights before the wait for x
            _issue_q4k(codes8, heads, s, c_src, h_src, sb0 + s, s < sb_per_split, cols, hrows)
        await_inputs(PDL)
        for s in gl.static_range(STAGES - 1):  # the first group also holds the weights
            _issue_x(xs, bss, dxs, s, x_src, s_src, d_src, sb0 + s, s < sb_per_split, xcols,
                     scols, one)
            async_copy.commit_group()
        for it in range(0, sb_per_split):
            async_copy.wait_group(STAGES - 2)  # this thread's copies of super-block it
            gl.thread_barrier()  # everyone's; and the stage read last is free
            nxt = it + STAGES - 1
            _issue_q4k(codes8, heads, nxt % STAGES, c_src, h_src, sb0 + nxt,
                     nxt < sb_per_split, cols, hrows)
            _issue_x(xs, bss, dxs, nxt % STAGES, x_src, s_src, d_src, sb0 + nxt,
                     nxt < sb_per_split, xcols, scols, one)
            async_copy.commit_group()
            buf = it % STAGES
            acc = _sb1(acc, codes.index(buf), heads, buf, xs, bss,
                       dxs.index(buf), s_lo, sub, L3, ROWS, QUADS, HL)
        async_copy.wait_group(0)
        rr = pid_n * BN + gl.arange(0, BN, layout=ROWS)
        finish_splits(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, nsplit, M, N, rr,
                      rr < N, ticket)

    @gluon.jit
    def _sb1(acc, codes, heads, buf, xs, bss, dxs, s_lo, sub, L3: gl.constexpr,
             ROWS: gl.constexpr, QUADS: gl.constexpr, HL: gl.constexpr):
        """acc (BN,) + one super-block from shared memory, qint's _sb_q4k at one row: a
        quad's 4 code words (low nibbles: sub-block 2 g, high: 2 g + 1, g = quad // 2)
        against x's words, dp4a summed in the thread, times the sub-blocks' scales, summed
        over a row's 8 quads; the mins' sum likewise; then the definition's two fmas."""
        XL: gl.constexpr = gl.SliceLayout(0, L3)  # (8, 4)
        w = codes.load(L3)  # (BN, 8, 4) int32
        x_lo = xs.index(2 * buf).load(XL)[None, :, :]
        x_hi = xs.index(2 * buf + 1).load(XL)[None, :, :]
        p_lo = gl.sum(_dp4a(w & 0x0F0F0F0F, x_lo, True), axis=2)  # (BN, 8)
        p_hi = gl.sum(_dp4a((w >> 4) & 0x0F0F0F0F, x_hi, True), axis=2)
        w0 = heads.index(buf * 4).load(ROWS)
        w1 = heads.index(buf * 4 + 1).load(ROWS)[:, None]
        w2 = heads.index(buf * 4 + 2).load(ROWS)[:, None]
        w3 = heads.index(buf * 4 + 3).load(ROWS)[:, None]
        dot = _k4_six(w1, w3, s_lo, 0) * p_lo + _k4_six(w1, w3, s_lo + 1, 0) * p_hi
        pair = bss.index(2 * buf).load(QUADS) + bss.index(2 * buf + 1).load(QUADS)  # x's
        # 32-column sums
        msum = gl.sum(_k4_six(w2, w3, sub, 4) * pair[None, :], axis=1)
        dx = gl.sum(dxs.load(HL), axis=0)  # x's scale (one element)
        acc = gl.fma(gl.sum(dot, axis=1).to(gl.float32), _f16lo(w0) * dx, acc)
        return gl.fma((-msum).to(gl.float32), _f16lo(w0 >> 16) * dx, acc)


def gemv1_launch(xq: Any, blocks: Any, n: int, k: int, split: int, tickets: Any = None, *,
                 bn: int = 64, warps: int = 2, stages: int = 4) -> Any:
    """y (1, n) float32 = xq's one row (a QuantX, int32 sums) times the Q4_K rows `blocks`
    (n, k / 256 * 144) over `split` ranges of super-blocks, as qint's gemv launch."""
    import torch

    if xq.q.shape[0] != 1 or xq.bs.dtype != torch.int32:
        raise ValueError("gemv1_launch multiplies one row of x with int32 sums")
    y = torch.empty(1, n, dtype=torch.float32, device=xq.q.device)
    tiles = -(-n // bn)
    part = y if split == 1 else torch.empty(split, 1, n, dtype=torch.float32, device=y.device)
    use_ticket = tickets is not None and split > 1 and tiles <= tickets.numel()
    _gemv1_q4k_kernel[(tiles, split)](
        *xq, blocks, y, part, tickets if use_ticket else y, 1, n, k, blocks.shape[1],
        k // 256 // split, split, int(use_ticket), BN=bn, WARPS=warps, STAGES=stages,
        num_warps=warps)
    if split > 1 and not use_ticket:
        from kernels.qmatmul import sum_splits

        sum_splits(part, y)
    return y


def main(argv: list[str] | None = None) -> int:
    import torch
    from kernels_check import random_blocks
    from provenance import commit_id
    from qmatmul_bench import L2_MISS_BYTES, Run, ceilings

    from kernels import qint
    from kernels.dequant import dequantize_reference
    from kernels.qgemv import _tickets

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--variants", default="2,4,64;2,3,64;4,4,128;2,6,64",
                    help="warps,stages,rows a program; ... ")
    ap.add_argument("--caps", default="112,96",
                    help="register caps to time qint's own kernel under (comma separated)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.caps = [int(c) for c in args.caps.split(",") if c]
    run = Run(args)
    variants = [tuple(int(v) for v in t.split(",")) for t in args.variants.split(";") if t]
    ceil = ceilings(run)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": torch.cuda.get_device_name(0), "ceilings": ceil, "rows": [],
           "errors": run.out["errors"]}
    tickets = _tickets(run.dev)
    for n, k in SHAPES:
        if run.left() < 20:
            out["errors"].append(f"budget: stopped before {n}x{k}")
            break
        blocks = random_blocks(run, "Q4_K", n, k)
        copies = [blocks] + [blocks.clone() for _ in range(
            max(1, min(64, math.ceil(L2_MISS_BYTES / blocks.numel()))) - 1)]
        w = dequantize_reference(blocks.view(-1), qint.Q4_K, (n, k), torch.float64)
        x = torch.randn(1, k, device=run.dev, generator=run.gen).bfloat16()
        xq_ref = qint.dequantized_x_reference(x)
        ref, bound = xq_ref @ w.T, xq_ref.abs() @ w.abs().T
        del w
        xq = qint.quantize_x(x)
        split = qint.default_qint_config(qint.Q4_K, n, k, run.sms, m=1).split

        def old_call(b, xm=x, xqm=xq, nk=(n, k)):
            return qint.qint_triton(xm, b, qint.Q4_K, nk, xq=xqm)

        old = old_call(blocks)
        row = {"n": n, "k": k, "split": split,
               "old_us": run.time_us([partial(old_call, b) for b in copies])}
        row["old_gb_s"] = blocks.numel() / row["old_us"] / 1e3
        # qint's own kernel under register caps (112 builds without spills: 9 programs of
        # 2 warps a multiprocessor instead of 8), the other way to more bytes in flight
        base = qint.default_qint_config(qint.Q4_K, n, k, run.sms, m=1)
        for regs in args.caps:
            capped = partial(qint.qint_triton, x, ggml_type=qint.Q4_K, shape=(n, k),
                             config=base._replace(max_regs=regs), xq=xq)
            y = run.attempt(f"{n}x{k} cap {regs}", lambda c=capped, b=blocks: c(blocks=b))
            if y is not None:
                us = run.time_us([partial(capped, blocks=b) for b in copies])
                row[f"qint_cap{regs}"] = {"bits_equal_qint": bool(torch.equal(y, old)),
                                          "us": us, "gb_s": blocks.numel() / us / 1e3}
        for warps, stages, bn in variants:
            tag = f"w{warps}_st{stages}_bn{bn}"
            call = partial(gemv1_launch, xq, n=n, k=k, split=split, tickets=tickets, bn=bn,
                           warps=warps, stages=stages)
            y = run.attempt(f"{n}x{k} {tag}", lambda c=call, b=blocks: c(b))
            if y is None:
                continue
            err = float(((y.double() - ref).abs() / bound).max())
            res = {"err": err, "ok": bool(torch.isfinite(y).all()) and err <= 2**-16,
                   "bits_equal_qint": bool(torch.equal(y, old))}
            us = run.attempt(tag, lambda c=call, cs=copies: run.time_us(
                [partial(c, b) for b in cs]))
            if us is not None:
                res.update(us=us, gb_s=blocks.numel() / us / 1e3,
                           pct_copy=100 * blocks.numel() / us / 1e3 / ceil["copy_gb_s"])
            row[tag] = res
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qint_gemv_async.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
