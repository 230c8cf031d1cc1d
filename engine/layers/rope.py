"""Rotary position embedding (RoFormer, arXiv:2104.09864) as ggml_rope_ext computes it.

Two pair layouts: `neox` rotates (x[i], x[i + d/2]); the original layout rotates adjacent
pairs (x[2i], x[2i+1]) — GGUF's llama tensors are permuted for it. Frequencies:
theta_i = pos * freq_scale * base^(-2i/d) / freq_factors[i] (Llama 3 stores the factors
as `rope_freqs.weight`; linear scaling is freq_scale = 1 / factor).
"""

from __future__ import annotations

import torch

from engine.kernel_select import use_triton
from kernels.fused_rope import rope_cos_sin, rope_cos_sin_reference


class Rope:
    def __init__(
        self,
        head_dim: int,
        base: float,
        neox: bool,
        freq_scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.neox = neox
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = freq_scale / base**exponents  # (d/2,)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.detach().cpu().to(torch.float64)
        self.inv_freq = inv_freq.to(torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (n,) -> cos, sin (n, 1, d/2) float32, shared by every layer of one step
        (one kernel on the Triton path: kernels/fused_rope.py's rope_cos_sin)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if use_triton(positions.device):
            return rope_cos_sin(positions, self.inv_freq)
        return rope_cos_sin_reference(positions, self.inv_freq)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (n, heads, d) float32 -> rotated (n, heads, d) float32."""
        if self.neox:
            half = self.head_dim // 2
            x0, x1 = x[..., :half], x[..., half:]
            return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
