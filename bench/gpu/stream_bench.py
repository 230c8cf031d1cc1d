"""Chained one-row Q4_K products in one persistent launch whose weights stream through a
shared-memory ring: can the next products' weights arrive while a product waits for its
input, where launches (and chain_bench's grid barrier) leave the memory idle?

chain_bench (bench/RESULTS.md, 2026-12-02) timed 32 chained one-row Q4_K products: qint
launches 45.2 us a layer of four, the same products with no wait between them (`free`)
35.1, the copy ceiling 28.9; a grid barrier costs what a launch costs, because after it
every program waits a DRAM latency for its first weights, and registers hold at most one
super-block ahead. Here a program (Gluon, NVIDIA only) owns tiles of BN = 4 WARPS weight
rows of every product and copies their weights (cp.async) into a ring of D slots of S
super-blocks, D - 1 slots ahead of the one it multiplies, across tiles and products: the
copies never wait for x. Before the first tile of product l (l > 0) it waits for product
l - 1's tiles to be done (a count, acquire; each tile's program counts it in after its
stores, release), the dependency a chained step has; `free` skips that wait.

The product is qint's definition (kernels/qint.py), one program over a row's super-blocks
in K order (qint's split 1): a thread holds one quad of 4 code words of one row (as qint's
one-row kernel), x's words for the quad in the order the bench lays them out (quantize_x's
codes permuted per super-block, 32 words against the low nibbles and 32 against the high:
a producer could write them so). Every output is checked bit-equal to qint_triton's with
split 1.

    python3 bench/gpu/stream_bench.py [--layers 32] [--shapes 4096x4096,...]
        [--configs W:S:D:G,...] [--out DIR]

Writes $OUT/stream_bench.json; prints us a product and GB/s for launches (qint's default
config, chained in one CUDA graph with programmatic dependent launches), each ring config
with the wait, without it (`free`) and as a launch a product (`pdl`: the first slots
copied before the programmatic dependent wait).

Measured on the H200 (bench/RESULTS.md, 2026-12-03): slower than the launches at every
shape, with the same bits. Decoding from shared memory is compute-bound at 2.0-2.7 TB/s
even with no wait, and the wait costs what a launch boundary costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from chain_bench import _await_count, resident  # noqa: E402
from kernels_check import random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run, ceilings  # noqa: E402

from kernels import quant_x  # noqa: E402
from kernels.qint import Q4_K, QIntConfig, default_qint_config, qint_triton  # noqa: E402
from kernels.qint_mma import HAS_GLUON  # noqa: E402
from kernels.quant_x import quantize_x  # noqa: E402

SHAPES = "4096x4096,6144x4096,4096x14336,28672x4096"
# warps, super-blocks a slot, slots (a power of 2; the cp.async copies fall to 4 bytes past 512
# rows of ring, sm_90 builds), programs a multiprocessor, rows a thread (1 or 2)
CONFIGS = "8:4:4:2:1,4:4:4:2:2,4:8:4:2:1,8:2:8:2:1,4:2:8:2:2,4:4:4:3:2"

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from kernels.qint_gemv import _dp4a_acc as _dp4a
    from kernels.qint_gemv import _k4_six
    from kernels.qtiles import _f16lo
    from kernels.triton_util import await_inputs, launcher

    @gluon.jit
    def _where_chunk(c, NC, n_my, pid, G):
        """Chunk c of a program -> (product, tile, slot of the tile's super-blocks)."""
        kc = c % NC
        tj = c // NC
        return tj // n_my, pid + (tj % n_my) * G, kc

    @gluon.jit
    def _slot_words(w32, p, t, kc, row_words, layer_words, FIRST: gl.constexpr,
                    WIDTH: gl.constexpr, L: gl.constexpr, R: gl.constexpr, RT: gl.constexpr,
                    S: gl.constexpr):
        """Pointers (S RT R, WIDTH) to words FIRST .. FIRST + WIDTH - 1 of each super-block
        record of product p's tile t, slot kc: row v is row v % R of group (v // R) % RT,
        super-block kc S + v // (R RT); and the column indices (WIDTH,)."""
        v = gl.arange(0, S * RT * R, layout=gl.SliceLayout(1, L))
        col = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
        j = v // R
        rows = (t * (R * RT) + (j % RT) * R + v % R).to(gl.int64)
        off = p.to(gl.int64) * layer_words + rows * row_words + (kc * S + j // RT) * 36 + FIRST
        off = off[:, None] + col[None, :]  # 16-byte runs (the analysis cannot tell)
        return w32 + gl.max_contiguous(gl.multiple_of(off, [4, 4]), [1, 4]), col

    @gluon.jit
    def _issue(codes, heads, slot, c, C, w32, row_words, layer_words, NC, n_my, pid, G,
               R: gl.constexpr, RT: gl.constexpr, S: gl.constexpr, WARPS: gl.constexpr):
        """cp.async of chunk c's S super-blocks of RT groups of R rows into ring slot
        `slot` of codes (D, S RT R, 32) and heads (D, S RT R, 4): buffer (s RT + group) of
        the slot holds (R, 32) code words (16 bytes a thread) and the rows' 4 head words.
        One copy for all the slot's codes and one for its heads (the compiler puts a
        barrier between two copies into one buffer). Nothing past the program's last chunk
        (an empty group is committed all the same)."""
        CP: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
        HP: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [WARPS, 1], [1, 0])
        on = (c < C).to(gl.int32)
        p, t, kc = _where_chunk(gl.where(c < C, c, 0), NC, n_my, pid, G)
        src, col = _slot_words(w32, p, t, kc, row_words, layer_words, 4, 32, CP, R, RT, S)
        async_copy.async_copy_global_to_shared(codes.index(slot), src,
                                               mask=(col < 32 * on)[None, :])
        src, col = _slot_words(w32, p, t, kc, row_words, layer_words, 0, 4, HP, R, RT, S)
        async_copy.async_copy_global_to_shared(heads.index(slot), src,
                                               mask=(col < 4 * on)[None, :])

    @gluon.jit
    def _quads(t):
        """(R, 8, 2, 2) -> four (R, 8): word i of each quad (a quad lies in one thread)."""
        a, b = gl.split(t)
        w0, w2 = gl.split(a)
        w1, w3 = gl.split(b)
        return w0, w1, w2, w3

    @gluon.jit
    def _sb_x(sb, xlo_ptr, xhi_ptr, bs_ptr, dx_ptr, off4, boff4):
        """x at super-block sb, in the quads' layout: the words against each quad's low
        and high nibbles, its sub-block's two 16-column sums, the scale."""
        a0, a1, a2, a3 = _quads(gl.load(xlo_ptr + sb * 32 + off4))
        b0, b1, b2, b3 = _quads(gl.load(xhi_ptr + sb * 32 + off4))
        t0, t1, _, _ = _quads(gl.load(bs_ptr + sb * 16 + boff4))
        return a0, a1, a2, a3, b0, b1, b2, b3, t0 + t1, gl.load(dx_ptr + sb)

    @gluon.jit
    def _nibble_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3):
        """A quad of Q4_K code words against x's words: the dot of their low nibbles with
        a0..a3 and of their high nibbles with b0..b3 (int32, qint's _dp4a_acc chains)."""
        m = 0x0F0F0F0F
        p_lo = _dp4a(w0 & m, a0, w0 * 0, True)
        p_lo = _dp4a(w1 & m, a1, p_lo, True)
        p_lo = _dp4a(w2 & m, a2, p_lo, True)
        p_lo = _dp4a(w3 & m, a3, p_lo, True)
        hm = -0x0F0F0F10  # 0xF0F0F0F0: the high nibbles in place, 16 times their value
        p_hi = _dp4a(w0 & hm, b0, w0 * 0, False)
        p_hi = _dp4a(w1 & hm, b1, p_hi, False)
        p_hi = _dp4a(w2 & hm, b2, p_hi, False)
        return p_lo, _dp4a(w3 & hm, b3, p_hi, False) >> 4

    @gluon.jit
    def _quad_index(L4: gl.constexpr):
        """(1, 8, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2) indices in L4: a super-block's quad, and
        a word's place in it (word 4 q + 2 i1 + i2)."""
        Q1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
        I1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
        I2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))
        return (gl.arange(0, 8, layout=Q1)[None, :, None, None],
                gl.arange(0, 2, layout=I1)[None, None, :, None],
                gl.arange(0, 2, layout=I2)[None, None, None, :])

    @gluon.jit
    def _ring_extent(N, K, layers, BN: gl.constexpr, S: gl.constexpr):
        """A program's share of `layers` products of (N, K) Q4_K rows in tiles of BN rows
        and chunks of S super-blocks: (chunks a tile, tiles, this program's tiles, its
        chunks, words a row, words a product)."""
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        NB = K // 256
        NC = NB // S
        T = N // BN
        n_my = (T - pid + G - 1) // G
        row_words = NB * 36
        return NC, T, n_my, layers * n_my * NC, row_words, N.to(gl.int64) * row_words

    @gluon.jit
    def _sb_dot(acc, codes_sb, heads_sb, xs, q, R: gl.constexpr, WARPS: gl.constexpr,
                RL: gl.constexpr):
        """acc (R,) + one super-block of R rows (a slot's row group) times x (xs: _sb_x),
        qint's definition; q (1, 8): each quad's index."""
        a0, a1, a2, a3, b0, b1, b2, b3, tq, dx = xs
        CL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
        w0, w1, w2, w3 = _quads(gl.reshape(codes_sb.load(CL), [R, 8, 2, 2]))
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [4, 8, 1, 1], [WARPS, 1, 1, 1],
                                            [3, 2, 1, 0])
        h4 = gl.convert_layout(gl.reshape(heads_sb.load(CL), [R, 1, 2, 2]), L4)  # 8 lanes a row
        h0, h1, h2, h3 = _quads(h4)
        p_lo, p_hi = _nibble_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3)
        s_lo = (2 * (q // 2)).to(gl.uint32)
        dot = _k4_six(h1, h3, s_lo, 0) * p_lo + _k4_six(h1, h3, s_lo + 1, 0) * p_hi
        msum = _k4_six(h2, h3, q.to(gl.uint32), 4) * tq  # sub-block q's min
        isum = gl.convert_layout(gl.sum(dot, axis=1), RL)
        mtot = gl.convert_layout(gl.sum(msum, axis=1), RL)
        hd = gl.convert_layout(gl.max(h0, axis=1), RL)  # (R,): the row's word 0
        acc = gl.fma(isum.to(gl.float32), _f16lo(hd) * dx, acc)
        return gl.fma(-mtot.to(gl.float32), _f16lo(hd >> 16) * dx, acc)

    @gluon.jit
    def _ring_kernel(w_ptr, xlo_ptr, xhi_ptr, bs_ptr, dx_ptr, y_ptr, ctr_ptr, N, K, layers,
                     WARPS: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
                     WAIT: gl.constexpr, PDL: gl.constexpr = False, RT: gl.constexpr = 1,
                     PROBE: gl.constexpr = 0):
        """y[l] = W_l x for l < layers, one row; program pid takes tiles pid, pid + G, ...
        of BN rows of every product (the module docstring). PDL (a launch a product): the
        first D - 1 slots' copies are issued before the wait for the kernel before. PROBE
        (timing only, wrong outputs): 1 the copies alone (no product), 2 the products alone
        (no copy after the first D - 1 slots: they multiply those slots again)."""
        R: gl.constexpr = 4 * WARPS  # a row group: a thread a quad of one row
        BN: gl.constexpr = R * RT  # RT (1 or 2) row groups: x's words loaded once for them
        gl.static_assert((RT == 1) | (RT == 2))
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [4, 8, 1, 1], [WARPS, 1, 1, 1],
                                            [3, 2, 1, 0])
        RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        NC, T, n_my, C, row_words, layer_words = _ring_extent(N, K, layers, BN, S)
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        # a slot's S RT buffers of (R, 32) code words and (R, 4) head words as one, for its copy
        codes = gl.allocate_shared_memory(gl.int32, [D, S * RT * R, 32], RING)
        heads = gl.allocate_shared_memory(gl.int32, [D, S * RT * R, 4], RING)
        # x's word offsets in a quad's order (1, 8, 2, 2), and its 16-column sums': the
        # quad's two (its sub-block's) and the quad's index
        q4, i1, i2 = _quad_index(L4)
        off4 = q4 * 4 + i1 * 2 + i2
        boff4 = 2 * q4 + i2 + 0 * i1  # _quads' first two: bs[2 q], bs[2 q + 1]
        q, _, _, _ = _quads(q4 + 0 * i1 + 0 * i2)
        for i in gl.static_range(D - 1):
            _issue(codes, heads, i, i, C, w32, row_words, layer_words, NC, n_my, pid, G, R,
                   RT, S, WARPS)
            async_copy.commit_group()
        await_inputs(PDL)
        RL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4)))
        rows = gl.arange(0, R, layout=RL)
        acc = gl.zeros([R], gl.float32, layout=RL)
        acc2 = gl.zeros([R], gl.float32, layout=RL)
        for c in range(0, C):
            async_copy.wait_group(D - 2)  # this thread's copies of chunk c
            gl.thread_barrier()  # everyone's; and the slot multiplied last is free
            _issue(codes, heads, (c + D - 1) % D, c + D - 1, C * (PROBE != 2), w32,
                   row_words, layer_words, NC, n_my, pid, G, R, RT, S, WARPS)
            async_copy.commit_group()
            p, t, kc = _where_chunk(c, NC, n_my, pid, G)
            if WAIT:
                if (kc == 0) & (t == pid) & (p > 0):  # product p's first tile here
                    _await_count(ctr_ptr + 2 * (p - 1), T)  # gave up: ctr_ptr[2 p - 1]
            slot = c % D
            if PROBE != 1:
                for s in gl.static_range(S):
                    xs = _sb_x(kc * S + s, xlo_ptr, xhi_ptr, bs_ptr, dx_ptr, off4, boff4)
                    cs = codes.index(slot)
                    hs = heads.index(slot)
                    acc = _sb_dot(acc, cs.slice(s * RT * R, R), hs.slice(s * RT * R, R), xs, q, R,
                                  WARPS, RL)
                    if RT == 2:
                        acc2 = _sb_dot(acc2, cs.slice((s * RT + 1) * R, R),
                                       hs.slice((s * RT + 1) * R, R), xs, q, R, WARPS, RL)
            if kc == NC - 1:
                yt = y_ptr + p.to(gl.int64) * N + t * BN + rows
                gl.store(yt, acc)
                acc = gl.zeros([R], gl.float32, layout=RL)
                if RT == 2:
                    gl.store(yt + R, acc2)
                    acc2 = gl.zeros([R], gl.float32, layout=RL)
                gl.thread_barrier()
                gl.atomic_add(ctr_ptr + 2 * p, 1, sem="release", scope="gpu")
        async_copy.wait_group(0)


