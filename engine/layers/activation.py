"""Gated MLP activations: SwiGLU (llama, qwen) and GeGLU with tanh GELU (gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # ggml_gelu is the tanh approximation.
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": swiglu, "gelu": geglu}
