"""Chained one-row Q4_K products: what a persistent decode kernel would save over launches.

A decode step at one stream is a chain of products, each waiting for the one before; a
small product's time is mostly its ramp (its first weights arrive a DRAM latency after it
may start) and its tail. This bench times `layers` products of one shape, x fixed (one
row, quantized once), each weight matrix its own (they miss the L2), nine ways:

- `launches`: one qint launch each (kernels/qint.py, the engine's one-row build), in one
  CUDA graph with programmatic dependent launches: each waits for the one before;
- `barrier`: one launch of a persistent kernel, a program for each in_cta tile (the same
  tile, loads and sums as qint's: the same bits), a grid barrier between products (an
  atomic count, then a spin until every program has arrived), the next product's first
  super-block loaded after it;
- `prefetch`: the same, the next product's first super-block loaded before the barrier
  (its weights stream while the slowest program finishes the product before);
- `tree`: `prefetch` with the barrier's arrivals spread over 16 counters, the last of each
  group counting it into the top one (is the barrier's cost its one contended counter?);
- `free`: no barrier, each program streams through its tiles of every product: the bound.

Square shapes run again as a dependent chain (`dep`): each product's x is the output of
the one before, quantized (as quantize_x does) by the kernel's programs between two
barriers, against launches of quantize_x and the product in turn (the engine's o
projection after its attention). Random weights grow the chain's values about 20 000x a
product, so past the 8th they overflow to inf and NaN (a float32 run of the same chain:
bench/RESULTS.md, 2026-12-05): the check counts a NaN where qint_triton's output has one
as equal (`same_bits`).

Every product's output is checked bit-equal to qint_triton's. The barrier needs every
program resident at once: a shape whose tiles do not fit is skipped, and the spin gives up
after SPIN_LIMIT polls (its check then fails) rather than hang.

    python3 bench/gpu/chain_bench.py [--layers 32] [--shapes 4096x4096,...] [--split S] [--out DIR]
    python3 bench/gpu/chain_bench.py --smoke    # interpreted, tiny shapes, no barrier

Writes $OUT/chain_bench.json and prints us a product and GB/s.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported: the interpreter's own functions
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernels_check import random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run, ceilings  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents  # noqa: E402

from kernels import qint, qint_gemv, quant_x  # noqa: E402
from kernels.qgemv import sum_partials  # noqa: E402
from kernels.qint import Q4_K, default_qint_config, qint_triton  # noqa: E402
from kernels.quant_x import quantize_x  # noqa: E402
from kernels.triton_util import await_inputs, launcher  # noqa: E402

SHAPES = "4096x4096,6144x4096,4096x14336,28672x4096"
TREE_GROUPS = 16  # _tree_barrier's arrival counters
SPIN_LIMIT = tl.constexpr(1 << 18)  # polls a barrier waits at most (a stuck one: ~0.2 s)


@triton.jit
def _grid_barrier(ctr_ptr, target):
    """Every program of the grid here: count this one in (release: its stores before),
    then _await_count."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
    _await_count(ctr_ptr, target)


