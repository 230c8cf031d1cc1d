"""RMSNorm in float32 (llama.cpp's build_norm with LLM_NORM_RMS)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x (..., dim) -> float32 x / rms(x) * weight. GGUF norm weights already hold Gemma's +1."""
    x = x.float()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight
