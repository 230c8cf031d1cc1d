"""A one-row gated MLP in one launch: gate|up, the activation and down as a flow of tiles.

At one row of x a decode step is a chain of products, and each launch waits for the whole
launch before it: its slowest program, the flush, then its own first loads. Here the MLP's
three launches (the gate|up product, the activation, the down product) are one persistent
launch whose programs take the work items in order, each program every P-th item:

- the gate|up items first, chunk by chunk of the FFN (CF columns: gate and up rows of the
  chunk), each the in-one-program tile of kernels/qint.py's one-row kernel (GU_ROWS weight
  rows in GU_S splits: the same bits as its launch); the last item of a chunk to finish
  (a count) computes the chunk's activation, quantizes it (kernels/gated_act.py's
  definition, the same bits) and marks the chunk ready;
- then the down items, chunk by chunk: D_ROWS rows of down over one chunk's columns
  (D_S splits), whose programs load their first weights, then wait for their chunk only;
  each writes its partial sum; the last of a row tile's NC partials (a count) adds them
  into y (one reduction of all NC: the same sum whichever program is last).

The order puts `lag` chunks of gate|up items ahead of each chunk's down items, so a down
item starts when its chunk is ready, while later gate|up items still stream, and no
program waits for the whole gate|up product. Every program must be resident at
once (an item waits only for items before it: with every program running, each item's
inputs are finished by programs that wait only for earlier items): `programs` is at most
what the device holds. The counts reset themselves (the last arrival zeroes its count),
so a CUDA graph replays the launch as it is; one launch's counts are free again once it
has finished, which a programmatic dependent launch after it waits for before it touches
them.

y differs from the three launches' y in its rounding (the down sums are taken in chunks);
gate|up's outputs and the quantized activation are the same bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from kernels.qint import Q4_K, Q6_K_A, QK, QuantX, row_bytes
from kernels.triton_util import HAS_TRITON, await_inputs, helper, launcher, tl, triton

__all__ = ["FlowConfig", "flow_counters", "mlp_flow"]

SPIN_LIMIT = 1 << 22  # polls a wait makes at most (a stuck launch ends, its error counted)
LINE = 32  # int32 counters a 128-byte line
DX_PAD = 32  # floats between chunks' activation scales: each chunk on its own line


class FlowConfig(NamedTuple):
    chunk_sb: int = 8  # super-blocks of a chunk (CF = 256 chunk_sb FFN columns)
    gu_rows: int = 32  # gate|up weight rows an item (kernels/qint.py's one-row tile)
    gu_split: int = 2  # its splits
    d_rows: int = 16  # down rows an item
    d_split: int = 4  # its splits of the chunk's super-blocks
    num_warps: int = 2
    max_regs: int | None = 128
    lag: int = 2  # chunks of gate|up items ahead of the down items in the order
    probe: int = 0  # timing only, wrong outputs: 1 down items never wait, 2 gate|up only


DEFAULT_CONFIG = FlowConfig()


def counter_ints(ffn: int, hidden: int, cfg: FlowConfig) -> int:
    """Counter words a launch uses: the error count, three lines a chunk, one word a row
    tile."""
    chunks = ffn // (QK * cfg.chunk_sb)
    return LINE * (1 + 3 * chunks) + hidden // cfg.d_rows


@functools.lru_cache(maxsize=16)
def flow_counters(device: torch.device, ints: int) -> torch.Tensor:
    """Zeroed counters for launches on `device` (the launches leave them zeroed)."""
    return torch.zeros(ints, dtype=torch.int32, device=device)


if HAS_TRITON:
    from kernels import qint
    from kernels.gated_act import gated
    from kernels.qint import quantize_store

    _LINE = tl.constexpr(LINE)
    _SPIN_LIMIT = tl.constexpr(SPIN_LIMIT)

    @helper
    def _arrive(ctr_ptr):
        """Count this program in at ctr_ptr after its stores (every thread's: the barrier,
        then a release) -> the count before."""
        tl.debug_barrier()
        return tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")

    @helper
    def _await(ptr, target, err_ptr):
        """Poll ptr (acquire) until it reaches target, at most SPIN_LIMIT times (then count
        an error at err_ptr); every thread reads after."""
        seen = tl.load(ptr, volatile=True)
        spins = 0
        while (seen < target) & (spins < _SPIN_LIMIT):  # plain reads: no atomic traffic
            seen = tl.load(ptr, volatile=True)
            spins += 1
        if spins >= _SPIN_LIMIT:
            tl.atomic_add(err_ptr, 1, sem="relaxed", scope="gpu")
        tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")  # what the release published
        tl.debug_barrier()

    @helper
    def _act_chunk(gu_ptr, aq_ptr, adx_ptr, abs_ptr, c, F, CSB: tl.constexpr,
                   ACT: tl.constexpr):
        """Chunk c's activation act(gate) * up, quantized (quantize_store) into the chunk's
        slots; gate|up's outputs read past the L1 (other programs wrote them)."""
        CF: tl.constexpr = CSB * 256
        b = tl.arange(0, CSB)  # every load at once: one latency, not CSB
        cols = c * CF + b[:, None] * 256 + tl.arange(0, 256)[None, :]
        g = tl.load(gu_ptr + cols, cache_modifier=".cg")
        u = tl.load(gu_ptr + F + cols, cache_modifier=".cg")
        quantize_store(gated(g, u, ACT), b, b >= 0, 0, aq_ptr + c * CF, adx_ptr + c * 32,
                       abs_ptr + c * (CF // 16), CF)

    @helper
    def _gu_item(t, q_ptr, dx_ptr, bs_ptr, wgu_ptr, gu_ptr, aq_ptr, adx_ptr, abs_ptr,
                 ctr_ptr, H, F, gu_row_bytes, GU_ROWS: tl.constexpr, GU_S: tl.constexpr,
                 CSB: tl.constexpr, ACT: tl.constexpr, PTX: tl.constexpr,
                 PDL: tl.constexpr):
        """Gate|up item t: its tile's product, its chunk's count, and the activation by the
        chunk's last."""
        CF: tl.constexpr = CSB * 256
        half = CF // GU_ROWS  # gate tiles a chunk (and as many up tiles)
        c = t // (2 * half)
        j = t % (2 * half)
        row0 = tl.where(j < half, c * CF + j * GU_ROWS, F + c * CF + (j - half) * GU_ROWS)
        BN: tl.constexpr = GU_ROWS * GU_S
        v = tl.arange(0, BN)
        rn = row0 + v // GU_S
        per = (H // 256) // GU_S
        sb0 = (v % GU_S) * per
        acc = tl.zeros((BN, 1), tl.float32)
        acc = qint._gemv_sbs(acc, wgu_ptr, rn.to(tl.int64) * gu_row_bytes, sb0, per, q_ptr,
                             dx_ptr, bs_ptr, H, 1, 12, 1, PTX, PDL, True, True)
        qint._finish_in_cta(acc, gu_ptr, gu_ptr, row0 // GU_ROWS, 1, 2 * F, 1, BN, GU_S)
        cnt = ctr_ptr + _LINE * (1 + c)
        if _arrive(cnt) == 2 * half - 1:  # the chunk's last: nobody counts here again
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            _act_chunk(gu_ptr, aq_ptr, adx_ptr, abs_ptr, c, F, CSB, ACT)
            tl.debug_barrier()
            tl.atomic_xchg(ctr_ptr + _LINE * (1 + F // CF + c), 1, sem="release", scope="gpu")

    @helper
    def _d_item(t, wd_ptr, aq_ptr, adx_ptr, abs_ptr, part_ptr, y_ptr, ctr_ptr, H, F,
                d_row_bytes, DTYPE: tl.constexpr, D_ROWS: tl.constexpr, D_S: tl.constexpr,
                CSB: tl.constexpr, NCP: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
                PROBE: tl.constexpr):
        """Down item t: its first weights, the wait for its chunk, its partial, its row
        tile's count, and the sum by the tile's last."""
        CF: tl.constexpr = CSB * 256
        NC = F // CF
        n_rt = H // D_ROWS
        c = t // n_rt
        rt = t % n_rt
        BN: tl.constexpr = D_ROWS * D_S
        PER: tl.constexpr = CSB // D_S
        v = tl.arange(0, BN)
        rn = rt * D_ROWS + v // D_S
        lsb = (v % D_S) * PER  # the chunk's super-block (the activation's slots)
        gsb = c * CSB + lsb  # the row's
        row_off = rn.to(tl.int64) * d_row_bytes
        aq, adx, abq = aq_ptr + c * CF, adx_ptr + c * 32, abs_ptr + c * (CF // 16)
        acc = tl.zeros((BN, 1), tl.float32)
        if DTYPE == 12:
            w, head = qint._ld_q4k(wd_ptr, row_off, gsb)
        else:
            ql, qh, sw, d = qint._ld_q6k(wd_ptr, row_off, gsb, F)
        await_inputs(PDL)
        ready = ctr_ptr + _LINE * (1 + NC + c)
        if PROBE != 1:
            _await(ready, 1, ctr_ptr)
        if tl.atomic_add(ctr_ptr + _LINE * (1 + 2 * NC + c), 1, sem="relaxed",
                         scope="gpu") == n_rt - 1:  # the chunk's last reader: reset both
            tl.atomic_xchg(ctr_ptr + _LINE * (1 + 2 * NC + c), 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(ready, 0, sem="relaxed", scope="gpu")
        if DTYPE == 12:
            acc = qint._sb_q4k(acc, w, head, lsb[:, None], aq, adx, abq, CF, 1, 1, PTX, True)
        else:
            acc = qint._sb_q6k(acc, ql, qh, sw, d, lsb[:, None], aq, adx, abq, CF, 1, 1, PTX,
                               True, True)
        for i in range(1, PER):
            if DTYPE == 12:
                w, head = qint._ld_q4k(wd_ptr, row_off, gsb + i)
                acc = qint._sb_q4k(acc, w, head, (lsb + i)[:, None], aq, adx, abq, CF, 1, 1,
                                   PTX, True)
            else:
                ql, qh, sw, d = qint._ld_q6k(wd_ptr, row_off, gsb + i, F)
                acc = qint._sb_q6k(acc, ql, qh, sw, d, (lsb + i)[:, None], aq, adx, abq, CF,
                                   1, 1, PTX, True, True)
        qint._finish_in_cta(acc, part_ptr + c * H, part_ptr, rt, 1, H, 1, BN, D_S)
        cnt = ctr_ptr + _LINE * (1 + 3 * NC) + rt
        if _arrive(cnt) == NC - 1:  # the tile's last partial: the sum in chunk order
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            rows = rt * D_ROWS + tl.arange(0, D_ROWS)
            ch = tl.arange(0, NCP)[:, None]  # every partial at once: one latency
            parts = tl.load(part_ptr + ch * H + rows[None, :], mask=ch < NC, other=0.0,
                            cache_modifier=".cg")
            tl.store(y_ptr + rows, tl.sum(parts, axis=0))

    @triton.jit
    def _mlp_flow_kernel(q_ptr, dx_ptr, bs_ptr, wgu_ptr, gu_ptr, aq_ptr, adx_ptr, abs_ptr,
                         wd_ptr, part_ptr, y_ptr, ctr_ptr, H, F, gu_row_bytes, d_row_bytes,
                         DTYPE: tl.constexpr, ACT: tl.constexpr, CSB: tl.constexpr,
                         GU_ROWS: tl.constexpr, GU_S: tl.constexpr, D_ROWS: tl.constexpr,
                         D_S: tl.constexpr, LAG: tl.constexpr, NCP: tl.constexpr,
                         PTX: tl.constexpr = False,
                         PDL: tl.constexpr = False, PROBE: tl.constexpr = 0):
        """The module docstring's launch: x (q, dx, bs) of H columns, gate|up (2 F Q4_K
        rows) into gu (2 F), the activation into aq, adx (DX_PAD a chunk), abs, down (H
        rows of DTYPE) into part (NC, H) and y (H); program p takes items p, p + P, ...
        of the order below (LAG: chunks of gate|up ahead of down's)."""
        NC = F // (CSB * 256)
        n_gc = 2 * (CSB * 256 // GU_ROWS)  # gate|up items a chunk
        n_dc = H // D_ROWS  # down items a chunk
        lag = tl.minimum(LAG, NC)
        n_items = NC * (n_gc + n_dc)
        if PROBE == 2:
            lag = NC
            n_items = NC * n_gc
        head = lag * n_gc
        pair = n_gc + n_dc
        for t in range(tl.program_id(0), n_items, tl.num_programs(0)):
            # the order: gate|up of chunks 0 .. lag - 1, then gate|up of chunk lag + k and
            # down of chunk k in turn, then down of the last lag chunks
            u = t - head
            k = u // pair
            r = u - k * pair
            gu = (t < head) | ((k < NC - lag) & (r < n_gc))
            gi = tl.where(t < head, t, (lag + k) * n_gc + r)
            di = tl.where(k < NC - lag, k * n_dc + r - n_gc, u - (NC - lag) * n_gc)
            if gu:
                _gu_item(gi, q_ptr, dx_ptr, bs_ptr, wgu_ptr, gu_ptr, aq_ptr, adx_ptr, abs_ptr,
                         ctr_ptr, H, F, gu_row_bytes, GU_ROWS, GU_S, CSB, ACT, PTX, PDL)
            else:
                _d_item(di, wd_ptr, aq_ptr, adx_ptr, abs_ptr, part_ptr, y_ptr, ctr_ptr,
                        H, F, d_row_bytes, DTYPE, D_ROWS, D_S, CSB, NCP, PTX, PDL, PROBE)
        await_inputs(PDL)  # a program without items still waits (the chain's rule)


def check_shapes(hidden: int, ffn: int, cfg: FlowConfig) -> None:
    """Raise InvalidRequest where the config's tiles do not cut the shapes evenly."""
    cf = QK * cfg.chunk_sb
    bad = [why for ok, why in (
        (hidden % QK == 0 and (hidden // QK) % cfg.gu_split == 0,
         f"hidden {hidden} in {cfg.gu_split} splits of whole super-blocks"),
        (ffn % cf == 0, f"ffn {ffn} in chunks of {cf}"),
        (cf % cfg.gu_rows == 0, f"a chunk's {cf} rows in tiles of {cfg.gu_rows}"),
        (cfg.chunk_sb % cfg.d_split == 0, f"{cfg.chunk_sb} super-blocks in {cfg.d_split}"),
        (hidden % cfg.d_rows == 0, f"hidden {hidden} in tiles of {cfg.d_rows}"),
    ) if not ok]
    if bad:
        raise InvalidRequest("mlp_flow: " + "; ".join(bad))


def _launch_args(xq: QuantX, gate_up: torch.Tensor, down: torch.Tensor, down_type: int,
                 hidden: int, ffn: int, activation: str, cfg: FlowConfig,
                 ctr: torch.Tensor) -> tuple[tuple, dict, tuple[torch.Tensor, ...]]:
    """The kernel's arguments and constants, and its outputs (y, gu, aq's three)."""
    from kernels.gated_act import ACTIVATION_IDS
    from kernels.qgemv import ptx

    dev = xq.q.device
    chunks = ffn // (QK * cfg.chunk_sb)
    gu = torch.empty(1, 2 * ffn, dtype=torch.float32, device=dev)
    aq = QuantX(torch.empty(1, ffn, dtype=torch.int8, device=dev),
                torch.empty(1, chunks * DX_PAD, dtype=torch.float32, device=dev),
                torch.empty(1, ffn // 16, dtype=xq.bs.dtype, device=dev))
    part = torch.empty(chunks, hidden, dtype=torch.float32, device=dev)
    y = torch.empty(1, hidden, dtype=torch.float32, device=dev)
    consts = {"DTYPE": int(down_type), "ACT": ACTIVATION_IDS[activation],
              "CSB": cfg.chunk_sb, "GU_ROWS": cfg.gu_rows, "GU_S": cfg.gu_split,
              "D_ROWS": cfg.d_rows, "D_S": cfg.d_split, "LAG": cfg.lag,
              "NCP": 1 << (chunks - 1).bit_length(), "PTX": ptx(dev),
              "num_warps": cfg.num_warps, **({"PROBE": cfg.probe} if cfg.probe else {})}
    if cfg.max_regs is not None and dev.type == "cuda" and not torch.version.hip:
        consts["maxnreg"] = cfg.max_regs
    args = (*xq, gate_up, gu, *aq, down, part, y, ctr, hidden, ffn, gate_up.shape[1],
            down.shape[1])
    return args, consts, (y, gu, aq)


def resident_programs(xq: QuantX, gate_up: torch.Tensor, down: torch.Tensor, down_type: int,
                      hidden: int, ffn: int, activation: str,
                      cfg: FlowConfig = DEFAULT_CONFIG) -> int:
    """Programs of the launch a GPU holds at once (registers, shared memory, warps and
    program slots a multiprocessor; the build with and without programmatic dependent
    launch, the fewer): the most `programs` mlp_flow may take there."""
    from kernels.triton_util import compiled

    dev = xq.q.device
    props = torch.cuda.get_device_properties(dev)
    args, consts, _ = _launch_args(xq, gate_up, down, down_type, hidden, ffn, activation,
                                   cfg, flow_counters(dev, counter_ints(ffn, hidden, cfg)))
    warp = props.warp_size
    per_sm = []
    for pdl in (False, True):
        kernel = compiled(_mlp_flow_kernel).warmup(*args, grid=(1,), PDL=pdl, **consts)
        kernel._init_handles()
        threads = cfg.num_warps * warp
        regs = getattr(props, "regs_per_multiprocessor", 65536)
        n = min(regs // (max(1, kernel.n_regs) * threads),
                props.max_threads_per_multi_processor // threads, 32)
        shared = getattr(kernel.metadata, "shared", 0)
        if shared:
            n = min(n, props.shared_memory_per_multiprocessor // shared)
        per_sm.append(n)
    return min(per_sm) * props.multi_processor_count


def mlp_flow(xq: QuantX, gate_up: torch.Tensor, down: torch.Tensor, down_type: int,
             hidden: int, ffn: int, activation: str, programs: int,
             cfg: FlowConfig = DEFAULT_CONFIG, counters: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, QuantX]:
    """One row x (quantized, `hidden` columns) through the gated MLP: gate_up (2 ffn Q4_K
    rows), `activation` ("silu" or "gelu"), down (hidden rows of Q4_K or Q6_K_A) ->
    (y (1, hidden), gate_up's outputs (1, 2 ffn), the activation quantized), float32, on
    `programs` programs, every one resident (see the module docstring)."""
    from kernels.gated_act import ACTIVATION_IDS

    check_shapes(hidden, ffn, cfg)
    if down_type not in (Q4_K, Q6_K_A) or activation not in ACTIVATION_IDS:
        raise InvalidRequest(f"mlp_flow: down type {down_type}, activation {activation!r}")
    if tuple(gate_up.shape) != (2 * ffn, row_bytes(Q4_K, hidden)) or \
            tuple(down.shape) != (hidden, row_bytes(down_type, ffn)) or \
            tuple(xq.q.shape) != (1, hidden):
        raise InvalidRequest("mlp_flow: gate_up, down or x do not have the shapes given")
    dev = xq.q.device
    ctr = flow_counters(dev, counter_ints(ffn, hidden, cfg)) if counters is None else counters
    args, consts, (y, gu, aq) = _launch_args(xq, gate_up, down, down_type, hidden, ffn,
                                             activation, cfg, ctr)
    launcher(_mlp_flow_kernel, dev)[(programs,)](*args, **consts)
    return y, gu, aq


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the default config with each down type, both targets (ROCm has no
    programmatic dependent launch: PDL False there, as launcher gives it)."""
    if not HAS_TRITON:
        return []
    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*i32", "wgu_ptr": "*u8",
           "gu_ptr": "*fp32", "aq_ptr": "*i8", "adx_ptr": "*fp32", "abs_ptr": "*i32",
           "wd_ptr": "*u8", "part_ptr": "*fp32", "y_ptr": "*fp32", "ctr_ptr": "*i32",
           "H": "i32", "F": "i32", "gu_row_bytes": "i32", "d_row_bytes": "i32",
           **dict.fromkeys(("DTYPE", "ACT", "CSB", "GU_ROWS", "GU_S", "D_ROWS", "D_S", "LAG",
                            "NCP", "PTX", "PDL"), "constexpr")}
    cfg = FlowConfig()
    divisible = tuple(a for a, t in sig.items() if t != "constexpr")  # as the launches are
    out = []
    for name, dtype in (("Q4_K", Q4_K), ("Q6_K", Q6_K_A)):
        consts = {"DTYPE": dtype, "ACT": 0, "CSB": cfg.chunk_sb, "GU_ROWS": cfg.gu_rows,
                  "GU_S": cfg.gu_split, "D_ROWS": cfg.d_rows, "D_S": cfg.d_split,
                  "LAG": cfg.lag, "NCP": 8}
        out.append(spec(f"mlp_flow_{name}", _mlp_flow_kernel, sig,
                        {**consts, "PTX": True, "PDL": True}, cfg.num_warps, False, "cuda",
                        divisible=divisible, max_regs=cfg.max_regs))
        out.append(spec(f"mlp_flow_{name}", _mlp_flow_kernel, sig,
                        {**consts, "PTX": False, "PDL": False}, cfg.num_warps, False, "hip",
                        divisible=divisible))
    return out
