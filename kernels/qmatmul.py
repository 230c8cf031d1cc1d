"""Fused dequant-matmul: y = x @ W.T with W kept in its GGML blocks on the device.

`blocks` is W's GGUF bytes as a (out, in / block * bytes) uint8 tensor (no repack: the
kernel reads the file's layout, so loading costs nothing beyond the copy to the device).
One kernel serves both paths: a program decodes a (BLOCK_N, BLOCK_K) weight tile to bf16
in registers (kernels/qtiles.py) and multiplies it with the x tile, `acc (BN, BM) +=
dot(W_tile (BN, BK), x_tile.T (BK, BM))` in float32 (weights as the MMA's M side, so
BLOCK_M can be 16 for skinny batches).
- skinny (M <= 16): BLOCK_M = 16, every program covers all M rows, so each weight byte
  is read from memory once (a GEMV near memory bandwidth when M = 1);
- tiled (M > 16): BLOCK_M = 64, a grid over (M tiles, N tiles), M fastest so the M tiles
  that share a weight tile run together and read it from L2.

Batch invariance (DESIGN.md): a row's result must not depend on M. Every config field
but BLOCK_M depends only on (type, N, K, backend); each row's K reduction runs in the same
order (BLOCK_K steps, then the SPLIT_K partials summed in split order by a second kernel,
split_k chosen from (N, K) and the SM count, never from M); and the tensor-core
instruction does not change with BLOCK_M (v_wmma_f32_16x16x16_bf16 on gfx1151,
mma.sync m16n8k16 on sm_90 with BLOCK_N = 32; checked in the AOT build), so a row is
bit-equal alone, in a skinny batch and in a tiled one (tested in the interpreter; on the
GPU by bench/gpu/kernels_check.py). A BLOCK_N of 64 or more puts the tiled path on
Hopper's wgmma, whose rounding is not known to match mma.sync's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest, UnsupportedTensorType
from kernels import qtiles
from kernels.qtiles import GEOMETRY, IQ4_XS, MXFP4, NAMES
from kernels.triton_util import HAS_TRITON, interpreter_active, jit, launcher, tl

__all__ = ["QMMConfig", "SUPPORTED_TYPES", "default_config", "qmatmul", "qmatmul_reference"]

SUPPORTED_TYPES = frozenset(GEOMETRY)
SKINNY_MAX_M = 16
# Code books of the non-linear types (kernels/dequant_simple.py, ggml-common.h).
_LUTS = {
    IQ4_XS: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
}


class QMMConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # K is cut into split_k equal ranges, each a multiple of block_k
    num_warps: int = 4
    num_stages: int | None = None  # software pipelining depth; None: Triton's default


def qmatmul_reference(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """The definition: x (M, in) @ dequantize(blocks).T -> (M, out) in x's float precision
    (float32 at least)."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_reference(blocks.reshape(-1), ggml_type, tuple(shape), dtype)
    return x.to(dtype) @ w.t()


