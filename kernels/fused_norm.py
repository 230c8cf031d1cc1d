"""Residual add fused with RMSNorm: one launch where the decoder ran two to four kernels.

    r' = rmsnorm(residual) * residual_weight    (only with a residual weight: Gemma's
                                                 post-attention / post-FFN norms)
    h  = x + r'                                 (only with a residual)
    y  = rmsnorm(h) * weight,  rmsnorm(z) = z / sqrt(mean(z^2) + eps)

The decoder keeps the residual stream `h` and feeds `y` to the next matmul, so a block's
"x = x + f(...); y = norm(x)" pairs become one kernel each. A MoE block's output comes as
its `Combined` (kernels/moe_route.py: the experts' rows and weights), summed here. With
`quantize` the kernel also writes y quantized for kernels/qint.py's products
(kernels/quant_x.py's bits), sparing that launch before each of them. Float32 in and out,
one program per row (rows are independent, so a row's result does not depend on the
batch).
The reference is torch's F.rms_norm in float32, as engine/layers/norm.py computes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequest
from kernels.moe_route import Combined, check_combined, combine_reference
from kernels.quant_x import QK, QuantX, empty_quant_x, quant_x_reference
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    cast_out,
    jit,
    kernels_run,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["OUT_DTYPES", "NormOut", "add_rms_norm", "add_rms_norm_reference"]

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NormOut(NamedTuple):
    h: torch.Tensor  # (rows, dim) float32: the residual stream after the add
    y: torch.Tensor  # (rows, dim) out_dtype: rmsnorm(h) * weight
    xq: QuantX | None = None  # y quantized (kernels/qint.py), when asked for


def add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: torch.Tensor | Combined | None = None,
                           residual_weight: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32,
                           quantize: bool = False) -> NormOut:
    """x, residual (rows, dim) -> NormOut; without a residual h is x itself. y is computed
    in float32 and rounded to `out_dtype` (a bf16 matmul's input: no cast kernel); with
    `quantize` y is also quantized as kernels/quant_x.py defines it."""
    x = x.float()
    if isinstance(residual, Combined):
        residual = combine_reference(*residual)
    if residual is not None:
        if residual_weight is not None:
            residual = F.rms_norm(residual.float(), (x.shape[-1],), residual_weight, eps)
        x = x + residual
    y = F.rms_norm(x, (x.shape[-1],), weight, eps).to(out_dtype)
    return NormOut(x, y, quant_x_reference(y) if quantize else None)


if HAS_TRITON:

    from kernels.moe_route import combine_rows
    from kernels.quant_x import quantize_store

    @jit
    def _add_rms_norm_kernel(
        x_ptr, r_ptr, rw_ptr, w_ptr, h_ptr, y_ptr, q_ptr, dx_ptr, bs_ptr, rows_ptr, cw_ptr,
        stride_x, stride_r, stride_h, stride_y, dim, eps, HAS_RESIDUAL: tl.constexpr,
        HAS_RES_NORM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr = False,
        PDL: tl.constexpr = False, GATHER_K: tl.constexpr = 0,
    ):
        """One row: h = x + rmsnorm(r) * rw (or x + r), y = rmsnorm(h) * w; with QUANT also
        y (as stored) quantized per 256 columns (dim a multiple of 256). GATHER_K > 0: r is
        a MoE block's Combined (r_ptr its y, rows_ptr its rows, cw_ptr its weights),
        combined here as kernels/moe_route.py's combine sums it."""
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < dim
        await_inputs(PDL)
        h = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            if GATHER_K > 0:
                r = combine_rows(r_ptr, rows_ptr, cw_ptr, row, stride_r, d, ok, GATHER_K)
            else:
                r = tl.load(r_ptr + row * stride_r + d, mask=ok, other=0.0)
            if HAS_RES_NORM:
                r_inv = tl.rsqrt(tl.sum(r * r, 0) / dim + eps)
                r = r * r_inv * tl.load(rw_ptr + d, mask=ok, other=0.0)
            h = h + r
            tl.store(h_ptr + row * stride_h + d, h, mask=ok)
        inv = tl.rsqrt(tl.sum(h * h, 0) / dim + eps)
        y = cast_out(h * inv * tl.load(w_ptr + d, mask=ok, other=0.0), y_ptr)
        tl.store(y_ptr + row * stride_y + d, y, mask=ok)
        if QUANT:
            NB: tl.constexpr = BLOCK_D // 256
            b = tl.arange(0, NB)
            quantize_store(tl.reshape(y.to(tl.float32), (NB, 256)), b, b < dim // 256, row,
                           q_ptr, dx_ptr, bs_ptr, dim)


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...], device) -> None:
    if t is None:
        return
    if t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(-1) != 1 or \
            t.device != device:
        raise InvalidRequest(f"add_rms_norm: {name} must be float32 {shape} on {device} with "
                             f"a contiguous last dim, got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | Combined | None = None,
                 residual_weight: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, quantize: bool = False) -> NormOut:
    """x, residual (rows, dim) float32, weights (dim,) -> NormOut(h, y[, xq]), one launch;
    y in `out_dtype` (float32, bfloat16 or float16); `quantize` (dim a multiple of 256):
    also y quantized for kernels/qint.py.

    The kernel runs on a GPU (or on the CPU when the interpreter is active), else the
    reference. A residual weight needs a residual.
    """
    if quantize and x.shape[-1] % QK:
        raise InvalidRequest(f"add_rms_norm: quantize needs a multiple of {QK} columns, "
                             f"got {x.shape[-1]}")
    if not kernels_run(x.device):
        return add_rms_norm_reference(x, weight, eps, residual, residual_weight, out_dtype,
                                      quantize)
    if out_dtype not in OUT_DTYPES:
        raise InvalidRequest(f"add_rms_norm: out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    if x.dim() != 2 or (residual is None and residual_weight is not None):
        raise InvalidRequest(f"add_rms_norm: x must be (rows, dim), got {tuple(x.shape)}; "
                             f"a residual weight needs a residual")
    rows, dim = x.shape
    _check("x", x, (rows, dim), x.device)
    gather = isinstance(residual, Combined)
    if gather:
        check_combined(residual, rows, dim)
        _check("residual", residual.y, tuple(residual.y.shape), x.device)
    else:
        _check("residual", residual, (rows, dim), x.device)
    for name, w in (("weight", weight), ("residual_weight", residual_weight)):
        if w is not None and not w.is_contiguous():
            raise InvalidRequest(f"add_rms_norm: {name} must be contiguous")
        _check(name, w, (dim,), x.device)
    y = torch.empty(rows, dim, dtype=out_dtype, device=x.device)
    h = x if residual is None else torch.empty(rows, dim, dtype=torch.float32, device=x.device)
    xq = empty_quant_x(rows, dim, x.device) if quantize else None
    if rows:
        block = max(QK, next_pow2(dim))
        r = x if residual is None else residual.y if gather else residual
        picked_rows, picked_weights = (residual.rows, residual.weights) if gather else (x, x)
        launcher(_add_rms_norm_kernel, x.device)[(rows,)](
            x, r, weight if residual_weight is None else residual_weight, weight, h, y,
            *(xq or (y, y, y)), picked_rows, picked_weights, x.stride(0), r.stride(0),
            h.stride(0), y.stride(0), dim, float(eps), HAS_RESIDUAL=residual is not None,
            HAS_RES_NORM=residual_weight is not None, BLOCK_D=block, QUANT=quantize,
            GATHER_K=residual.weights.shape[1] if gather else 0, num_warps=_warps(block))
    return NormOut(h, y, xq)


def _warps(block: int) -> int:
    """Enough threads that a row of `block` floats is 8 to 16 registers per thread."""
    return max(1, min(16, block // 512))


def aot_specs(spec: type) -> list:
    """kernels/aot.py: Llama-8B's hidden size, with the plain, residual and Gemma-style
    (residual norm) variants, a bf16 y, and a MoE block's Combined residual."""
    if not HAS_TRITON:
        return []
    sig = {**{n: "*fp32" for n in ("x_ptr", "r_ptr", "rw_ptr", "w_ptr", "h_ptr", "y_ptr",
                                   "dx_ptr", "cw_ptr")}, "q_ptr": "*i8", "bs_ptr": "*fp16",
           "rows_ptr": "*i32",
           **{n: "i32" for n in ("stride_x", "stride_r", "stride_h", "stride_y", "dim")},
           "eps": "fp32"}
    out = []
    for name, res, res_norm, y_type, quant, gather in (
            ("", False, False, "*fp32", False, 0), ("_add", True, False, "*fp32", False, 0),
            ("_add_norm", True, True, "*fp32", False, 0),
            ("_add_bf16", True, False, "*bf16", False, 0),
            ("_add_q8", True, False, "*fp32", True, 0),
            ("_add_moe", True, False, "*fp32", True, 8)):  # a MoE block's 8 picks combined
        consts = {"HAS_RESIDUAL": res, "HAS_RES_NORM": res_norm, "BLOCK_D": 4096,
                  "QUANT": quant, "GATHER_K": gather}
        out.append(spec(f"add_rms_norm{name}", _add_rms_norm_kernel,
                        {**sig, "y_ptr": y_type, **{k: "constexpr" for k in consts}}, consts,
                        _warps(4096), False))
    return out