@triton.jit
def _await_count(ctr_ptr, target):
    """Polls the count at ctr_ptr (acquire) until it reaches `target`, at most SPIN_LIMIT
    times; a program whose polls gave up counts itself into ctr_ptr[1] (the bench's check
    reads it)."""
    seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.atomic_add(ctr_ptr + 1, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tree_barrier(ctr_ptr, passes, GROUPS: tl.constexpr):
    """_grid_barrier's meaning, the arrivals spread over GROUPS counters (each on its own
    128-byte line from ctr_ptr + 32; fewer groups than GROUPS when there are fewer
    programs): a program counts itself into counter pid % groups (acq_rel); the one that
    completes its group's count for this pass (the passes-th) counts the group into the
    top counter ctr_ptr (release: cumulative, so every member's stores before); every
    program awaits all groups in the top (_await_count)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    groups = tl.minimum(nprog, GROUPS)
    g = pid % groups
    members = (nprog - g + groups - 1) // groups
    tl.debug_barrier()
    old = tl.atomic_add(ctr_ptr + 32 + g * 32, 1, sem="acq_rel", scope="gpu")
    if old == passes * members - 1:
        tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")
    _await_count(ctr_ptr, passes * groups)


@triton.jit
def _barrier(ctr_ptr, passes, GROUPS: tl.constexpr):
    """The grid's passes-th barrier: _tree_barrier over GROUPS counters, or with GROUPS 0
    _grid_barrier (every program in once a pass)."""
    if GROUPS > 0:
        _tree_barrier(ctr_ptr, passes, GROUPS)
    else:
        _grid_barrier(ctr_ptr, passes * tl.num_programs(0))


@triton.jit
def _chain_kernel(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, ctr_ptr, N, K, row_bytes, layer_bytes,
                  sb_per_split, layers, dx_slot, BLOCK_N: tl.constexpr, S: tl.constexpr,
                  PTX: tl.constexpr, BARRIER: tl.constexpr, PREFETCH: tl.constexpr,
                  DEP: tl.constexpr = False, GROUPS: tl.constexpr = 0):
    """y[l] = W_l x_l for l < layers: program p takes in_cta tile p of every product (BLOCK_N
    rows: split v % S of weight row v // S, as qint's _qint_gemv_kernel with IN_CTA). x_l is
    x_0 (q, dx, bs at slot 0) for every l, or with DEP (N = K) y[l - 1] quantized: after a
    barrier the programs quantize its super-blocks into slot l (quantize_store, as
    quantize_x), then a second barrier. Each x_l has its own slot: no program reads a stale
    copy of an earlier one. GROUPS > 0: _tree_barrier's arrivals over GROUPS counters
    instead of _grid_barrier's one."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    TILE: tl.constexpr = BLOCK_N // S
    v = tl.arange(0, BLOCK_N)
    rn = pid * TILE + v // S
    sb0 = (v % S) * sb_per_split
    row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
    w, head = qint_gemv._ld_q4k(w_ptr, row_off, sb0)
    passes = 0
    for layer in range(layers):
        wl = w_ptr + tl.cast(layer, tl.int64) * layer_bytes
        if DEP:
            slot = layer
        else:
            slot = 0
        qp, dxp, bsp = q_ptr + slot * K, dx_ptr + slot * dx_slot, bs_ptr + slot * (K // 16)
        acc = tl.zeros((BLOCK_N, 1), tl.float32)
        acc = qint_gemv._sb_q4k(acc, w, head, sb0[:, None], qp, dxp, bsp, K, 1, 1, PTX, True)
        for i in range(1, sb_per_split):
            wi, hi = qint_gemv._ld_q4k(wl, row_off, sb0 + i)
            acc = qint_gemv._sb_q4k(acc, wi, hi, (sb0 + i)[:, None], qp, dxp, bsp, K, 1, 1, PTX,
                               True)
        yl = y_ptr + tl.cast(layer, tl.int64) * N
        qint_gemv._finish_in_cta(acc, yl, y_ptr, pid, 1, N, 1, BLOCK_N, S)
        nxt = w_ptr + tl.cast((layer + 1) % layers, tl.int64) * layer_bytes  # the last: 0
        if PREFETCH:
            w, head = qint_gemv._ld_q4k(nxt, row_off, sb0)
        if BARRIER:
            passes += 1
            _barrier(ctr_ptr, passes, GROUPS)
        if DEP:  # y[layer] -> x slot layer + 1, its super-blocks spread over the programs
            for b in range(pid, K // 256, nprog):
                bb = b + tl.zeros((1,), tl.int32)
                xv = tl.load(yl + bb[:, None] * 256 + tl.arange(0, 256)[None, :])
                quant_x.quantize_store(xv, bb, bb >= 0, 0, q_ptr + (slot + 1) * K,
                                    dx_ptr + (slot + 1) * dx_slot, bs_ptr + (slot + 1) * (K // 16),
                                    K)
            passes += 1
            _barrier(ctr_ptr, passes, GROUPS)
        if not PREFETCH:
            w, head = qint_gemv._ld_q4k(nxt, row_off, sb0)


@triton.jit
def _poll_flag(flag_ptr, need, gave_up_ptr, SLEEP: tl.constexpr):
    """Polls the count at flag_ptr (acquire) until it reaches `need`, at most SPIN_LIMIT
    times (a program that gives up counts itself into gave_up_ptr: the bench's check);
    SLEEP > 0: nanoseconds between polls (NVIDIA's nanosleep)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < need) & (spins < SPIN_LIMIT):
        if SLEEP > 0:
            tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP};", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        tl.atomic_add(gave_up_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _flow_kernel(q_ptr, dx_ptr, bs_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, done_ptr, blk_ptr,
                 N, K, row_bytes, sb_per_split, nsplit, layer, tiles_per_slice, dx_slot,
                 BLOCK_N: tl.constexpr, PTX: tl.constexpr, FLAGS: tl.constexpr,
                 EARLY: tl.constexpr, SLEEP: tl.constexpr, DEP: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    """Product `layer` of the chain on programs of their own a split (grid (tiles, splits),
    qint's grid split: the last program of a tile adds the partials in split order), x
    fixed. FLAGS: instead of waiting for the whole previous launch (await_inputs), split s
    waits only for the previous product's tiles of slice s (its rows [s N / S, (s + 1) N /
    S): done_ptr[64 (layer - 1) + s] counts them as their sums land), as a product whose
    x is the one before's output needs: a program streams its weights as soon as its
    slice is in, while the previous product's last tiles still run. EARLY: the next launch
    may start before this one's wait (else after it). done_ptr[64 * 64]: polls given up.
    DEP (N = K, FLAGS): x is the product before's output, quantized: x slot `layer` (q, dx,
    bs at slot strides K, dx_slot, K / 16); the last of a 256-row block's tiles to land
    (blk_ptr[64 layer + block] counts them) quantizes the block into slot layer + 1
    (quantize_store, as quantize_x) and counts it into the flag of its slice: split s
    waits for its sb_per_split blocks."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
    sb0 = split * sb_per_split
    if DEP:
        q_ptr += layer * K
        dx_ptr += layer * dx_slot
        bs_ptr += layer * (K // 16)
        need = sb_per_split
    else:
        need = tiles_per_slice
    w, head = qint_gemv._ld_q4k(w_ptr, row_off, sb0)
    if FLAGS:
        if PDL and EARLY:
            gdc_launch_dependents()
        if layer > 0:
            _poll_flag(done_ptr + 64 * (layer - 1) + split, need, done_ptr + 64 * 64, SLEEP)
        if PDL and not EARLY:
            gdc_launch_dependents()
    else:
        await_inputs(PDL)
    acc = tl.zeros((BLOCK_N, 1), tl.float32)
    acc = qint_gemv._sb_q4k(acc, w, head, sb0, q_ptr, dx_ptr, bs_ptr, K, 1, 1, PTX)
    for i in range(1, sb_per_split):
        wi, hi = qint_gemv._ld_q4k(w_ptr, row_off, sb0 + i)
        acc = qint_gemv._sb_q4k(acc, wi, hi, sb0 + i, q_ptr, dx_ptr, bs_ptr, K, 1, 1, PTX)
    offs = rn[:, None] + tl.zeros((1, 1), tl.int64)
    mask = (rn < N)[:, None]
    tl.store(part_ptr + split * N + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the ticket
    arrived = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == nsplit - 1:  # the tile's last: its sum, then the slice's count
        sum_partials(y_ptr, part_ptr, N, offs, mask, nsplit)
        tl.atomic_xchg(ticket_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # every thread's sums are written before the count
        if DEP:
            b = pid_n * BLOCK_N // 256
            got = tl.atomic_add(blk_ptr + 64 * layer + b, 1, sem="acq_rel", scope="gpu")
            if got == 256 // BLOCK_N - 1:  # the block's last tile: quantize it
                bb = b + tl.zeros((1,), tl.int32)
                xv = tl.load(y_ptr + bb[:, None] * 256 + tl.arange(0, 256)[None, :],
                             cache_modifier=".cg")
                quant_x.quantize_store(xv, bb, bb >= 0, 0, q_ptr + K, dx_ptr + dx_slot,
                                       bs_ptr + K // 16, K)
                tl.debug_barrier()
                tl.atomic_add(done_ptr + 64 * layer + b // sb_per_split, 1, sem="release",
                              scope="gpu")
        else:
            tl.atomic_add(done_ptr + 64 * layer + pid_n // tiles_per_slice, 1, sem="release",
                          scope="gpu")


def x_slots(first: quant_x.QuantX, slots: int, k: int) -> tuple[quant_x.QuantX, int]:
    """`slots` quantized x's (q, dx, bs rows), slot 0 holding `first`, the others zero, and
    the floats between slots' scales: each slot's scales on 128-byte lines of their own (a
    read of slot l's scales must not bring slot l + 1's line, still unwritten, into an L1)."""
    dx_slot = -(-k // 256 // 32) * 32
    xq = quant_x.QuantX(*(torch.zeros((slots, dx_slot if i == 1 else t.shape[1]),
                                      dtype=t.dtype, device=t.device)
                          for i, t in enumerate(first)))
    for t, v in zip(xq, first, strict=True):
        t[0, :v.shape[1]] = v[0]
    return xq, dx_slot


def flow(run: Run, n: int, k: int, layers: int, row: dict, w: torch.Tensor, x: torch.Tensor,
         want: torch.Tensor, cfg, dep: bool) -> None:
    """The chain on qint's grid split (`cfg`: its programs a split), launches waiting for
    the launch before (`grid`: qint_triton's launches, with dep quantize_x's between them)
    against slice flags (`flow`, `flow_late`: the next launch starts after this one's
    flags; `flow_sleep`: 200 ns between polls); into `row`."""
    s, tile = cfg.split, cfg.block_n
    tiles = -(-n // tile)
    if tiles % s or s > 64 or layers > 64 or dep and (n != k or 256 % tile):
        row["flow_skipped"] = f"{tiles} tiles of {tile} rows do not cut into {s} slices"
        return
    slots = layers + 1 if dep else 1
    first = quantize_x(x)
    xq, dx_slot = x_slots(first, slots, k)
    y = torch.empty(layers, n, dtype=torch.float32, device=run.dev)
    part = torch.empty(layers, s, n, dtype=torch.float32, device=run.dev)
    tickets = torch.zeros(layers, tiles, dtype=torch.int32, device=run.dev)
    done = torch.zeros(64 * 64 + 1, dtype=torch.int32, device=run.dev)
    blk = torch.zeros(64 * 64, dtype=torch.int32, device=run.dev)
    ptx = qint.ptx(run.dev)

    def chained(flags: bool, early: bool, sleep: int) -> None:
        done.zero_()
        blk.zero_()
        kernel = launcher(_flow_kernel, run.dev)  # PDL inside a capture
        for i in range(layers):
            kernel[(tiles, s)](*xq, w[i], y[i], part[i], tickets[i], done, blk, n, k,
                               w.shape[2], k // 256 // s, s, i, tiles // s, dx_slot,
                               BLOCK_N=tile, PTX=ptx, FLAGS=flags, EARLY=early, SLEEP=sleep,
                               DEP=dep, num_warps=cfg.num_warps)

    def launches() -> None:
        xl = first
        for i in range(layers):
            y[i] = qint_triton(x, w[i], Q4_K, (n, k), cfg, xq=xl)[0]
            if dep:
                xl = quantize_x(y[i][None])

    variants = {"grid": None, "flow": (True, True, 0), "flow_late": (True, False, 0),
                "flow_sleep": (True, True, 200)}
    if run.smoke:
        variants = {"grid": None, "flow": (True, True, 0)}
    for label, spec in variants.items():
        fn = launches if spec is None else partial(chained, *spec)
        y.fill_(float("nan"))
        run.attempt(f"{n}x{k} {label}", fn)
        row[f"{label}_ok"] = same_bits(y, want) and int(done[64 * 64]) == 0
        if not row[f"{label}_ok"]:
            row[f"{label}_gave_up"] = int(done[64 * 64])
            row[f"{label}_first_off"] = first_off(y, want)
        if not run.smoke:
            row[label] = run.time_us([fn]) / layers


def first_off(y: torch.Tensor, want: torch.Tensor) -> int | None:
    """The first product (row of y) whose bits differ from want's, or None."""
    off = (y.view(torch.int32) != want.view(torch.int32)).any(dim=1).nonzero()
    return int(off[0]) if len(off) else None


def same_bits(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values, a NaN equal to a NaN (torch.equal counts no NaN equal): the dependent
    chain's values overflow past its 8th product (the module docstring)."""
    both_nan = torch.isnan(y) & torch.isnan(want)
    return bool(((y == want) | both_nan).all()) and y.shape == want.shape


def resident(kernel, warps: int, sms: int) -> int:
    """Programs of a compiled kernel the device holds at once (registers and shared
    memory per multiprocessor; at most 32 programs each)."""
    props = torch.cuda.get_device_properties(0)
    kernel._init_handles()  # loads the binary: its register count is known from then on
    regs = max(1, kernel.n_regs) * 32 * warps
    per_sm = min(32, 65536 // regs)
    shared = getattr(kernel.metadata, "shared", 0)
    if shared:
        per_sm = min(per_sm, props.shared_memory_per_multiprocessor // shared)
    return per_sm * sms


def chain(run: Run, n: int, k: int, layers: int, dep: bool = False, split: int = 0) -> dict:
    """One shape's variants (dep: each product's x the one before's output, quantized;
    split: the in_cta split instead of the default's, 64 / split weight rows a program)."""
    cfg = default_qint_config(Q4_K, n, k, run.sms, m=1)
    if split:
        if (k // 256) % split or 64 % split:
            raise ValueError(f"--split {split} must divide {k // 256} super-blocks and 64")
        cfg = qint.in_cta_config(qint.QIntConfig(64, split, 2, None, cfg.max_regs))
    row = {"n": n, "k": k, "layers": layers, "dep": dep, "config": list(cfg),
           "mb_per_product": n * k // 256 * 144 / 1e6}
    if not (cfg.in_cta and cfg.split > 1):  # the persistent tile is in_cta's
        cfg = qint.in_cta_config(cfg._replace(split=max(2, cfg.split)))
    grid_cfg = qint.other_way(cfg)  # the flow variants' (the grid split)
    if run.smoke and dep:  # one program: its own barrier passes in the interpreter
        cfg = cfg._replace(block_n=n)
    s, tile = cfg.split, cfg.block_n
    w = torch.stack([random_blocks(run, "Q4_K", n, k) for _ in range(layers)])
    x = torch.randn(1, k, device=run.dev, generator=run.gen).bfloat16()
    xq, dx_slot = x_slots(quantize_x(x), layers + 1 if dep else 1, k)

    def launches(i: int, xl: quant_x.QuantX) -> torch.Tensor:
        return qint_triton(x, w[i], Q4_K, (n, k), cfg, xq=xl)

    want, xl = [], quantize_x(x)
    for i in range(layers):
        want.append(launches(i, xl)[0])
        if dep:
            xl = quantize_x(want[-1][None])
    want = torch.stack(want)
    row["grid_config"] = list(grid_cfg)
    flow(run, n, k, layers, row, w, x, want, grid_cfg, dep)
    y = torch.empty(layers, n, dtype=torch.float32, device=run.dev)
    ctr = torch.zeros(32 * (TREE_GROUPS + 1), dtype=torch.int32, device=run.dev)
    programs = -(-n // tile)
    args = (*xq, w, y, ctr, n, k, w.shape[2], w[0].numel(), k // 256 // s, layers,
            dx_slot)
    consts = {"BLOCK_N": tile * s, "S": s, "PTX": qint.ptx(run.dev), "DEP": dep,
              "num_warps": cfg.num_warps}
    if cfg.max_regs and not run.smoke and not dep:  # dep's quantization spills under it
        consts["maxnreg"] = cfg.max_regs

    def persistent(barrier: bool, prefetch: bool, groups: int = 0) -> None:
        if barrier:
            ctr.zero_()
        _chain_kernel[(programs,)](*args, BARRIER=barrier, PREFETCH=prefetch, GROUPS=groups,
                                   **consts)

    if dep:  # a barrier is what makes the quantized x whole
        variants = {"barrier": (True, False, 0), "prefetch": (True, True, 0),
                    "tree": (True, True, TREE_GROUPS)}
        if run.smoke:
            variants = {"prefetch": (True, True, 0), "tree": (True, True, TREE_GROUPS)}
    else:
        variants = {"free": (False, True, 0), "barrier": (True, False, 0),
                    "prefetch": (True, True, 0), "tree": (True, True, TREE_GROUPS)}
        if run.smoke:
            variants = {"free": (False, True, 0)}
    row["programs"] = programs
    for label, (barrier, prefetch, groups) in variants.items():
        if barrier and not run.smoke:
            built = _chain_kernel.warmup(*args, BARRIER=True, PREFETCH=prefetch, GROUPS=groups,
                                         grid=(programs,), **consts)
            row[f"{label}_resident"] = resident(built, cfg.num_warps, run.sms)
            if programs > row[f"{label}_resident"]:
                row[label] = None  # not every program resident: the barrier would hang
                continue
        y.fill_(float("nan"))
        persistent(barrier, prefetch, groups)
        row[f"{label}_ok"] = same_bits(y, want) and int(ctr[1]) == 0  # no poll gave up
        if not row[f"{label}_ok"]:  # where it went wrong: the first product off, polls given up
            row[f"{label}_first_off"] = first_off(y, want)
            row[f"{label}_gave_up"] = int(ctr[1])
        if not run.smoke:
            row[label] = run.time_us([partial(persistent, barrier, prefetch, groups)]) / layers
    if not run.smoke:
        def chained() -> None:
            xl = quantize_x(x)
            for i in range(layers):
                yl = launches(i, xl)
                if dep:
                    xl = quantize_x(yl)

        row["launches"] = run.time_us([chained]) / layers
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--split", type=int, default=0,
                    help="the in_cta split of every product (default: qint's for the shape); "
                         "16 at 4096 columns: every super-block a program takes is loaded "
                         "before its wait for x")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.smoke:  # tiny shapes unless named
        args.layers = 3
        args.shapes = "16x512,48x1024,512x512" if args.shapes == SHAPES else args.shapes
    run = Run(args)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": "cpu" if args.smoke else torch.cuda.get_device_name(0), **run.out}
    if not args.smoke:
        out["ceilings"] = ceilings(run)
        print(f"copy {out['ceilings']['copy_gb_s']:.0f} GB/s; us a product (GB/s):")
    labels = ("launches", "barrier", "prefetch", "tree", "free", "grid", "flow", "flow_late",
              "flow_sleep")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        if run.left() < 20:
            out["skipped"].append(shape)
            continue
        for dep in (False, True) if n == k else (False,):
            row = run.attempt(f"{shape}{' dep' if dep else ''}",
                              lambda n=n, k=k, d=dep: chain(run, n, k, args.layers, d, args.split))
            if row is None:
                continue
            out["rows"].append(row)
            cells = [f"{row[v]:7.2f} ({row['mb_per_product'] / row[v] * 1e3:5.0f})"
                     if row.get(v) else f"{'-':>15}" for v in labels]
            print(f"Q4_K {n:6} x {k:6}{' dep' if dep else '    '} programs "
                  f"{row['programs']:5} " + " ".join(
                      f"{v} {c}" for v, c in zip(labels, cells, strict=True)), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "chain_bench.json").write_text(json.dumps(out, indent=1))
    bad = [r["n"] for r in out["rows"] for key in r if key.endswith("_ok") and not r[key]]
    print(f"failures: {bad}; errors: {len(out['errors'])}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
