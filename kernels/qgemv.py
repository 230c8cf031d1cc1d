"""The skinny (decode) path of the fused dequant-matmul: y = x @ W.T for M <= 16 rows of x,
W kept in its GGML blocks; and the launch configs of both qmatmul paths.

Decode is a GEMV: every weight byte is read once per step, so the kernel is built for
memory bandwidth. A program owns BLOCK_N weight rows and one of split_k equal K ranges;
per BLOCK_K step it decodes the (BLOCK_N, BLOCK_K) tile from whole GGML blocks
(kernels/qtiles.py: contiguous runs per block, scales once per sub-block) and multiplies
it with all of x's rows at once (the rows past M are masked) on the matrix unit, float32
sums: `acc (BN, 16) += dot(W_tile, x_tile.T)` (BLOCK_M = 16, the smallest tile), or for
the X_LEFT_TYPES `acc (BM, BN) += dot(x_tile, W_tile.T)` (the weight tile then goes to
shared memory once per step instead of through a shuffle with two barriers per 16
columns, see qtiles.mac; BM = 64, wgmma's left operand, or 16 for the MMA_SYNC_TYPES).
Splitting K fills the device when N alone gives too few programs.

Split partials are summed in a fixed order (split 0, 1, 2, ...) by the last program of
each N tile to arrive (a per-tile ticket counter, reset by that program), so the result
does not depend on which programs finish first and no second launch is needed.

Batch invariance (DESIGN.md): the tiled path (kernels/qmatmul.py, M > 16) decodes with the
same functions, runs the same matrix instruction over the same K order and sums the same
splits in the same order; `k_plan` (block_k, split_k) depends on (type, N, K, backend)
only, never on M. So a row's bits are the same alone, in a skinny and in a tiled batch.
On the H200 (bench/RESULTS.md, 2026-11-29) wgmma m64n16k16 rows matched m64n64k16 ones
bit for bit, and mma.sync ones did not: a type's two paths run the same family, wgmma
(block_n a multiple of 64, 4 or 8 warps) or, for the MMA_SYNC_TYPES, mma.sync on both
(checked bit for bit at M = 1, 16, 64, 512, 2026-11-30). `_qgemv_fma_kernel` is an
experiment without the matrix unit (other bits; the bench times it), not used by qmatmul.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kernels import qscaled, qtiles
from kernels.qtiles import GEOMETRY
from kernels.triton_util import HAS_TRITON, await_inputs, helper, launcher, tl, triton

__all__ = ["MMA_SYNC_TYPES", "SKINNY_MAX_M", "X_LEFT_TYPES", "QMMConfig", "aot_specs",
           "default_config", "k_plan", "ptx", "qgemv_triton", "x_left"]

SKINNY_MAX_M = 16
# Tuned on the device by bench/gpu/qmatmul_bench.py (it prints these dicts), keyed by
# (backend, GGML type, N, K) -> (block_k, split_k), the fields a row's bits depend on
# (block_k only in the interpreter: on a GPU the matrix unit chains the same 16-column
# steps whatever the tile), and (backend, type, M bucket, N, K) -> (block_n, num_warps,
# num_stages) for M <= 16.
K_PLANS: dict[tuple[str, int, int, int], tuple[int, int]] = {
    ("cuda", qtiles.Q6_K, 128256, 4096): (128, 1),  # Llama 3's head: 402 vs 509 us at 256
}
SKINNY_TILES: dict[tuple[str, int, int, int, int], tuple[int, int, int | None]] = {}
# (backend, type, N, K) -> (block_m, block_n, num_warps, num_stages) for M > 16.
TILED_TILES: dict[tuple[str, int, int, int], tuple[int, int, int, int | None]] = {}
M_BUCKETS = (1, 4, 16)
# Types whose kernels take x as the matrix unit's left operand (kernels/qtiles.py, `mac`):
# measured on the H200 (bench/RESULTS.md, 2026-11-30), Q6_K's skinny kernel 1.6-2.4x
# faster that way, Q4_K 5-20% and Q8_0 1.5-2x slower.
X_LEFT_TYPES = frozenset({qtiles.Q6_K})
# gfx1151 (RDNA 3.5, 256 VGPRs per wave): columns per step that keep a tile in registers.
_HIP_MAX_BLOCK_K = 128
# sm_90, per type (bench/gpu/qgemv_sweep.py on the H200, bench/RESULTS.md 2026-11-30):
# Q4_K at 128 columns per step and 3 stages runs at 128 instead of 168 registers a thread
# (4 blocks a multiprocessor instead of 3), 1.2-1.4x faster at 1 and 16 rows.
# BF16 at 128: the tiled build holds 242 registers a thread without spilling, where 256
# columns spill 312 bytes (`python -m kernels.aot`; its speed is to be swept on the device).
_CUDA_MAX_BLOCK_K = {qtiles.Q4_K: 128, qtiles.Q6_K: 128, qtiles.BF16: 128}
_CUDA_SKINNY_STAGES = {qtiles.Q4_K: 3}
# Types that run Ampere's mma.sync (m16n8k16) on sm_90 instead of wgmma, on both paths so
# that a row's bits stay the same: the skinny kernel with 16 rows of x on the left
# (wgmma's left operand needs 64), the tiled one with 2 warps (wgmma needs 4) and 64 x 32
# tiles. Measured on the H200 for Q6_K (bench/RESULTS.md 2026-11-30): skinny 1.2-1.4x
# faster (fewer registers than the 64-row wgmma accumulator), tiled 1.03-1.15x; the same
# bits at M = 1, 16, 64 and 512.
MMA_SYNC_TYPES = frozenset({qtiles.Q6_K})


class QMMConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # K is cut into split_k equal ranges, each a multiple of block_k
    num_warps: int = 4
    num_stages: int | None = None  # software pipelining depth; None: Triton's default


@functools.lru_cache(maxsize=4096)
def k_plan(ggml_type: int, n: int, k: int, backend: str, num_sms: int) -> tuple[int, int]:
    """(block_k, split_k) of a (n, k) weight: the largest step of at most 256 columns
    (128 on gfx1151) that divides K, and K split while the N tiles of 64 rows alone would
    give fewer than 4 programs per compute unit (num_sms 0: no split)."""
    tuned = K_PLANS.get((backend, ggml_type, n, k))
    if tuned is not None:
        return tuned
    step = GEOMETRY[ggml_type][2]
    cap = max(step, _HIP_MAX_BLOCK_K if backend == "hip" else
              _CUDA_MAX_BLOCK_K.get(ggml_type, 256))
    block_k = next((b for b in (256, 128, 64, 32) if b <= cap and b % step == 0 and k % b == 0),
                   step)
    split = 1
    tiles = -(-n // 64)
    while tiles * split < 4 * num_sms and k % (4 * split * block_k) == 0 and split < 8:
        split *= 2
    return block_k, split


def ptx(device: torch.device) -> bool:
    """Whether kernels on `device` are built for NVIDIA's PTX (the CUDA build of torch on
    a GPU): kernels/qscaled.py then decodes Q4_K codes with a few PTX instructions."""
    return device.type == "cuda" and torch.version.hip is None


def x_left(ggml_type: int) -> bool:
    """Whether `ggml_type`'s kernels multiply x (left) by the weight tile (right)."""
    return int(ggml_type) in X_LEFT_TYPES


