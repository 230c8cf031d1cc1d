"""Linear layers over GGUF weights.

On CPU the weights are dequantized at load into `compute_dtype` (bf16 by default, f32 for
parity tests); activations enter and leave as float32, the matmul accumulates in f32.
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
