"""Mixture-of-experts: the grouped dequant-matmul.

A MoE block sends each of its T tokens to `k` of E experts (kernels/moe_route.py routes).
Its T * k (token, expert) pairs are sorted by expert (moe_route.group_tiles), so that every
expert's rows lie together, and cut into tiles of `block_m` rows of one expert each.
`moe_matmul` then runs one launch for every expert's product: a program per (tile, N tile)
reads its expert's weights in their GGML blocks (E, N, row bytes) and its rows of x,
gathered through the sorted token list, with qmatmul's product step (kernels/qscaled.py;
F32/F16/BF16 experts as plain tiles). The tile table has a fixed length for T (tiles past
the real ones run no loop), so the whole block is captured in a CUDA graph like any other
step.

Batch invariance (DESIGN.md): a row's product depends only on its expert's weights and
its own x row: the K order (qgemv.k_plan's block_k and split_k, the splits summed in
order in the program) and block_m depend on (type, N, K, backend) only; a row's place
among the sorted rows does not reach its bits.
"""

from __future__ import annotations

import functools
import os

import torch

from engine.errors import InvalidRequest, UnsupportedTensorType
from kernels import qscaled, qtiles
from kernels.fused_norm import OUT_DTYPES
from kernels.gated_act import ACTIVATION_IDS
from kernels.qgemv import QMMConfig, default_config, ptx, x_left
from kernels.qmatmul import SUPPORTED_TYPES, _device_info, _lut
from kernels.qtiles import FLOAT_TYPES, GEOMETRY, NAMES
from kernels.triton_util import HAS_TRITON, await_inputs, cast_out, helper, jit, launcher, tl

__all__ = ["FLOAT_TYPES", "MOE_TYPES", "moe_matmul", "moe_matmul_reference", "plan_for",
           "row_bytes"]

MOE_TYPES = frozenset(SUPPORTED_TYPES) | frozenset(FLOAT_TYPES)


# ---------------------------------------------------------------- grouped product


