"""KV element formats: byte contracts and encode/decode of one head vector.

A format stores vectors of `head_dim` elements (a multiple of 32) as planes: `f16` one
plane of halves; `q8`/`q4` a plane of codes and a plane of f16 scales, one per 32
elements. Bytes per 32 elements are part of the contract: f16 64, q8 34, q4 18.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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

    def bytes_per_element_row(self, head_dim: int) -> int:
        return head_dim // 32 * self.bytes_per_block


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


FORMATS: dict[str, KVFormat] = {"f16": F16Format()}

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
    per_block = {"f16": 64, "q8": 34, "q4": 18}
    blocks = num_layers * kv_heads * head_dim // 32
    return blocks * (per_block[k_name] + per_block[v_name])
