"""KV element formats: byte contracts and encode/decode of one head vector.

A format stores vectors of `head_dim` elements (a multiple of 32) as planes: `f16` one
plane of halves; `q8`/`q4` a plane of codes and a plane of f16 scales, one per 32
elements. Bytes per 32 elements are part of the contract: f16 64, q8 34, q4 18.

Quantized layouts (n token slots, h kv heads, d head_dim, nb = d // 32 blocks):
- q8: `codes` int8 (n, h, d), `scales` f16 (n, h, nb). Symmetric absmax:
  scale = amax / 127, code = round(x / scale) in [-127, 127], x' = code * scale.
- q4: `codes` uint8 (n, h, d // 2), `scales` f16 (n, h, nb). Byte j of a row holds
  elements 2j (low nibble) and 2j + 1 (high nibble) as code + 8 in [0, 15]. The scale is
  signed as in GGML's Q4_0: scale = m / -8 where m is the block's element of largest
  magnitude, so m is exact (code -8) and the range -8..7 is used in full. Measured on
  Gaussian data this halves the gap to f16 against scale = amax / 7 (relative MSE
  7.4e-3 vs 9.4e-3) and also wins with outlier channels (4.1e-3 vs 4.7e-3, rotated).
- Rounding is to nearest (ties to even).

`q8` and `q4` rotate every 32-block by a normalized Hadamard matrix before quantizing
(engine/kv/hadamard.py); decode rotates back. The unrotated variants are `q8_plain` and
`q4_plain`. Measured relative MSE (4096 x 8 x 128 elements; "outliers": 4 of 128
channels 20x larger, as real K often has):

    format   Gaussian plain / rotated     outliers plain / rotated
    q8       2.86e-5 / 2.85e-5            1.16e-4 / 1.42e-5
    q4       7.39e-3 / 7.38e-3            1.86e-2 / 4.06e-3

Rotation costs nothing in accuracy on Gaussian data and cuts the error 4-8x with outlier
channels, so the rotated variants are the defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.kv.hadamard import BLOCK, rotate_blocks, rotate_exact

_F16_MAX = 65504.0


class KVFormat(ABC):
    """One element format. Planes are tensors whose leading dims are (num_slots, kv_heads)."""

    name: str
    bytes_per_block: int  # bytes per 32 elements

    @abstractmethod
    def allocate(
        self, num_slots: int, kv_heads: int, head_dim: int, device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """Zeroed planes for `num_slots` token slots."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(n, kv_heads, head_dim) float -> planes with leading dims (n, kv_heads)."""

    @abstractmethod
    def decode(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Planes with leading dims (n, kv_heads) -> (n, kv_heads, head_dim) float32."""



class F16Format(KVFormat):
    name = "f16"
    bytes_per_block = 64

    def allocate(self, num_slots, kv_heads, head_dim, device):
        return {"data": torch.zeros(num_slots, kv_heads, head_dim, dtype=torch.float16,
                                    device=device)}

    def encode(self, x):
        return {"data": x.to(torch.float16)}

    def decode(self, planes):
        return planes["data"].to(torch.float32)


def _blocks(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    """(..., d) float -> (..., d // 32, 32) float32, rotated if asked."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of {BLOCK}")
    b = rotate_exact(x) if rotate else x.to(torch.float32)  # the GPU kernel's rounding
    return b.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _quantize(b: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Blocks (..., nb, 32) and f16 scales (..., nb) -> integer codes (..., nb, 32) float."""
    s = scale.to(torch.float32).unsqueeze(-1)
    q = torch.where(s != 0, b / s, torch.zeros_like(b))  # a zero block has scale 0
    return q.round_().clamp_(lo, hi)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, rotate: bool) -> torch.Tensor:
    """Codes (..., nb, 32) and scales (..., nb) -> (..., nb * 32) float32."""
    b = codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    if rotate:
        b = rotate_blocks(b)
    return b.flatten(-2)


class Q8Format(KVFormat):
    """Blocks of 32 int8 codes with one f16 absmax scale (34 bytes per 32 elements)."""

    bytes_per_block = 34

    def __init__(self, rotate: bool = True) -> None:
        self.rotate = rotate
        self.name = "q8" if rotate else "q8_plain"

    def allocate(self, num_slots, kv_heads, head_dim, device):
        return {
            "codes": torch.zeros(num_slots, kv_heads, head_dim, dtype=torch.int8, device=device),
            "scales": torch.zeros(num_slots, kv_heads, head_dim // BLOCK, dtype=torch.float16,
                                  device=device),
        }

    def encode(self, x):
        b = _blocks(x, self.rotate)  # (n, h, nb, 32)
        scale = (b.abs().amax(-1) / 127).clamp_(max=_F16_MAX).to(torch.float16)  # (n, h, nb)
        codes = _quantize(b, scale, -127, 127).to(torch.int8).flatten(-2)
        return {"codes": codes, "scales": scale}

    def decode(self, planes):
        codes, scales = planes["codes"], planes["scales"]
        codes = codes.reshape(*codes.shape[:-1], -1, BLOCK)
        return _dequantize(codes, scales, self.rotate)


class Q4Format(KVFormat):
    """Blocks of 32 4-bit codes with one signed f16 scale (18 bytes per 32 elements)."""

    bytes_per_block = 18

    def __init__(self, rotate: bool = True) -> None:
        self.rotate = rotate
        self.name = "q4" if rotate else "q4_plain"

    def allocate(self, num_slots, kv_heads, head_dim, device):
        return {
            "codes": torch.zeros(num_slots, kv_heads, head_dim // 2, dtype=torch.uint8,
                                 device=device),
            "scales": torch.zeros(num_slots, kv_heads, head_dim // BLOCK, dtype=torch.float16,
                                  device=device),
        }

    def encode(self, x):
        b = _blocks(x, self.rotate)  # (n, h, nb, 32)
        m = b.gather(-1, b.abs().argmax(-1, keepdim=True)).squeeze(-1)  # signed absmax
        scale = (m / -8).clamp_(-_F16_MAX, _F16_MAX).to(torch.float16)  # (n, h, nb)
        q = (_quantize(b, scale, -8, 7) + 8).to(torch.uint8).flatten(-2)  # (n, h, d)
        return {"codes": q[..., 0::2] | (q[..., 1::2] << 4), "scales": scale}

    def decode(self, planes):
        packed, scales = planes["codes"], planes["scales"]  # (..., d // 2), (..., nb)
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # (..., d)
        codes = q.reshape(*q.shape[:-1], -1, BLOCK).to(torch.int8) - 8
        return _dequantize(codes, scales, self.rotate)


FORMATS: dict[str, KVFormat] = {
    fmt.name: fmt
    for fmt in (F16Format(), Q8Format(), Q4Format(), Q8Format(rotate=False),
                Q4Format(rotate=False))
}

# --kv-quant value -> (K format name, V format name)
KV_QUANT_CHOICES: dict[str, tuple[str, str]] = {
    "f16": ("f16", "f16"),
    "q8": ("q8", "q8"),
    "k8v4": ("q8", "q4"),
    "k4v8": ("q4", "q8"),
    "k4v4": ("q4", "q4"),
}


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, kv_quant: str) -> int:
    """Exact KV bytes per token: layers * kv_heads * head_dim * (K + V bytes per element)."""
    k_name, v_name = KV_QUANT_CHOICES[kv_quant]
    blocks = num_layers * kv_heads * head_dim // 32
    return blocks * (FORMATS[k_name].bytes_per_block + FORMATS[v_name].bytes_per_block)
