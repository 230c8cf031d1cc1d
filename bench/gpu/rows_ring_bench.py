"""One-row Q4_K products from a shared-memory ring, with a leaner consumer than
stream_bench's: is multiplying staged weights fast enough to pay for staging them?

stream_bench (bench/RESULTS.md, 2026-12-03) staged the next products' weights in a
shared-memory ring: its copies alone ran at 87% of the copy ceiling, but its products from
shared memory ran below the memory rate (about 141 instructions a thread for each quad of
4 code words, against qint's ~64), so the staging could not pay. Here the same ring (its
copies: stream_bench._issue, a tile of BN = 32 RPT rows, S super-blocks a slot, D slots)
feeds a consumer laid out for fewer instructions:

- warps along the 8 quads of a super-block (W warps, 8 / W quads a thread), lanes along
  rows: a thread takes its quads of RPT rows, whose x words it loads once a super-block;
  the codes' buffer is swizzled so that a warp's 32 rows of one quad read without bank
  conflicts;
- the scales and mins decoded as packed bytes (four words a row and super-block, not a
  6-bit field a quad);
- the sums kept per row and quad in float across the tile's super-blocks, added across
  the quads once a tile (stream_bench's and qint's add them every super-block, in
  integers, across lanes). So the outputs are not qint's bits: they are checked against
  qint's (split 1) within a relative tolerance.

x is read as quantize_x writes it (no permuted copy). Variants, us a product:

- `launches`: qint's one-row launches chained in one CUDA graph with programmatic
  dependent launches (the engine's build);
- `pdl`: a launch a product, each program's first D - 1 slots copied before its
  programmatic dependent wait;
- `free` / `wait`: one persistent launch for all products, without / with the wait on the
  previous product's count (stream_bench's);
- `copies` / `products` (`--probes`): the copies alone, the products alone (timing only).

`--gap-us G` puts a kernel of one program that waits for the product before it and then
spins G us before each product of `launches` and `pdl`: a decode step's small kernels
(norm, attention, activation) between its products. Their chain alone is timed too
(`gaps`). A gap `Gt` lets the product after it start as it begins (programmatic dependent
launch, as the engine's small kernels do): the product's programs then load their first
weights (qint: a super-block a thread; `pdl`: D - 1 slots) while it spins. A plain `G`
lets nothing start before it ends.

    python3 bench/gpu/rows_ring_bench.py [--layers 32] [--shapes 4096x4096,...]
        [--configs W:RPT:S:D:PER_SM,...] [--gap-us 0,4,4t] [--probes] [--out DIR]
    ncu --section WarpStateStats ... python3 bench/gpu/rows_ring_bench.py \
        --profile 8:2:4:2:2 --shapes 28672x4096 [--probe 2]

`--profile` launches one config's persistent kernel (`--probe`: 0 the products with their
copies and no wait, 2 the products alone) five times outside any graph, for a profiler.

Writes $OUT/rows_ring_bench.json.

Measured on the H200 (bench/RESULTS.md, 2026-12-03, rows_ring and rows_ring_bench's `pdl`
launches): every output within 6e-7 of qint's. The consumer alone runs at 4.5 TB/s at
28672 x 4096 (stream_bench's: 3.4), about the memory rate, not the twice it would need:
its programs issue 2.4 instructions a cycle (ncu), latency-bound on 14 warps a
multiprocessor. With the wait between products, and as a launch a product, it loses to
qint's launches at every shape. After a `6t` gap a 4096 x 4096 product whose programs
copied every weight before their wait still takes 5.5 us (qint: 4.0): the multiply of
what a program holds, not the memory, is what the wait exposes.
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from chain_bench import _await_count, resident  # noqa: E402
from kernels_check import random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run, ceilings  # noqa: E402

from kernels.qint import Q4_K, QIntConfig, default_qint_config, qint_triton  # noqa: E402
from kernels.qint_mma import HAS_GLUON  # noqa: E402
from kernels.quant_x import quantize_x  # noqa: E402
from kernels.triton_util import await_inputs, launcher  # noqa: E402

SHAPES = "4096x4096,6144x4096,4096x14336,28672x4096"
# warps (4 or 8), row groups of 32 a tile, super-blocks a slot, slots, programs a
# multiprocessor
CONFIGS = "8:1:4:4:2,8:1:4:4:3,8:2:4:2:2,8:2:2:2:4,8:1:4:2:4"
TOLERANCE = 1e-5  # max |y - qint| / max |qint| of a product


@triton.jit
def _gap_kernel(out_ptr, ns, PDL: tl.constexpr = False):
    """Waits for the kernel before (PDL), lets the next one start, then spins ns
    nanoseconds: a small kernel between two products."""
    await_inputs(PDL)
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()
    tl.store(out_ptr, (t - t0).to(tl.int32))


if HAS_GLUON:
    from stream_bench import _nibble_dots, _quad_index, _quads, _ring_extent, _slot_words
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from kernels.qtiles import _f16lo

    @gluon.jit
    def _step(p, tj, kc, NC, n_my):
        """The chunk after (product p, the program's tile tj, slot kc): no division."""
        kc += 1
        if kc == NC:
            kc = 0
            tj += 1
            if tj == n_my:
                tj = 0
                p += 1
        return p, tj, kc

    @gluon.jit
    def _issue(codes, heads, slot, p, t, kc, on, w32, row_words, layer_words,
               BN: gl.constexpr, S: gl.constexpr, W: gl.constexpr):
        """cp.async of (product p, tile t, slot kc)'s S super-blocks of BN rows into ring
        slot `slot`: codes (S BN, 32) and heads (S BN, 4) words (stream_bench's copies);
        nothing unless `on` (an empty group is committed all the same)."""
        CP: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [W, 1], [1, 0])
        HP: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [W, 1], [1, 0])
        src, col = _slot_words(w32, p, t, kc, row_words, layer_words, 4, 32, CP, BN, 1, S)
        async_copy.async_copy_global_to_shared(codes.index(slot), src,
                                               mask=(col < 32 * on)[None, :])
        src, col = _slot_words(w32, p, t, kc, row_words, layer_words, 0, 4, HP, BN, 1, S)
        async_copy.async_copy_global_to_shared(heads.index(slot), src,
                                               mask=(col < 4 * on)[None, :])

    @gluon.jit
    def _byte(w, sel):
        """The byte of w that sel (0x4440 + its index) picks, zero-extended (one PRMT)."""
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [w, sel],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _rows_sb(acc, codes_sb, heads_sb, xa, xb, tq, dx, qv, BN: gl.constexpr,
                 W: gl.constexpr, L4: gl.constexpr):
        """acc (BN, 8) + one super-block of BN Q4_K rows times x, a float sum a row and
        quad: codes_sb (BN, 32) and heads_sb (BN, 4) words in shared memory; xa, xb x's
        words against each quad's low and high nibbles (four (1, 8)), tq minus x's
        sum over sub-block q (the quad index qv), dx x's scale."""
        CL: gl.constexpr = gl.BlockedLayout([1, 32 // W], [32, 1], [1, W], [1, 0])
        HL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, W], [1, 0])
        w0, w1, w2, w3 = _quads(gl.convert_layout(gl.reshape(codes_sb.load(CL),
                                                             [BN, 8, 2, 2]), L4))
        h0, h1, h2, h3 = _quads(gl.convert_layout(gl.reshape(heads_sb.load(HL),
                                                             [BN, 1, 2, 2]), L4))
        a0, a1, a2, a3 = xa
        b0, b1, b2, b3 = xb
        p_lo, p_hi = _nibble_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3)
        m = 0x0F0F0F0F
        # the 8 scales and 8 mins as bytes of four words (get_scale_min_k4's fields):
        # sub-blocks 0-3 in h1 / h2's low 6 bits, 4-7 from h3's nibbles and h1 / h2's top 2
        sc_a = h1 & 0x3F3F3F3F
        sc_b = (h3 & m) | ((h1 >> 2) & 0x30303030)
        mn_a = h2 & 0x3F3F3F3F
        mn_b = ((h3 >> 4) & m) | ((h2 >> 2) & 0x30303030)
        low = qv < 4  # quad q: sub-blocks 2 (q // 2) (low nibbles), + 1 (high); min of q
        scw = gl.where(low, sc_a, sc_b)
        pick = 0x4440 + (qv & 2)  # sub-block 2 (q // 2)'s byte, then the next one's
        dot = _byte(scw, pick) * p_lo + _byte(scw, pick + 1) * p_hi
        mn = _byte(gl.where(low, mn_a, mn_b), 0x4440 + (qv & 3))
        acc = gl.fma(dot.to(gl.float32), _f16lo(h0) * dx, acc)
        return gl.fma((mn * tq).to(gl.float32), _f16lo(h0 >> 16) * dx, acc)

    @gluon.jit
    def _rows_kernel(w_ptr, q_ptr, bs_ptr, dx_ptr, y_ptr, ctr_ptr, N, K, layers,
                     W: gl.constexpr, RPT: gl.constexpr, S: gl.constexpr, D: gl.constexpr,
                     WAIT: gl.constexpr, PDL: gl.constexpr = False, PROBE: gl.constexpr = 0):
        """y[l] = W_l x for l < layers, one row; program pid takes tiles pid, pid + G, ...
        of BN = 32 RPT rows of every product, their weights through a ring of D slots of
        S super-blocks (stream_bench's copies). PDL (a launch a product): the first D - 1
        slots' copies before the wait for the kernel before. WAIT: a product's first tile
        waits for the previous product's count. PROBE (timing only, wrong outputs): 1 the
        copies alone, 2 the products alone (no copy after the first D - 1 slots)."""
        BN: gl.constexpr = 32 * RPT
        L4: gl.constexpr = gl.BlockedLayout([1, 8 // W, 2, 2], [32, 1, 1, 1], [1, W, 1, 1],
                                            [3, 2, 1, 0])
        QL: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))  # _quads' (BN, 8)
        XL: gl.constexpr = gl.BlockedLayout([1, 32 // W], [32, 1], [1, W], [1, 0])
        # a warp reads one quad (16 bytes) of 32 rows: 16-byte units swizzled by row
        CODES: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])
        HEADS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        NC, T, n_my, C, row_words, layer_words = _ring_extent(N, K, layers, BN, S)
        w32 = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        q32 = q_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        codes = gl.allocate_shared_memory(gl.int32, [D, S * BN, 32], CODES)
        heads = gl.allocate_shared_memory(gl.int32, [D, S * BN, 4], HEADS)
        # x's words against the low nibbles of code word c: 4 q + i + 8 (q // 2) (qint's)
        c = gl.arange(0, 32, layout=gl.SliceLayout(0, XL))[None, :]
        xw = gl.max_contiguous(gl.multiple_of(c + 8 * (c // 8), [1, 4]), [1, 4])
        q4, i1, i2 = _quad_index(L4)
        boff = 2 * q4 + i2 + 0 * i1  # sub-block q's two 16-column sums (twice)
        qv, _, _, _ = _quads(q4 + 0 * i1 + 0 * i2)
        ip = 0  # the next chunk to copy: product, the program's tile, slot
        itj = 0
        ikc = 0
        for i in gl.static_range(D - 1):
            _issue(codes, heads, i, ip, pid + itj * G, ikc, (i < C).to(gl.int32), w32,
                   row_words, layer_words, BN, S, W)
            async_copy.commit_group()
            ip, itj, ikc = _step(ip, itj, ikc, NC, n_my)
        await_inputs(PDL)
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, QL))
        acc = gl.zeros([BN, 8], gl.float32, layout=QL)
        p = 0  # the chunk multiplied
        tj = 0
        kc = 0
        for ci in range(0, C):
            async_copy.wait_group(D - 2)  # this thread's copies of chunk ci
            gl.thread_barrier()  # everyone's; and the slot multiplied last is free
            on = ((ci + D - 1 < C) & (PROBE != 2)).to(gl.int32)
            _issue(codes, heads, (ci + D - 1) % D, ip, pid + itj * G, ikc, on, w32,
                   row_words, layer_words, BN, S, W)
            async_copy.commit_group()
            ip, itj, ikc = _step(ip, itj, ikc, NC, n_my)
            t = pid + tj * G
            if WAIT:
                if (kc == 0) & (t == pid) & (p > 0):  # product p's first tile here
                    _await_count(ctr_ptr + 2 * (p - 1), T)  # gave up: ctr_ptr[2 p - 1]
            if PROBE != 1:
                cs = codes.index(ci % D)
                hs = heads.index(ci % D)
                for s in gl.static_range(S):
                    sb = kc * S + s
                    xr = q32 + sb * 64 + xw
                    xa = _quads(gl.convert_layout(gl.reshape(gl.load(xr), [1, 8, 2, 2]), L4))
                    xb = _quads(gl.convert_layout(gl.reshape(gl.load(xr + 8), [1, 8, 2, 2]),
                                                  L4))
                    t0, t1, _, _ = _quads(gl.load(bs_ptr + sb * 16 + boff))
                    acc = _rows_sb(acc, cs.slice(s * BN, BN), hs.slice(s * BN, BN), xa, xb,
                                   -(t0 + t1), gl.load(dx_ptr + sb), qv, BN, W, L4)
            if kc == NC - 1:
                gl.store(y_ptr + p.to(gl.int64) * N + t * BN + rows, gl.sum(acc, axis=1))
                acc = gl.zeros([BN, 8], gl.float32, layout=QL)
                gl.thread_barrier()
                gl.atomic_add(ctr_ptr + 2 * p, 1, sem="release", scope="gpu")
            p, tj, kc = _step(p, tj, kc, NC, n_my)
        async_copy.wait_group(0)


def gap_spec(spec: str) -> tuple[float, bool]:
    """`--gap-us` item -> (us, whether the gap kernel lets the next launch start early)."""
    trigger = spec.endswith("t")
    return float(spec[:-1] if trigger else spec), trigger


def close(y: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    """Whether every product is within TOLERANCE of qint's, and the worst relative error."""
    err = float(((y - want).abs().amax(dim=1) / want.abs().amax(dim=1)).nan_to_num(1e30).max())
    return err <= TOLERANCE, err


def operands(run: Run, n: int, k: int, layers: int) -> tuple:
    """`layers` random Q4_K weights (n, k), x (1, k) bf16 and quantized, x's 16-column sums
    as int32 (the ring kernel's), y (layers, n) and the kernel's counters."""
    w = torch.stack([random_blocks(run, "Q4_K", n, k) for _ in range(layers)])
    x = torch.randn(1, k, device=run.dev, generator=run.gen).bfloat16()
    xq = quantize_x(x)
    return (w, x, xq, xq.bs[0].to(torch.int32).contiguous(),
            torch.empty(layers, n, dtype=torch.float32, device=run.dev),
            torch.zeros(1024, dtype=torch.int32, device=run.dev))


def chain(run: Run, n: int, k: int, layers: int, configs: list[tuple[int, ...]],
          gaps: list[str], probes: bool) -> dict:
    """One shape: qint launches, then each ring config's variants."""
    row: dict = {"n": n, "k": k, "layers": layers, "mb_per_product": n * k // 256 * 144 / 1e6,
                 "gaps": {}, "launches": {}, "ring": []}
    w, x, xq, bs, y, ctr = operands(run, n, k, layers)
    want = torch.stack([qint_triton(x, w[i], Q4_K, (n, k), QIntConfig(64, 1, 2), xq=xq)[0]
                        for i in range(layers)])
    cfg = default_qint_config(Q4_K, n, k, run.sms, m=1)
    row["launch_config"] = list(cfg)
    spin = torch.zeros(1, dtype=torch.int32, device=run.dev)
    plain_gap = launcher(_gap_kernel, run.dev)  # outside the capture: no PDL

    def gap_before(spec: str) -> None:
        us, trigger = gap_spec(spec)
        if us > 0:  # launcher() inside the capture: a programmatic dependent launch
            (launcher(_gap_kernel, run.dev) if trigger else plain_gap)[(1,)](
                spin, int(us * 1000), num_warps=1)

    for gap in gaps:
        if gap_spec(gap)[0] > 0:
            row["gaps"][gap] = run.time_us([lambda gap=gap: [gap_before(gap)
                                                             for _ in range(layers)]]) / layers

        def chained(gap=gap) -> None:
            xl = quantize_x(x)
            for i in range(layers):
                gap_before(gap)
                qint_triton(x, w[i], Q4_K, (n, k), cfg, xq=xl)
        row["launches"][gap] = run.time_us([chained]) / layers
    layer_bytes = w[0].numel()
    wb = w.view(-1)
    for warps, rpt, s, d, per_sm in configs:
        bn = 32 * rpt
        if n % bn or (k // 256) % s:
            continue
        programs = min(n // bn, per_sm * run.sms)
        args = (w, xq.q[0], bs, xq.dx[0], y, ctr, n, k, layers)
        meta = {"W": warps, "RPT": rpt, "S": s, "D": d, "num_warps": warps}
        built = _rows_kernel.warmup(*args, WAIT=True, grid=(programs,), **meta)
        fits = resident(built, warps, run.sms)
        config = {"warps": warps, "rpt": rpt, "s": s, "d": d, "per_sm": per_sm,
                  "programs": programs, "regs": built.n_regs, "shared": built.metadata.shared}
        for how in ("wait", "free") if programs <= fits else ("free",):
            def persistent(how=how, programs=programs, meta=meta) -> None:
                ctr.zero_()
                _rows_kernel[(programs,)](w, xq.q[0], bs, xq.dx[0], y, ctr, n, k, layers,
                                          WAIT=how == "wait", **meta)
            y.fill_(float("nan"))
            persistent()
            torch.cuda.synchronize()
            ok, err = close(y, want)
            gave_up = int(ctr[1::2].sum())
            row["ring"].append({**config, "how": how, "ok": ok and gave_up == 0,
                                "max_rel_err": err, "gave_up": gave_up,
                                "us": run.time_us([persistent]) / layers})
        for probe in (1, 2) if probes and programs <= fits else ():
            def probed(probe=probe, programs=programs, meta=meta) -> None:
                _rows_kernel[(programs,)](w, xq.q[0], bs, xq.dx[0], y, ctr, n, k, layers,
                                          WAIT=False, PROBE=probe, **meta)
            row["ring"].append({**config, "how": ("copies", "products")[probe - 1],
                                "ok": True, "us": run.time_us([probed]) / layers})
        for gap in gaps:
            def launches(gap=gap, programs=programs, meta=meta) -> None:
                for i in range(layers):
                    gap_before(gap)
                    # launcher() inside the capture: PDL (its first slots before the wait)
                    launcher(_rows_kernel, run.dev)[(programs,)](
                        wb[i * layer_bytes:], xq.q[0], bs, xq.dx[0], y[i], ctr, n, k, 1,
                        WAIT=False, **meta)
            y.fill_(float("nan"))
            launches()
            torch.cuda.synchronize()
            ok, err = close(y, want)
            row["ring"].append({**config, "how": "pdl", "gap_us": gap, "ok": ok,
                                "max_rel_err": err, "us": run.time_us([launches]) / layers})
    return row


def profile(run: Run, shape: str, config: tuple[int, ...], layers: int, probe: int) -> None:
    """Five plain launches of one config's persistent kernel (see the module docstring)."""
    n, k = (int(v) for v in shape.split("x"))
    warps, rpt, s, d, per_sm = config
    w, _, xq, bs, y, ctr = operands(run, n, k, layers)
    programs = min(n // (32 * rpt), per_sm * run.sms)
    for _ in range(5):
        _rows_kernel[(programs,)](w, xq.q[0], bs, xq.dx[0], y, ctr, n, k, layers, W=warps,
                                  RPT=rpt, S=s, D=d, WAIT=False, PROBE=probe, num_warps=warps)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--configs", default=CONFIGS, help="W:RPT:S:D:PROGRAMS_A_SM,...")
    ap.add_argument("--gap-us", default="0,4,4t",
                    help="us a kernel of one program spins before each product (0: none; "
                         "a t suffix: it lets the product start as it begins)")
    ap.add_argument("--probes", action="store_true",
                    help="also time each config's copies alone and its products alone")
    ap.add_argument("--profile", metavar="W:RPT:S:D:PER_SM",
                    help="only launch this config five times (the first shape), for ncu")
    ap.add_argument("--probe", type=int, default=2, choices=(0, 2),
                    help="--profile's kernel: 0 products and copies, 2 products alone")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.smoke = False
    if not (HAS_GLUON and torch.cuda.is_available()):
        print("rows_ring_bench needs an NVIDIA GPU and Triton's Gluon", file=sys.stderr)
        return 2
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    gaps = args.gap_us.split(",")
    for g in gaps:
        try:
            gap_spec(g)
        except ValueError:
            ap.error(f"--gap-us: {g!r} is not a number of us with an optional t suffix")
    run = Run(args)
    if args.profile:
        profile(run, args.shapes.split(",")[0], tuple(int(v) for v in args.profile.split(":")),
                args.layers, args.probe)
        return 0
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": torch.cuda.get_device_name(0), "gap_us": gaps, **run.out}
    out["ceilings"] = ceilings(run)
    print(f"copy {out['ceilings']['copy_gb_s']:.0f} GB/s; us a product (GB/s):", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        if run.left() < 20:
            out["skipped"].append(shape)
            continue
        row = run.attempt(shape, lambda n=n, k=k: chain(run, n, k, args.layers, configs,
                                                             gaps, args.probes))
        if row is None:
            continue
        out["rows"].append(row)
        mb = row["mb_per_product"]
        print(f"Q4_K {n:6} x {k:6} gaps {row['gaps']} launches "
              + " ".join(f"[gap {g}] {u:6.2f} ({mb / u * 1e3:5.0f})"
                         for g, u in row["launches"].items()), flush=True)
        for e in row["ring"]:
            gap = f" gap {e['gap_us']}" if "gap_us" in e else ""
            print(f"   w{e['warps']} r{e['rpt']} s{e['s']} d{e['d']} x{e['per_sm']} "
                  f"({e['regs']} regs, {e['shared'] // 1024} KB) {e['how']}{gap} "
                  f"{e['us']:7.2f} ({mb / e['us'] * 1e3:5.0f})"
                  f"{'' if e['ok'] else '  WRONG ' + json.dumps(e)}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "rows_ring_bench.json").write_text(json.dumps(out, indent=1))
    bad = [(r["n"], e["warps"], e["rpt"], e["s"], e["d"], e["how"]) for r in out["rows"]
           for e in r["ring"] if not e["ok"]]
    print(f"failures: {bad}; errors: {out['errors']}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
