"""Normalized Hadamard rotation of 32-element blocks, used by the quantized KV formats.

A block x (32,) is stored as quant(x @ H) with H = H_32 / sqrt(32) (Sylvester
construction). H is symmetric and orthogonal (H @ H.T = I), so decode is dequant(...) @ H
and the rotation changes no norm or dot product. It spreads an outlier channel evenly over
its block, so the block's absmax scale no longer crushes the other 31 elements
(QuaRot, Ashkboos et al. 2024, arXiv:2404.00456).

Attention never has to undo the rotation element by element: scores are
q . (H^T k') = (H q) . k', so a kernel may rotate q once per block instead of every key,
and sum_j p_j H^T v'_j = H^T (sum_j p_j v'_j) lets it rotate the output once.

Encoding rotates with `rotate_exact` (a float64 butterfly, rounded to float32 once), which
the GPU's quantize-and-store kernel (kernels/kv_store.py) computes in the same order, so
the CPU and the GPU write the same codes for the same keys and values.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32
H_SCALE = BLOCK**-0.5  # float64: the normalization of the Hadamard matrix


def hadamard_matrix(n: int = BLOCK, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, n) normalized Sylvester Hadamard matrix; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype)


@functools.lru_cache(maxsize=16)
def _cached(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return hadamard_matrix(BLOCK, dtype).to(device)


def rotate_blocks(x: torch.Tensor) -> torch.Tensor:
    """(..., nb, 32) float -> (..., nb, 32) with every block multiplied by H.

    H is its own inverse, so the same call rotates and rotates back.
    """
    return x @ _cached(x.dtype, x.device)


def rotate_exact(x: torch.Tensor) -> torch.Tensor:
    """(..., d) float, d a multiple of 32 -> every 32-block times H, float32: the exact
    product rounded once (a float64 Walsh-Hadamard butterfly: pairs (i, i + dist) within
    blocks of 2 * dist, dist = 1, 2, 4, 8, 16, then the scale)."""
    y = x.to(torch.float64).reshape(-1, BLOCK)
    for dist in (1, 2, 4, 8, 16):
        y = y.reshape(-1, BLOCK // (2 * dist), 2, dist)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
    return (y.reshape(x.shape) * H_SCALE).to(torch.float32)
