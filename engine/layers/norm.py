"""RMSNorm in float32 (llama.cpp's build_norm with LLM_NORM_RMS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x (..., dim) -> float32 x / rms(x) * weight. GGUF norm weights already hold Gemma's +1.

    torch's fused rms_norm: one kernel instead of five, each row on its own (batch-invariant).
    """
    x = x.float()
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
