"""Rotary position embedding (RoFormer, arXiv:2104.09864) as ggml_rope_ext computes it.

Two pair layouts: `neox` rotates (x[i], x[i + d/2]); the original layout rotates adjacent
pairs (x[2i], x[2i+1]) — GGUF's llama tensors are permuted for it. Frequencies:
theta_i = pos * freq_scale * base^(-2i/d) / freq_factors[i] (Llama 3 stores the factors
as `rope_freqs.weight`; linear scaling is freq_scale = 1 / factor).

YaRN (gpt-oss; ggml's rope_yarn with ext_factor 1): pair i keeps its own frequency below
the ramp (i <= low), takes freq_scale times it above (i >= high), and a linear mix
between, low = floor(corr(beta_fast)), high = ceil(corr(beta_slow)), corr(b) = d
ln(n_ctx_orig / (2 pi b)) / (2 ln base); cos and sin are multiplied by attn_factor (1 +
0.1 ln(1 / freq_scale)).
"""

from __future__ import annotations

import math

import torch

from engine.kernel_select import use_triton
from engine.models.config import YaRN
from kernels.fused_rope import rope_cos_sin, rope_cos_sin_reference


def yarn_mix(head_dim: int, base: float, yarn: YaRN) -> torch.Tensor:
    """(d/2,) float64: how much of pair i's own (unscaled) frequency YaRN keeps: 1 below
    the ramp, 0 above it, linear between."""
    def corr(rotations: float) -> float:
        return head_dim * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(0.0, math.floor(corr(yarn.beta_fast)))
    high = min(head_dim - 1.0, math.ceil(corr(yarn.beta_slow)))
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    return 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)


class Rope:
    def __init__(
        self,
        head_dim: int,
        base: float,
        neox: bool,
        freq_scale: float = 1.0,
        freq_factors: torch.Tensor | None = None,
        yarn: YaRN | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.neox = neox
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq = 1.0 / base**exponents  # (d/2,)
        self.mscale = 1.0
        if yarn is None:
            inv_freq = inv_freq * freq_scale
        else:
            mix = yarn_mix(head_dim, base, yarn)
            inv_freq = inv_freq * (freq_scale * (1 - mix) + mix)
            self.mscale = yarn.attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.detach().cpu().to(torch.float64)
        self.inv_freq = inv_freq.to(torch.float32)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (n,) -> cos, sin (n, 1, d/2) float32, shared by every layer of one step
        (one kernel on the Triton path: kernels/fused_rope.py's rope_cos_sin)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if use_triton(positions.device):
            cos, sin = rope_cos_sin(positions, self.inv_freq)
        else:
            cos, sin = rope_cos_sin_reference(positions, self.inv_freq)
        if self.mscale != 1.0:  # YaRN's magnitude (on q and k both)
            cos, sin = cos * self.mscale, sin * self.mscale
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (n, heads, d) float32 -> rotated (n, heads, d) float32."""
        if self.neox:
            half = self.head_dim // 2
            x0, x1 = x[..., :half], x[..., half:]
            return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
