"""Linear layers over GGUF weights.

On CPU the weights are dequantized at load into one of three layouts: `bf16` (the GGML
values rounded to bf16), `f32` (exact; parity tests) or `int8` (per-row int8 codes with
one bf16 scale per output row, re-quantized from the GGML values). Activations enter and
leave as float32.

The int8 layout runs on FBGEMM's integer GEMM (torch's dynamic quantized linear) where
torch has it: each activation row is scaled to 63 code units and split into two 7-bit
code rows (the rounded value and its residual in 1/126 steps, about 13 bits of the row's
largest magnitude), both multiplied in exact int32 arithmetic. Two constant pad columns
(+1, -1, against zero weight columns) pin the tensor-wide activation range, so the
kernel's quantization parameters never depend on the other rows: a row's result is
bit-equal whatever shares its batch. Elsewhere it falls back to torch's weight-only int8
kernel (bf16 activations; also batch-invariant, about 3x slower on AVX2 at one row).
"""

from __future__ import annotations

import warnings

import torch


class Linear:
    """y = x @ W.T (+ b). weight (out_features, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) float32 -> (n, out) float32."""
        y = torch.matmul(x.to(self.weight.dtype), self.weight.t()).float()
        return y if self.bias is None else y + self.bias


HI = 63.0  # code units of a row's largest magnitude (7-bit codes stay within [-63, 63])
LO = 126.0  # residual steps per code unit


def _fbgemm_available() -> bool:
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized,
                                                                  "linear_dynamic")


USE_FBGEMM = _fbgemm_available()


def _pack(codes: torch.Tensor, scales: torch.Tensor):
    """codes int8 (out, in) + bf16 scales -> FBGEMM's packed weight with two zero columns."""
    out = codes.shape[0]
    padded = torch.cat([codes, torch.zeros(out, 2, dtype=torch.int8)], 1)
    with warnings.catch_warnings():  # quantized tensors are deprecated, the kernel is not
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(
            padded, scales.double(), torch.zeros(out, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None)


def _activation_step() -> float:
    """The scale FBGEMM picks for a tensor spanning [-1, 1] with 7-bit codes (2/127)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor_dynamic(
            torch.tensor([[1.0, -1.0]]), torch.quint8, True).q_scale()


class Int8Linear:
    """y = x @ (codes * scales).T (+ b): codes int8 (out, in), scales bf16 (out,)."""

    _step: float | None = None

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, fbgemm: bool | None = None) -> None:
        self.scales = scales
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = codes.shape
        self.fbgemm = USE_FBGEMM if fbgemm is None else fbgemm
        # FBGEMM keeps its own packed copy of the codes; the plain ones are dropped then
        self.packed = _pack(codes, scales) if self.fbgemm else None
        self.codes = None if self.fbgemm else codes
        if self.fbgemm and Int8Linear._step is None:
            Int8Linear._step = _activation_step()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) float32 -> (n, out) float32."""
        y = self._fbgemm(x) if self.fbgemm else torch._weight_int8pack_mm(
            x.to(torch.bfloat16).contiguous(), self.codes, self.scales).float()
        return y if self.bias is None else y + self.bias

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        n, step = x.shape[0], self._step
        x = x.float()
        amax = x.abs().amax(1, keepdim=True)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        u = x * (HI / amax)
        hi = torch.round(u)
        lo = torch.round((u - hi) * LO)
        fed = torch.empty(2 * n, self.in_features + 2)
        torch.mul(hi, step, out=fed[:n, :-2])
        torch.mul(lo, step, out=fed[n:, :-2])
        fed[:, -2] = 1.0
        fed[:, -1] = -1.0
        out = torch.ops.quantized.linear_dynamic(fed, self.packed, True)
        return (out[:n] + out[n:] / LO) * (amax / (HI * step))


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) float -> (codes int8 (out, in), scales bf16 (out,)).

    The scale is rounded up to bf16 so no code leaves [-127, 127]; an all-zero row gets a
    scale of 1 (its codes are 0). Callers pass slices of rows to bound the temporaries.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    s_bf = s.to(torch.bfloat16)
    s_bf = torch.where(s_bf.float() < s, torch.nextafter(s_bf, torch.full_like(s_bf, 1e30)),
                       s_bf)
    codes = torch.round(w / s_bf.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, s_bf