def default_config(
    ggml_type: int, m: int, n: int, k: int, *, backend: str = "cuda", num_sms: int = 0
) -> QMMConfig:
    """The launch config for a (m, k) x (n, k)^T product on `backend` ("cuda" or "hip").

    Only tile shapes, warps and stages depend on m (see the module docstring). Both
    paths keep the matrix unit's instruction family: on sm_90 block_n is a multiple of 64
    with 4 or 8 warps (wgmma m64nNk16 for both), or for MMA_SYNC_TYPES mma.sync m16n8k16
    on both, on gfx1151 it is always WMMA 16x16x16.
    gfx1151 runs one pipeline stage and, tiled, 32-row tiles with 8 waves: no build spills
    a VGPR there (`python -m kernels.aot` reports spills); speed is to be tuned on the box.
    """
    block_k, split_k = k_plan(int(ggml_type), int(n), int(k), backend, int(num_sms))
    hip = backend == "hip"
    mma_sync = not hip and int(ggml_type) in MMA_SYNC_TYPES
    if m > SKINNY_MAX_M:
        tiled = TILED_TILES.get((backend, int(ggml_type), int(n), int(k)))
        if tiled is None:
            tiled = (64, 32, 8, 1) if hip else (64, 32, 2, None) if mma_sync else (
                64, 64, 4, None)
        return QMMConfig(tiled[0], tiled[1], block_k, split_k, tiled[2], tiled[3])
    bucket = next(b for b in M_BUCKETS if m <= b)
    tiles = SKINNY_TILES.get((backend, int(ggml_type), bucket, int(n), int(k)))
    if tiles is None:
        tiles = (64, 4, 1) if hip or x_left(ggml_type) else (
            64, 4, _CUDA_SKINNY_STAGES.get(int(ggml_type)))
    # wgmma's left operand has 64 rows; mma.sync's and WMMA's 16
    block_m = 64 if x_left(ggml_type) and not hip and not mma_sync else 16
    return QMMConfig(block_m, tiles[0], block_k, split_k, tiles[1], tiles[2])


