"""Fused dequant-matmul: y = x @ W.T with W kept in its GGML blocks on the device.

`blocks` is W's GGUF bytes as a (out, in / block * bytes) uint8 tensor (no repack: the
kernels read the file's layout, so loading costs nothing beyond the copy to the device).
Two kernels share the product step (kernels/qscaled.py `step`: for Q4_K the exact codes on
the matrix unit with the scales applied to the sums; for the other types kernels/qtiles.py's
(BLOCK_N, BLOCK_K) weight tile decoded to float32, rounded to bf16, and multiplied with the
x tile on the matrix unit,
`acc (BN, BM) += dot(W_tile (BN, BK), x_tile.T (BK, BM))` in float32, or with x on the
left for the types in qgemv.X_LEFT_TYPES, `acc (BM, BN) += dot(x_tile, W_tile.T)`):
- skinny (M <= 16, kernels/qgemv.py): one program per (N tile, K split) covers every row
  of x, so each weight byte is read once; built for memory bandwidth (decode);
- tiled (M > 16, here): a grid over (M tiles, N tiles), M fastest so the M tiles that
  share a weight tile run together and read it from L2 (prefill); the K splits are summed
  in the program (no partials) unless the tiles alone leave compute units idle.

Batch invariance (DESIGN.md): a row's result must not depend on M. The K order of the
products, block_k and split_k depend on (type, N, K, backend) only (qgemv.k_plan); each
split's sum starts from zero and the split sums are added in split order on both paths,
wherever they are computed; and both paths run the same matrix instruction family (WMMA
16x16x16 bf16 on gfx1151; wgmma m64nNk16 on sm_90, block_n a multiple of 64 with 4 or 8
warps, checked in the AOT build). So a row is bit-equal alone, in a skinny batch and in a
tiled one (tested in the interpreter; on the GPU by bench/gpu/qmatmul_bench.py, which
checks it for every config it times).
"""

from __future__ import annotations

import functools

import torch

from engine.errors import InvalidRequest, UnsupportedTensorType
from kernels import qscaled, qtiles
from kernels.qgemv import (
    SKINNY_MAX_M,
    QMMConfig,
    default_config,
    ptx,
    qgemv_triton,
    x_left,
)
from kernels.qtiles import GEOMETRY, IQ4_XS, MXFP4, NAMES
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    jit,
    kernels_run,
    launcher,
    tl,
    triton,
)
from kernels.triton_util import num_sms as device_sms

__all__ = ["QMMConfig", "SUPPORTED_TYPES", "default_config", "qmatmul", "qmatmul_reference",
           "qmatmul_tiled", "qmatmul_triton", "sum_splits"]

SUPPORTED_TYPES = frozenset(GEOMETRY)
# Code books of the non-linear types (kernels/dequant_simple.py, ggml-common.h).
_LUTS = {
    IQ4_XS: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
}


def qmatmul_reference(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int]
) -> torch.Tensor:
    """The definition: x (M, in) @ dequantize(blocks).T -> (M, out) in x's float precision
    (float32 at least)."""
    from kernels.dequant import dequantize_reference  # needs gguf; the kernels do not

    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_reference(blocks.reshape(-1), ggml_type, tuple(shape), dtype)
    return x.to(dtype) @ w.t()