def default_config(
    ggml_type: int, m: int, n: int, k: int, *, backend: str = "cuda", num_sms: int = 0
) -> QMMConfig:
    """The launch config for a (m, k) x (n, k)^T product on `backend` ("cuda" or "hip").

    Only block_m depends on m (see the module docstring). On gfx1151 one pipeline stage
    and 64-column steps keep the skinny path's tiles in registers (the AOT build spills no
    VGPR; the tiled Q5_0, Q6_K and MXFP4 builds still spill, `python -m kernels.aot`
    reports it, and need tuning on the box); on CUDA, K is split while the N tiles alone
    would leave SMs idle.
    """
    step = GEOMETRY[ggml_type][2]
    hip = backend == "hip"
    block_k = 128 if step == 128 or (step == 64 and not hip) else 64
    block_k = block_k if k % block_k == 0 else step
    block_n = 32
    split_k = 1
    tiles = -(-n // block_n)
    while tiles * split_k < 2 * num_sms and k % (2 * split_k * block_k) == 0 and split_k < 8:
        split_k *= 2
    block_m = 16 if m <= SKINNY_MAX_M else 64
    return QMMConfig(block_m, block_n, block_k, split_k, 4, 1 if hip else None)


def _device_info(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "cuda", 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return ("hip" if torch.version.hip else "cuda"), sms


if HAS_TRITON:

    @jit
    def _qmm_kernel(
        x_ptr, w_ptr, out_ptr, lut_ptr, M, N, row_bytes, k_per_split, stride_xm,
        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """out[s, m, n] = sum over split s's K range of x[m, k] * W[n, k]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        split = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        # Out-of-range rows read row 0 (valid memory); their results are never stored.
        rows = w_ptr + tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
        x_rows = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # (1, BM)
        kmap = qtiles.tile_kmap(QTYPE, BLOCK_K)  # (BK,)
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        k_begin = split * k_per_split
        for kk in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + kk
            w = qtiles.dequant_tile(QTYPE, rows, k0, lut_ptr, BLOCK_N, BLOCK_K).to(tl.bfloat16)
            xt = tl.load(x_rows + (k0 + kmap)[:, None], mask=m_ok[None, :], other=0.0)
            xt = xt.to(tl.bfloat16)  # (BK, BM)
            if DOT_F32:  # the interpreter's bf16 dot is wrong; same values, f32 products
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32))
            else:
                acc += tl.dot(w, xt)
        out = out_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[None, :] * N + rn[:, None]
        tl.store(out, acc, mask=m_ok[None, :] & (rn < N)[:, None])

    @jit
    def _sum_splits_kernel(part_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """y[i] = part[0, i] + part[1, i] + ... in that order (a fixed reduction order)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < numel
        acc = tl.load(part_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * numel + i, mask=ok, other=0.0)
        tl.store(y_ptr + i, acc, mask=ok)


def _check(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> None:
    if int(ggml_type) not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(f"qmatmul has no kernel for GGML type {ggml_type}")
    block, type_size, _ = GEOMETRY[int(ggml_type)]
    n, k = (int(s) for s in shape)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidRequest(f"qmatmul: x must be (M, {k}) float32/bfloat16, got "
                             f"{x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise InvalidRequest("qmatmul: x rows must be contiguous (stride 1 along in)")
    if k % block or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // block *
                                                                            type_size):
        raise InvalidRequest(f"qmatmul: {NAMES[int(ggml_type)]} weight {shape} needs uint8 "
                             f"blocks ({n}, {k // block * type_size}), got {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
    if not blocks.is_contiguous() or blocks.device != x.device:
        raise InvalidRequest("qmatmul: blocks must be contiguous and on x's device")


@functools.lru_cache(maxsize=64)
def _lut(ggml_type: int, device: torch.device) -> torch.Tensor:
    """The type's code book on the device, uploaded once (a copy per call would also
    serialize the launch)."""
    values = _LUTS.get(ggml_type, (0.0,))
    return torch.tensor(values, dtype=torch.float32, device=device)


def qmatmul_triton(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
    config: QMMConfig | None = None,
) -> torch.Tensor:
    """The kernel path (interpreted when the tensors are on the CPU)."""
    _check(x, blocks, ggml_type, shape)
    m, (n, k) = x.shape[0], shape
    backend, sms = _device_info(x.device)
    cfg = config or default_config(int(ggml_type), m, n, k, backend=backend, num_sms=sms)
    step = GEOMETRY[int(ggml_type)][2]
    if k % (cfg.split_k * cfg.block_k) or cfg.block_k % step or (step == 128 and
                                                                  cfg.block_k != step):
        raise InvalidRequest(f"qmatmul: {cfg} does not fit in={k} ({NAMES[int(ggml_type)]} "
                             f"steps {step} columns)")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    part = y if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32,
                                                  device=x.device)
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), cfg.split_k)
    launcher(_qmm_kernel, x.device)[grid](
        x, blocks, part, _lut(int(ggml_type), x.device), m, n, blocks.shape[1],
        k // cfg.split_k, x.stride(0), QTYPE=int(ggml_type), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_F32=x.device.type == "cpu",
        num_warps=cfg.num_warps, **({} if cfg.num_stages is None else
                                    {"num_stages": cfg.num_stages}),
    )
    if cfg.split_k > 1:
        block = 1024
        launcher(_sum_splits_kernel, x.device)[(-(-m * n // block),)](
            part, y, m * n, SPLIT_K=cfg.split_k, BLOCK=block)
    return y


def qmatmul(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
    *, config: QMMConfig | None = None,
) -> torch.Tensor:
    """x (M, in) float32/bf16, blocks (out, in / block * bytes) uint8 -> (M, out) float32.

    Runs the kernel on a GPU (or on the CPU under TRITON_INTERPRET=1), else the reference.
    """
    if HAS_TRITON and (x.device.type != "cpu" or interpreter_active()):
        return qmatmul_triton(x, blocks, ggml_type, shape, config)
    _check(x, blocks, ggml_type, shape)
    return qmatmul_reference(x, blocks, ggml_type, shape)


def aot_specs(spec: type) -> list:
    """kernels/aot.py: each type at the skinny and the tiled block_m (bf16 and f32 x), with
    the config each backend launches (the spec's target picks it)."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*fp32", "lut_ptr": "*fp32",
           "M": "i32", "N": "i32", "row_bytes": "i32", "k_per_split": "i32", "stride_xm": "i32"}
    out = []
    for qtype in sorted(SUPPORTED_TYPES):
        for block_m, x_type in ((16, "*bf16"), (64, "*fp32")):
            for backend in ("hip", "cuda"):
                cfg = default_config(qtype, block_m, 4096, 4096, backend=backend)
                consts = {"QTYPE": qtype, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n,
                          "BLOCK_K": cfg.block_k, "DOT_F32": False}
                signature = {**sig, "x_ptr": x_type, **{k: "constexpr" for k in consts}}
                out.append(spec(f"qmatmul_{NAMES[qtype]}_m{block_m}", _qmm_kernel, signature,
                                consts, cfg.num_warps, True, backend, cfg.num_stages))
    signature = {"part_ptr": "*fp32", "y_ptr": "*fp32", "numel": "i32", "SPLIT_K": "constexpr",
                 "BLOCK": "constexpr"}
    out.append(spec("qmatmul_sum_splits", _sum_splits_kernel, signature,
                    {"SPLIT_K": 4, "BLOCK": 1024}, 4, False))
    return out
