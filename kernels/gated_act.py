"""Gated MLP activation in one launch: act(gate) * up from the fused gate/up projection.

The decoder's gate_up matmul writes (rows, 2 F): gate in the first F columns, up in the
last F. SwiGLU (llama, qwen) is silu(g) * u with silu(g) = g / (1 + e^-g); GeGLU (gemma)
is gelu_tanh(g) * u with gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
(ggml_gelu's approximation, as engine/layers/activation.py computes it). Torch runs two
kernels (the activation, the product); here one, float32 in and out. `gated_act_quant`
also writes the output quantized for kernels/qint.py (the q8 layout's down projection).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequest
from engine.layers.activation import swiglu_oai
from kernels.fused_norm import OUT_DTYPES
from kernels.quant_x import QK, QuantX, empty_quant_x, quant_x_reference
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    cast_out,
    helper,
    jit,
    kernels_run,
    launcher,
    release_first,
    tl,
)

__all__ = ["ACTIVATION_IDS", "gated_act", "gated_act_quant", "gated_act_reference"]

ACTIVATION_IDS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
_BLOCK = 1024


def gated_act_reference(gate_up: torch.Tensor, activation: str,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gate_up (rows, 2 F) -> (rows, F), computed in float32, rounded to `out_dtype`."""
    if activation not in ACTIVATION_IDS:
        raise InvalidRequest(f"gated_act: unknown activation {activation!r}")
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == "swiglu_oai":
        return swiglu_oai(gate, up).to(out_dtype)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return (act * up).to(out_dtype)


if HAS_TRITON:
    from kernels.quant_x import quantize_store

    @helper
    def gated(g, u, ACT: tl.constexpr):
        """act(g) * u, ACT 0: silu, 1: gelu_tanh, 2: swiglu_oai (gated_act_reference's
        definitions)."""
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # tanh(z) = 1 - 2 / (e^2z + 1): exact limits +-1 where e^2z over/underflows
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        else:  # gpt-oss: the gate clamped above, up clamped both ways and shifted by 1
            g = tl.minimum(g, 7.0)
            u = tl.minimum(tl.maximum(u, -7.0), 7.0) + 1.0
            a = g / (1.0 + tl.exp(-1.702 * g))
        return a * u

    @jit
    def _gated_act_kernel(gu_ptr, out_ptr, q_ptr, dx_ptr, bs_ptr, ffn, stride_gu, stride_out,
                          ACT: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = False,
                          PDL: tl.constexpr = False, RELEASE_FIRST: tl.constexpr = False):
        """Columns [BLOCK * j, BLOCK * (j + 1)) of one row (BLOCK a multiple of 256); with
        QUANT also their super-blocks quantized (ffn a multiple of 256). RELEASE_FIRST
        (with QUANT: the down product after it reads only weights before its wait):
        triton_util.release_first."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = col < ffn
        await_inputs(PDL, RELEASE_FIRST)
        g = tl.load(gu_ptr + row * stride_gu + col, mask=ok, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + ffn + col, mask=ok, other=0.0)
        y = cast_out(gated(g, u, ACT), out_ptr)
        tl.store(out_ptr + row * stride_out + col, y, mask=ok)
        if QUANT:
            NB: tl.constexpr = BLOCK // 256
            b = tl.program_id(1) * NB + tl.arange(0, NB)
            quantize_store(tl.reshape(y.to(tl.float32), (NB, 256)), b, b < ffn // 256, row,
                           q_ptr, dx_ptr, bs_ptr, ffn)


def gated_act(gate_up: torch.Tensor, activation: str,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gate_up (rows, 2 F) float32 (contiguous last dim) -> (rows, F) in `out_dtype`
    (float32, bfloat16 or float16; a bf16 matmul's input: no cast kernel), one launch on a
    GPU (or on the CPU when the interpreter is active), else the reference."""
    return _gated_act(gate_up, activation, out_dtype, False)[0]


def gated_act_quant(gate_up: torch.Tensor, activation: str,
                    out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, QuantX]:
    """gated_act, and its output quantized as kernels/quant_x.py's quantize_x would (F a
    multiple of 256), in the same launch."""
    return _gated_act(gate_up, activation, out_dtype, True)


def _gated_act(gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype,
               quantize: bool) -> tuple[torch.Tensor, QuantX | None]:
    if quantize and gate_up.shape[-1] % (2 * QK):
        raise InvalidRequest(f"gated_act: quantize needs F a multiple of {QK}, got "
                             f"{gate_up.shape[-1] // 2}")
    if not kernels_run(gate_up.device):
        out = gated_act_reference(gate_up, activation, out_dtype)
        return out, quant_x_reference(out) if quantize else None
    if activation not in ACTIVATION_IDS or out_dtype not in OUT_DTYPES:
        raise InvalidRequest(f"gated_act: unknown activation {activation!r} or out_dtype "
                             f"{out_dtype}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype != torch.float32 or \
            gate_up.stride(-1) != 1:
        raise InvalidRequest(f"gated_act: gate_up must be float32 (rows, 2 F) with a contiguous "
                             f"last dim, got {gate_up.dtype} {tuple(gate_up.shape)}")
    rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, ffn, dtype=out_dtype, device=gate_up.device)
    xq = empty_quant_x(rows, ffn, gate_up.device) if quantize else None
    if rows and ffn:
        launcher(_gated_act_kernel, gate_up.device)[(rows, -(-ffn // _BLOCK))](
            gate_up, out, *(xq or (out, out, out)), ffn, gate_up.stride(0), out.stride(0),
            ACT=ACTIVATION_IDS[activation], BLOCK=_BLOCK, QUANT=quantize, num_warps=4,
            **({"RELEASE_FIRST": True} if quantize and release_first("gated_act") else {}))
    return out, xq


def aot_specs(spec: type) -> list:
    """kernels/aot.py: both activations, float32 and bf16 out."""
    if not HAS_TRITON:
        return []
    sig = {"gu_ptr": "*fp32", "out_ptr": "*fp32", "q_ptr": "*i8", "dx_ptr": "*fp32",
           "bs_ptr": "*fp16", "ffn": "i32", "stride_gu": "i32", "stride_out": "i32",
           "ACT": "constexpr", "BLOCK": "constexpr", "QUANT": "constexpr"}
    return [spec(f"gated_act_{name}{suffix}", _gated_act_kernel, {**sig, "out_ptr": out},
                 {"ACT": act, "BLOCK": _BLOCK, "QUANT": quant}, 4, False)
            for name, act in ACTIVATION_IDS.items()
            for suffix, out, quant in (("", "*fp32", False), ("_bf16", "*bf16", False),
                                       ("_q8", "*fp32", True))]