def quad_order_x(xq: quant_x.QuantX, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's int8 codes as the ring kernel reads them: per super-block, 32 words against
    the codes' low nibbles (word 4 q + i of the weights: x's word 4 q + i + 8 (q // 2))
    and 32 against the high nibbles (8 words on)."""
    words = xq.q[0].view(torch.int32).view(k // 256, 64)
    c = torch.arange(32, device=words.device)
    lo = c + 8 * (c // 8)
    return words[:, lo].contiguous().view(-1), words[:, lo + 8].contiguous().view(-1)


def chain(run: Run, n: int, k: int, layers: int, configs: list[tuple[int, ...]],
          probes: tuple[int, ...] = ()) -> dict:
    """One shape: qint launches chained, then each ring config with and without the wait."""
    row: dict = {"n": n, "k": k, "layers": layers, "mb_per_product": n * k // 256 * 144 / 1e6}
    w = torch.stack([random_blocks(run, "Q4_K", n, k) for _ in range(layers)])
    x = torch.randn(1, k, device=run.dev, generator=run.gen).bfloat16()
    xq = quantize_x(x)
    one = QIntConfig(64, 1, 2)  # split 1: the ring's order of sums
    want = torch.stack([qint_triton(x, w[i], Q4_K, (n, k), one, xq=xq)[0]
                        for i in range(layers)])
    cfg = default_qint_config(Q4_K, n, k, run.sms, m=1)
    row["launch_config"] = list(cfg)

    def chained() -> None:
        xl = quantize_x(x)
        for i in range(layers):
            qint_triton(x, w[i], Q4_K, (n, k), cfg, xq=xl)

    row["launches"] = run.time_us([chained]) / layers
    xlo, xhi = quad_order_x(xq, k)
    bs = xq.bs[0].to(torch.int32).contiguous()
    y = torch.empty(layers, n, dtype=torch.float32, device=run.dev)
    ctr = torch.zeros(1024, dtype=torch.int32, device=run.dev)
    row["ring"] = []
    layer_bytes = w[0].numel()
    for warps, s, d, per_sm, rt in configs:
        bn = 4 * warps * rt
        if n % bn or (k // 256) % s:
            continue
        programs = min(n // bn, per_sm * run.sms)
        built = _ring_kernel.warmup(w, xlo, xhi, bs, xq.dx[0], y, ctr, n, k, layers,
                                    WARPS=warps, S=s, D=d, WAIT=True, RT=rt, num_warps=warps,
                                    grid=(programs,))
        fits = resident(built, warps, run.sms)
        config = {"warps": warps, "s": s, "d": d, "per_sm": per_sm, "rt": rt,
                  "programs": programs}
        row.setdefault("resident", []).append([warps, s, d, rt, fits, built.n_regs,
                                               built.metadata.shared])
        for wait in (True, False) if programs <= fits else (False,):
            def launch(wait=wait, warps=warps, s=s, d=d, programs=programs, rt=rt) -> None:
                ctr.zero_()
                _ring_kernel[(programs,)](w, xlo, xhi, bs, xq.dx[0], y, ctr, n, k, layers,
                                          WARPS=warps, S=s, D=d, WAIT=wait, RT=rt,
                                          num_warps=warps)
            y.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            gave_up = int(ctr[1::2].sum())  # chain_bench's polls that gave up, a product each
            ok = bool(torch.equal(y, want)) and gave_up == 0
            entry = {**config, "wait": wait, "ok": ok, "gave_up": gave_up}
            if not ok:
                off = (y != want).any(dim=1).nonzero()
                entry["first_off"] = int(off[0]) if len(off) else None
                entry["max_abs_err"] = float((y - want).abs().nan_to_num(1e30).max())
            entry["us"] = run.time_us([launch]) / layers
            row["ring"].append(entry)
        for probe in probes if programs <= fits else ():
            def probed(probe=probe, warps=warps, s=s, d=d, programs=programs, rt=rt) -> None:
                _ring_kernel[(programs,)](w, xlo, xhi, bs, xq.dx[0], y, ctr, n, k, layers,
                                          WARPS=warps, S=s, D=d, WAIT=False, RT=rt,
                                          PROBE=probe, num_warps=warps)
            row["ring"].append({**config, "wait": ("copies", "products")[probe - 1],
                                "ok": True, "probe": True,
                                "us": run.time_us([probed]) / layers})

        def launches(warps=warps, s=s, d=d, programs=programs, rt=rt) -> None:
            kern = launcher(_ring_kernel, run.dev)  # PDL launches inside the capture
            wb = w.view(-1)
            for i in range(layers):
                kern[(programs,)](wb[i * layer_bytes:], xlo, xhi, bs, xq.dx[0], y[i], ctr, n,
                                  k, 1, WARPS=warps, S=s, D=d, WAIT=False, RT=rt,
                                  num_warps=warps)
        y.fill_(float("nan"))
        launches()
        torch.cuda.synchronize()
        ok = bool(torch.equal(y, want))
        entry = {**config, "wait": "pdl", "ok": ok, "gave_up": 0}
        entry["us"] = run.time_us([launches]) / layers
        row["ring"].append(entry)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--configs", default=CONFIGS, help="WARPS:S:D:PROGRAMS_A_SM:ROWS_A_THREAD,...")
    ap.add_argument("--probes", action="store_true",
                    help="also time each config's copies alone and its products alone "
                         "(wrong outputs, timing only)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.smoke = False
    if not (HAS_GLUON and torch.cuda.is_available()):
        print("stream_bench needs an NVIDIA GPU and Triton's Gluon", file=sys.stderr)
        return 2
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    run = Run(args)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": torch.cuda.get_device_name(0), **run.out}
    out["ceilings"] = ceilings(run)
    print(f"copy {out['ceilings']['copy_gb_s']:.0f} GB/s; us a product (GB/s):", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        if run.left() < 20:
            out["skipped"].append(shape)
            continue
        row = run.attempt(shape, lambda n=n, k=k: chain(run, n, k, args.layers, configs,
                                                             (1, 2) if args.probes else ()))
        if row is None:
            continue
        out["rows"].append(row)
        mb = row["mb_per_product"]
        gbs = mb / row["launches"] * 1e3
        print(f"Q4_K {n:6} x {k:6} launches {row['launches']:7.2f} ({gbs:5.0f})", flush=True)
        for e in row["ring"]:
            how = {True: "wait", False: "free"}.get(e["wait"], e["wait"])
            print(f"   ring w{e['warps']} s{e['s']} d{e['d']} x{e['per_sm']} r{e['rt']} {how} "
                  f"{e['us']:7.2f} ({mb / e['us'] * 1e3:5.0f})"
                  f"{'' if e['ok'] else '  WRONG ' + json.dumps(e)}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "stream_bench.json").write_text(json.dumps(out, indent=1))
    bad = [(r["n"], e["warps"], e["s"], e["d"]) for r in out["rows"] for e in r["ring"]
           if not e["ok"]]
    print(f"failures: {bad}; errors: {out['errors']}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