def moe_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                         shape: tuple[int, int], experts: torch.Tensor,
                         tokens: torch.Tensor | None) -> torch.Tensor:
    """The definition: row r of the result is x[tokens[r]] (x[r] without tokens) @
    dequantize(expert experts[r]'s blocks).T, in x's float precision (float32 at least)."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x if tokens is None else x[tokens.long()]
    out = torch.empty(rows.shape[0], shape[0], dtype=dtype)
    per_expert = blocks.reshape(blocks.shape[0], -1)
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().reshape(-1)
        w = dequantize_reference(per_expert[e], ggml_type, tuple(shape), dtype)
        out[sel] = rows[sel].to(dtype) @ w.t()
    return out


if HAS_TRITON:
    from kernels.gated_act import gated

    @helper
    def _expert_sum(acc, QTYPE: tl.constexpr, w_expert, row_off, lut_ptr, x_ptr, rm, m_ok,
                    stride_xm, k_start, k_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, X_LEFT: tl.constexpr, DOT_F64: tl.constexpr,
                    PTX: tl.constexpr):
        """acc plus the products over columns k_start .. k_start + k_len of the rows at
        byte offsets row_off, BLOCK_K columns a step in order."""
        for kk in range(0, k_len, BLOCK_K):
            k0 = k_start + kk
            acc = qscaled.step(acc, QTYPE, w_expert, row_off, k0, lut_ptr, x_ptr, rm, m_ok,
                               stride_xm, BLOCK_N, BLOCK_K, BLOCK_M, X_LEFT, DOT_F64, PTX)
        return acc

    @jit
    def _moe_mm_kernel(
        x_ptr, w_ptr, out_ptr, lut_ptr, tokens_ptr, tiles_ptr, bias_ptr, N, row_bytes,
        expert_bytes, k_per_split, splits, stride_xm, QTYPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GATHER: tl.constexpr, DOT_F64: tl.constexpr, X_LEFT: tl.constexpr,
        PTX: tl.constexpr = False, PDL: tl.constexpr = False, GATED: tl.constexpr = -1,
        HAS_BIAS: tl.constexpr = False,
    ):
        """out[r, n] for the rows r of tile program_id(0) (one expert's) and the N tile
        program_id(1): the sum of x[tokens[r] (r without GATHER), k] * W_expert[n, k],
        BLOCK_K columns a step in K order (split after split, into one accumulator: one
        partial sum fewer held than split sums added at the end, which gfx1151's 256
        VGPRs a lane could not hold for MXFP4). A tile past the real ones
        ((-1, 0, 0) in the table) runs no loop and stores nothing. GATED >= 0 (an
        activation of kernels/gated_act.py): the expert has 2 N rows, gate then up, and a
        program's BLOCK_N weight rows are BLOCK_N / 2 gate rows n, each beside its up row
        N + n; it stores act(gate) * up for those n in out's type, as gated_act would from
        the same sums (a row's sum does not depend on the rows beside it in the tile).
        HAS_BIAS: each weight row's sum plus its expert's bias (E, rows) float32 (gpt-oss),
        before the activation."""
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        await_inputs(PDL)  # every program: the tile table comes from the kernel before
        expert = tl.load(tiles_ptr + tile * 3)
        first = tl.load(tiles_ptr + tile * 3 + 1)
        end = tl.load(tiles_ptr + tile * 3 + 2)
        rows = first + tl.arange(0, BLOCK_M)
        m_ok = rows < end
        if GATHER:
            rm = tl.load(tokens_ptr + rows, mask=m_ok, other=0)
        else:
            rm = rows
        if GATED >= 0:
            half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
            w_row = tl.where(half < N, half + (tl.arange(0, BLOCK_N) % 2) * N, 0)
        else:
            w_row = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            w_row = tl.where(w_row < N, w_row, 0)
        w_expert = w_ptr + tl.maximum(expert, 0).to(tl.int64) * expert_bytes
        row_off = w_row.to(tl.int64) * row_bytes
        total = qtiles.acc_zeros(BLOCK_M, BLOCK_N, X_LEFT)
        live = tl.where(expert >= 0, splits, 0)
        for v in range(0, live):
            total = _expert_sum(total, QTYPE, w_expert, row_off, lut_ptr, x_ptr, rm, m_ok,
                                stride_xm, v * k_per_split, k_per_split, BLOCK_M, BLOCK_N,
                                BLOCK_K, X_LEFT, DOT_F64, PTX)
        if HAS_BIAS:
            rows_per_expert = expert_bytes // row_bytes
            b = tl.load(bias_ptr + tl.maximum(expert, 0).to(tl.int64) * rows_per_expert + w_row)
            total = total + (b[None, :] if X_LEFT else b[:, None])
        if GATED >= 0:
            HALF: tl.constexpr = BLOCK_N // 2
            if X_LEFT:  # (BLOCK_M, BLOCK_N): gate, up side by side along the columns
                gate, up = tl.split(tl.reshape(total, (BLOCK_M, HALF, 2)))
            else:  # (BLOCK_N, BLOCK_M): along the rows
                gate, up = tl.split(tl.permute(tl.reshape(total, (HALF, 2, BLOCK_M)),
                                               (0, 2, 1)))
            rn = pid_n * HALF + tl.arange(0, HALF)
            offs, mask = qtiles.out_offsets(rows, rn, m_ok & (expert >= 0), N, X_LEFT)
            tl.store(out_ptr + offs, cast_out(gated(gate, up, GATED), out_ptr), mask=mask)
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs, mask = qtiles.out_offsets(rows, rn, m_ok & (expert >= 0), N, X_LEFT)
            tl.store(out_ptr + offs, total, mask=mask)


# Rows an expert gets on average (pairs / E) from which a product takes qmatmul's tiled
# config (64-row tiles: a prefill chunk's), below it the skinny one (16 rows at most but
# for wgmma's x-left types: a decode step's). Both keep the K order and the matrix
# instruction family (kernels/qgemv.py's default_config), so a row's bits do not change.
TILED_ROWS = 24


def moe_configs(as_type: int, n: int, k: int, backend: str, num_sms: int = 0
                ) -> tuple[QMMConfig, QMMConfig]:
    """(skinny, tiled): qmatmul's configs for the type and shape, but on gfx1151 (256 VGPRs
    a lane) 64-column steps for the 32-column block types and 32-row N tiles for Q6_K's
    skinny config: the grouped product's gathered rows and per-tile expert take the
    registers that the dense product's configs leave, and those builds spilled 20-88 VGPRs
    (`python -m kernels.aot`). Both configs keep one K order (block_k, split_k)."""
    skinny = default_config(as_type, 16, n, k, backend=backend, num_sms=num_sms)
    tiled = default_config(as_type, 64, n, k, backend=backend, num_sms=num_sms)
    if backend != "hip":
        return skinny, tiled
    if GEOMETRY[as_type][2] <= 32 and skinny.block_k > 64:
        skinny, tiled = skinny._replace(block_k=64), tiled._replace(block_k=64)
    if as_type == qtiles.Q6_K:
        skinny = skinny._replace(block_n=32)
    return skinny, tiled


class MoEPlan:
    """A product's launch configs: qmatmul's skinny and tiled ones for the type and shape
    (their block_m is the tile height group_tiles cuts by); float types as Q8_0 tiles."""

    def __init__(self, ggml_type: int, shape: tuple[int, int], device: torch.device) -> None:
        if int(ggml_type) not in MOE_TYPES:
            raise UnsupportedTensorType(f"MoE experts: no kernel for GGML type {ggml_type}")
        backend, sms = _device_info(device)
        n, k = shape
        as_type = qtiles.Q8_0 if int(ggml_type) in FLOAT_TYPES else int(ggml_type)
        self.skinny, self.tiled = moe_configs(as_type, n, k, backend, sms)
        self.ggml_type, self.shape = int(ggml_type), (n, k)
        self.x_left = x_left(as_type)
        for cfg in (self.skinny, self.tiled):
            if k % (cfg.split_k * cfg.block_k) or cfg[2:4] != self.skinny[2:4]:
                raise InvalidRequest(f"MoE experts: {cfg} does not fit in={k}")

    def config(self, pairs: int, num_experts: int) -> QMMConfig:
        """The config of a call of `pairs` rows over `num_experts` experts."""
        return self.tiled if pairs >= TILED_ROWS * num_experts else self.skinny

    def gated_in_product(self, pairs: int, num_experts: int) -> bool:
        """Whether a gate|up product of `pairs` rows runs its activation in its own launch
        (moe_matmul's `gated`): in the skinny config (decode steps: a launch fewer a
        block); the tiled config's tiles, already at their register cap, keep the separate
        launch. The bits are the same either way. MBUFO_MOE_FUSED_ACT=0: never."""
        return self.config(pairs, num_experts) is self.skinny and \
            os.environ.get("MBUFO_MOE_FUSED_ACT", "1") != "0"


@functools.lru_cache(maxsize=256)
def plan_for(ggml_type: int, shape: tuple[int, int], device: torch.device) -> MoEPlan:
    return MoEPlan(ggml_type, shape, device)


def row_bytes(ggml_type: int, k: int) -> int:
    if ggml_type in FLOAT_TYPES:
        return k * FLOAT_TYPES[ggml_type]
    block, size, _ = GEOMETRY[ggml_type]
    return k // block * size


def moe_matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
               tokens: torch.Tensor | None, tiles: torch.Tensor, pairs: int,
               gated: str | None = None, out_dtype: torch.dtype = torch.float32,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, K) float32/bf16, blocks (E, N, row bytes) uint8 -> (pairs, N) float32:
    sorted row r is x[tokens[r]] (x[r] where tokens is None) times its tile's expert.
    `tiles` from group_tiles with the block_m of plan_for(...).config(pairs, E).
    `gated` (an activation of kernels/gated_act.py; N even: gate rows, then up rows) ->
    (pairs, N / 2) in `out_dtype`: gated_act of the product, in the same launch. `bias`
    (E, N) float32: each expert's, added to its rows' sums (before the activation)."""
    n, k = shape
    num_experts = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[1] != n or \
            blocks.shape[2] != row_bytes(int(ggml_type), k) or not blocks.is_contiguous():
        raise InvalidRequest(f"moe_matmul: {NAMES.get(int(ggml_type), ggml_type)} experts "
                             f"{shape} need contiguous uint8 blocks (E, {n}, "
                             f"{row_bytes(int(ggml_type), k)}), got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or \
            x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidRequest(f"moe_matmul: x must be (rows, {k}) float32/bfloat16 with "
                             f"contiguous rows, got {x.dtype} {tuple(x.shape)}")
    if gated is not None and (gated not in ACTIVATION_IDS or n % 2 or
                              out_dtype not in OUT_DTYPES):
        raise InvalidRequest(f"moe_matmul: gated needs an activation of "
                             f"{sorted(ACTIVATION_IDS)}, an even N and an out_dtype of "
                             f"{OUT_DTYPES}; got {gated!r}, N={n}, {out_dtype}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (
            num_experts, n) or not bias.is_contiguous()):
        raise InvalidRequest(f"moe_matmul: bias must be contiguous float32 ({num_experts}, "
                             f"{n}), got {bias.dtype} {tuple(bias.shape)}")
    plan = plan_for(int(ggml_type), (n, k), x.device)
    cfg = plan.config(pairs, num_experts)
    n_out = n if gated is None else n // 2
    out = torch.empty(pairs, n_out, dtype=torch.float32 if gated is None else out_dtype,
                      device=x.device)
    if pairs == 0 or n == 0 or num_experts == 0:
        return out
    if x.dtype == torch.float32 and x.device.type != "cpu":
        x = x.to(torch.bfloat16)  # the kernel rounds x to bf16 (qmatmul_tiled says why)
    grid = (tiles.shape[0], -(-n // cfg.block_n))  # gated: block_n / 2 outputs a program
    launcher(_moe_mm_kernel, x.device)[grid](
        x, blocks, out, _lut(int(ggml_type), x.device), x if tokens is None else tokens,
        tiles, out if bias is None else bias, n_out, blocks.shape[2],
        blocks.shape[1] * blocks.shape[2], k // cfg.split_k, cfg.split_k, x.stride(0),
        QTYPE=int(ggml_type), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATHER=tokens is not None,
        DOT_F64=x.device.type == "cpu", X_LEFT=plan.x_left, PTX=ptx(x.device),
        GATED=-1 if gated is None else ACTIVATION_IDS[gated], HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}))
    return out


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the grouped product of each type (gathered x, f32) with the skinny
    and the tiled config each backend launches at Qwen3-30B-A3B's gate|up shape."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*fp32", "w_ptr": "*u8", "out_ptr": "*fp32", "lut_ptr": "*fp32",
           "tokens_ptr": "*i32", "tiles_ptr": "*i32", "bias_ptr": "*fp32", "N": "i32",
           "row_bytes": "i32", "expert_bytes": "i32", "k_per_split": "i32", "splits": "i32",
           "stride_xm": "i32"}
    divisible = ("x_ptr", "w_ptr", "out_ptr", "lut_ptr", "tokens_ptr", "tiles_ptr",
                 "row_bytes", "expert_bytes", "k_per_split", "stride_xm")
    out = []
    for qtype in sorted(MOE_TYPES):
        as_type = qtiles.Q8_0 if qtype in FLOAT_TYPES else qtype
        name = NAMES[qtype]
        for backend in ("hip", "cuda"):
            for m, suffix in ((16, ""), (64, "_m64")):  # the skinny and the tiled config
                cfg = moe_configs(as_type, 1536, 2048, backend)[m == 64]
                consts = {"QTYPE": qtype, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                          "BLOCK_K": cfg.block_k, "GATHER": True, "DOT_F64": False,
                          "X_LEFT": x_left(as_type), "PTX": backend == "cuda", "GATED": -1,
                          "HAS_BIAS": False}
                signature = {**sig, **{k: "constexpr" for k in consts}}
                out.append(spec(f"moe_matmul_{name}{suffix}", _moe_mm_kernel, signature,
                                consts, cfg.num_warps, True, backend, cfg.num_stages,
                                divisible))
                if qtype in (qtiles.Q4_K, qtiles.Q6_K, qtiles.MXFP4) and m == 16:
                    # gate|up as a decode graph launches it: the activation in it, bf16 out,
                    # a programmatic dependent launch on sm_90
                    extra = {"GATED": 0, **({"PDL": True} if backend == "cuda" else {})}
                    if qtype == qtiles.MXFP4:  # gpt-oss's: biased experts, its activation
                        extra.update(GATED=2, HAS_BIAS=True)
                    out.append(spec(
                        f"moe_matmul_{name}_gated",  # one name: both targets' builds
                        _moe_mm_kernel, {**signature, "out_ptr": "*bf16",
                                         **{k: "constexpr" for k in extra}},
                        {**consts, **extra}, cfg.num_warps, True, backend, cfg.num_stages,
                        divisible))
    return out
