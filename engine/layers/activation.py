"""Gated MLP activations: SwiGLU (llama, qwen), GeGLU with tanh GELU (gemma) and gpt-oss's
clamped SwiGLU (ggml_swiglu_oai)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # ggml_gelu is the tanh approximation.
    return F.gelu(gate, approximate="tanh") * up


# gpt-oss's constants (llama.cpp's build_moe_ffn for LLM_FFN_SWIGLU_OAI_MOE)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """g = min(gate, 7), u = clamp(up, -7, 7): g * sigmoid(1.702 g) * (u + 1)."""
    g = gate.clamp(max=OAI_LIMIT)
    u = up.clamp(-OAI_LIMIT, OAI_LIMIT)
    return g / (1.0 + torch.exp(-OAI_ALPHA * g)) * (u + 1.0)


ACTIVATIONS = {"silu": swiglu, "gelu": geglu, "swiglu_oai": swiglu_oai}