@functools.lru_cache(maxsize=16)
def _device_info(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "cuda", 0
    return ("hip" if torch.version.hip else "cuda"), device_sms(device)


if HAS_TRITON:

    # M (the step's rows) is not specialized on (divisible by 16 or not): it only bounds
    # masks, and a new specialization would compile mid-serving, a stall of seconds.
    @triton.jit(do_not_specialize=["M"])
    def _qmm_kernel(
        x_ptr, w_ptr, out_ptr, lut_ptr, M, N, row_bytes, k_per_split, splits_per_program,
        stride_xm, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, DOT_F64: tl.constexpr, X_LEFT: tl.constexpr,
        PTX: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        """out[z, m, n] = the sum, in split order, of each split's own K-range sum of
        x[m, k] * W[n, k], over the `splits_per_program` splits of grid z (either all of
        them, or one: a program sums consecutive splits exactly as the split sum would)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        z = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        # Out-of-range rows read row 0 (valid memory); their results are never stored.
        row_off = tl.where(rn < N, rn, 0).to(tl.int64) * row_bytes
        total = qtiles.acc_zeros(BLOCK_M, BLOCK_N, X_LEFT)
        await_inputs(PDL)
        for v in range(0, splits_per_program):
            acc = qtiles.acc_zeros(BLOCK_M, BLOCK_N, X_LEFT)  # each split starts at 0
            k_begin = (z * splits_per_program + v) * k_per_split
            for kk in range(0, k_per_split, BLOCK_K):
                k0 = k_begin + kk
                acc = qscaled.step(acc, QTYPE, w_ptr, row_off, k0, lut_ptr, x_ptr, rm, m_ok,
                                    stride_xm, BLOCK_N, BLOCK_K, BLOCK_M, X_LEFT, DOT_F64,
                                    PTX)
            total = tl.where(v == 0, acc, total + acc)  # (p0 + p1) + p2 ..., as split sums
        offs, mask = qtiles.out_offsets(rm, rn, m_ok, N, X_LEFT)
        tl.store(out_ptr + z.to(tl.int64) * M * N + offs, total, mask=mask)

    @jit
    def _sum_splits_kernel(part_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        """y[i] = part[0, i] + part[1, i] + ... in that order (a fixed reduction order)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < numel
        await_inputs(PDL)
        acc = tl.load(part_ptr + i, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * numel + i, mask=ok, other=0.0)
        tl.store(y_ptr + i, acc, mask=ok)


def sum_splits(part: torch.Tensor, y: torch.Tensor) -> None:
    """y = part[0] + part[1] + ... (split order) for a (split_k, M, N) float32 `part`."""
    numel, block = y.numel(), 1024
    launcher(_sum_splits_kernel, y.device)[(-(-numel // block),)](
        part, y, numel, SPLIT_K=part.shape[0], BLOCK=block)


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


def _check_config(cfg: QMMConfig, ggml_type: int, m: int, k: int) -> None:
    step = GEOMETRY[int(ggml_type)][2]
    if k % (cfg.split_k * cfg.block_k) or cfg.block_k % step:
        raise InvalidRequest(f"qmatmul: {cfg} does not fit in={k} ({NAMES[int(ggml_type)]} "
                             f"steps {step} columns)")
    if m <= SKINNY_MAX_M and cfg.block_m < m:
        raise InvalidRequest(f"qmatmul: the skinny path covers M={m} rows in one block_m")


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
    """The kernel path (interpreted when the tensors are on the CPU): the skinny kernel
    for M <= 16, else the tiled one."""
    _check(x, blocks, ggml_type, shape)
    if blocks.data_ptr() % 4:  # fields are read as aligned u16/u32 words (qtiles)
        raise InvalidRequest("qmatmul: blocks must start at a 4-byte aligned address")
    m, (n, k) = x.shape[0], (int(s) for s in shape)
    backend, sms = _device_info(x.device)
    cfg = config or default_config(int(ggml_type), m, n, k, backend=backend, num_sms=sms)
    _check_config(cfg, ggml_type, m, k)
    lut = _lut(int(ggml_type), x.device)
    if m <= SKINNY_MAX_M:
        return qgemv_triton(x, blocks, int(ggml_type), n, lut, cfg)
    return qmatmul_tiled(x, blocks, int(ggml_type), n, lut, cfg, sms)


def qmatmul_tiled(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, n: int, lut: torch.Tensor,
    cfg: QMMConfig, num_sms: int,
) -> torch.Tensor:
    """The tiled kernel on checked inputs. The K splits of cfg run as programs of their
    own (partials, then the split sum) while the (M, N) tiles alone would leave compute
    units idle, else all in each program (no partials): the same sums in the same order."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    if x.dtype == torch.float32 and x.device.type != "cpu":
        # The kernel rounds x to bf16 (round to nearest even, as torch does): the same bits
        # from half the shared memory per pipeline stage (float32 tiles of 64 rows overflow
        # the 227 KiB of sm_90 for Q6_K).
        x = x.to(torch.bfloat16)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    programs = cfg.split_k if cfg.split_k > 1 and tiles < num_sms else 1
    part = y if programs == 1 else torch.empty(programs, m, n, dtype=torch.float32,
                                               device=x.device)
    grid = (-(-m // cfg.block_m), -(-n // cfg.block_n), programs)
    launcher(_qmm_kernel, x.device)[grid](
        x, blocks, part, lut, m, n, blocks.shape[1], k // cfg.split_k, cfg.split_k // programs,
        x.stride(0), QTYPE=ggml_type, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_F64=x.device.type == "cpu", X_LEFT=x_left(ggml_type),
        PTX=ptx(x.device),
        num_warps=cfg.num_warps,
        **({} if cfg.num_stages is None else {"num_stages": cfg.num_stages}),
    )
    if programs > 1:
        sum_splits(part, y)
    return y


def qmatmul(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, shape: tuple[int, int],
    *, config: QMMConfig | None = None,
) -> torch.Tensor:
    """x (M, in) float32/bf16, blocks (out, in / block * bytes) uint8 -> (M, out) float32.

    Runs the kernels on a GPU (or on the CPU under TRITON_INTERPRET=1), else the reference.
    """
    if kernels_run(x.device):
        return qmatmul_triton(x, blocks, ggml_type, shape, config)
    _check(x, blocks, ggml_type, shape)
    return qmatmul_reference(x, blocks, ggml_type, shape)


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the tiled kernel of each type (f32 x) with the config each backend
    launches (the spec's target picks it), and the split sum. Pointers and strides are
    built 16-divisible, as the JIT specializes them for real shapes (wide loads)."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*fp32", "w_ptr": "*u8", "out_ptr": "*fp32", "lut_ptr": "*fp32",
           "M": "i32", "N": "i32", "row_bytes": "i32", "k_per_split": "i32",
           "splits_per_program": "i32", "stride_xm": "i32"}
    divisible = ("x_ptr", "w_ptr", "out_ptr", "lut_ptr", "row_bytes", "k_per_split",
                 "stride_xm")
    out = []
    for qtype in sorted(SUPPORTED_TYPES):
        for backend in ("hip", "cuda"):
            cfg = default_config(qtype, 64, 4096, 4096, backend=backend)
            consts = {"QTYPE": qtype, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                      "BLOCK_K": cfg.block_k, "DOT_F64": False, "X_LEFT": x_left(qtype),
                      "PTX": backend == "cuda"}
            signature = {**sig, **{k: "constexpr" for k in consts}}
            out.append(spec(f"qmatmul_{NAMES[qtype]}_m64", _qmm_kernel, signature, consts,
                            cfg.num_warps, True, backend, cfg.num_stages, divisible))
    signature = {"part_ptr": "*fp32", "y_ptr": "*fp32", "numel": "i32", "SPLIT_K": "constexpr",
                 "BLOCK": "constexpr"}
    out.append(spec("qmatmul_sum_splits", _sum_splits_kernel, signature,
                    {"SPLIT_K": 4, "BLOCK": 1024}, 4, False))
    return out
