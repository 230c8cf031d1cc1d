"""Linear layers over GGUF weights.

On CPU the weights are dequantized at load into one of three layouts: `bf16` (the GGML
values rounded to bf16), `f32` (exact; parity tests) or `int8` (per-row int8 codes with
one bf16 scale per output row, re-quantized from the GGML values). Activations enter and
leave as float32. The int8 layout reads half the bytes of bf16 and runs on torch's
weight-only int8 kernel, whose cost grows slowly with the number of rows (batched decode)
and whose rows are independent of the batch they share (checked in the tests).
"""

from __future__ import annotations

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


class Int8Linear:
    """y = (x @ codes.T) * scales (+ b): codes int8 (out, in), scales bf16 (out,)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        self.codes = codes
        self.scales = scales
        self.bias = None if bias is None else bias.float()
        self.out_features, self.in_features = codes.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) float32 -> (n, out) float32 (x rounded to bf16, as the bf16 layout does)."""
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.codes,
                                      self.scales).float()
        return y if self.bias is None else y + self.bias


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