if HAS_TRITON:

    @helper
    def sum_partials(y_ptr, part_ptr, plane, offs, mask, split_k):
        """y at offs = the split_k partials at part_ptr + s * plane + offs added in split
        order (read from the L2: other programs wrote them)."""
        total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, split_k):
            total += tl.load(part_ptr + s * plane + offs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(y_ptr + offs, total, mask=mask)

    @helper
    def finish_splits(acc, y_ptr, part_ptr, ticket_ptr, tile, split, split_k, M, N, offs, mask,
                      ticket):
        """Stores a program's sums `acc` at `offs` of the (M, N) output: into y when K is
        not split; else into part[split], and with `ticket` the last of the tile's programs
        to arrive adds the partials in split order into y and re-arms the tile's counter
        (without, qmatmul.sum_splits does it in a second launch)."""
        if split_k == 1:
            tl.store(y_ptr + offs, acc, mask=mask)
        else:
            plane = M.to(tl.int64) * N  # elements per split in part (split_k, M, N)
            tl.store(part_ptr + split * plane + offs, acc, mask=mask)
            if ticket != 0:
                tl.debug_barrier()  # every thread's partial is written before the ticket
                arrived = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == split_k - 1:  # the last: sum in split order, re-arm the counter
                    sum_partials(y_ptr, part_ptr, plane, offs, mask, split_k)
                    tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")

    # M, N and the split count are plain arguments (not specialized on their values): one
    # build serves every batch of up to 16 rows and every split but 1.
    @triton.jit(do_not_specialize=["M", "N"])
    def _qgemv_kernel(
        x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, lut_ptr, M, N, row_bytes, k_per_split,
        stride_xm, split_k, ticket, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F64: tl.constexpr,
        X_LEFT: tl.constexpr, PTX: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """y[m, n] = sum over k of x[m, k] * W[n, k] for the M (<= BLOCK_M) rows of x;
        grid (N tiles, split_k). With split_k > 1 each program writes its partial to
        part[split]; with `ticket` the last program of the tile to arrive sums them into y."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        # Rows past N read row 0 (valid memory); their results are never stored.
        row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
        acc = qtiles.acc_zeros(BLOCK_M, BLOCK_N, X_LEFT)
        k_begin = split * k_per_split
        await_inputs(PDL)
        for kk in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + kk
            acc = qscaled.step(acc, QTYPE, w_ptr, row_off, k0, lut_ptr, x_ptr, rm, m_ok,
                                stride_xm, BLOCK_N, BLOCK_K, BLOCK_M, X_LEFT, DOT_F64, PTX)
        offs, mask = qtiles.out_offsets(rm, rn, m_ok, N, X_LEFT)
        finish_splits(acc, y_ptr, part_ptr, ticket_ptr, pid_n, split, split_k, M, N, offs,
                      mask, ticket)

    @triton.jit(do_not_specialize=["M", "N"])
    def _qgemv_fma_kernel(
        x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, lut_ptr, M, N, row_bytes, k_per_split,
        stride_xm, split_k, ticket, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    ):
        """The same product without the matrix unit (an experiment for decode): float32
        weights times x in per-thread fma chains, (BM, BN, BK) partial sums reduced over K
        once at the end. Not bit-equal to the matrix-unit kernels."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        k_begin = split * k_per_split
        await_inputs(PDL)
        for kk in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + kk
            w = qtiles.dequant_tile(QTYPE, w_ptr, row_off, k0, lut_ptr, BLOCK_N, BLOCK_K)
            xk = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_ok[:, None],
                         other=0.0).to(tl.float32)  # (BM, BK)
            acc += w[None, :, :] * xk[:, None, :]
        total = tl.sum(acc, axis=2)  # (BM, BN)
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = m_ok[:, None] & (rn < N)[None, :]
        finish_splits(total, y_ptr, part_ptr, ticket_ptr, pid_n, split, split_k, M, N, offs,
                      mask, ticket)


_TICKETS = 1 << 16  # N tiles one launch can count (N up to 4M rows at block_n 64)


@functools.lru_cache(maxsize=16)
def _tickets(device: torch.device) -> torch.Tensor:
    """Per-device zeroed ticket counters; each launch leaves them zero again. Launches on
    one stream (or one graph) take turns; concurrent streams would need their own."""
    return torch.zeros(_TICKETS, dtype=torch.int32, device=device)


def qgemv_triton(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int, lut: torch.Tensor,
    cfg: QMMConfig, *, ticket: bool = True, fma: bool = False,
) -> torch.Tensor:
    """The skinny kernel on checked inputs (kernels/qmatmul.py checks and dispatches);
    `ticket` False sums the split partials with qmatmul's second kernel instead; `fma`
    runs the experimental kernel without the matrix unit (cfg.block_m >= M rows, any
    power of two; its bits differ from the matrix-unit kernels')."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    tiles = -(-n // cfg.block_n)
    ticket = ticket and tiles <= _TICKETS
    part = y if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32,
                                                  device=x.device)
    kernel, extra = ((_qgemv_fma_kernel, {}) if fma else
                     (_qgemv_kernel, {"DOT_F64": x.device.type == "cpu", "PTX": ptx(x.device),
                                      "X_LEFT": x_left(ggml_type)}))
    launcher(kernel, x.device)[(tiles, cfg.split_k)](
        x, blocks, y, part, _tickets(x.device), lut, m, n, blocks.shape[1], k // cfg.split_k,
        x.stride(0), cfg.split_k, int(ticket), QTYPE=int(ggml_type), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **extra,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )
    if cfg.split_k > 1 and not ticket:
        from kernels.qmatmul import sum_splits

        sum_splits(part, y)
    return y


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the skinny kernel of each type (bf16 x; split_k a plain argument, so
    the ticket sum is built too) with the config each backend launches at M = 1 (named
    `qmatmul_<type>_m16`), and the experimental kernel without the matrix unit."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*fp32", "part_ptr": "*fp32",
           "ticket_ptr": "*i32", "lut_ptr": "*fp32", "M": "i32", "N": "i32", "row_bytes": "i32",
           "k_per_split": "i32", "stride_xm": "i32", "split_k": "i32", "ticket": "i32"}
    divisible = ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "ticket_ptr", "lut_ptr", "row_bytes",
                 "k_per_split", "stride_xm")
    out = []
    for qtype in sorted(GEOMETRY):
        for backend in ("hip", "cuda"):
            cfg = default_config(qtype, 1, 4096, 4096, backend=backend)
            consts = {"QTYPE": qtype, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                      "BLOCK_K": cfg.block_k, "DOT_F64": False, "X_LEFT": x_left(qtype),
                      "PTX": backend == "cuda"}
            signature = {**sig, **{k: "constexpr" for k in consts}}
            out.append(spec(f"qmatmul_{qtiles.NAMES[qtype]}_m16", _qgemv_kernel, signature,
                            consts, cfg.num_warps, True, backend, cfg.num_stages, divisible))
        consts = {"QTYPE": qtype, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256}
        out.append(spec(f"qgemv_fma_{qtiles.NAMES[qtype]}", _qgemv_fma_kernel,
                        {**sig, **{k: "constexpr" for k in consts}}, consts, 4, False, None,
                        None, divisible))
    return out
