"""KV storage: per-layer planes indexed by slot (page * page_size + offset).

Page ids come from the page pool of the layer's group (engine/kv/pool.py); this module
only stores and loads. K and V have their own formats (`--kv-quant`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernel_select import use_triton
from engine.kv.formats import FORMATS, KV_QUANT_CHOICES, KVFormat
from engine.kv.pool import PageCopy
from kernels.kv_store import kv_store


@dataclass(frozen=True, slots=True)
class LayerKVSpec:
    group: str  # "full" | "sliding" (recurrent layers have no paged KV)
    kv_heads: int
    head_dim_k: int
    head_dim_v: int


class KVCache:
    """Paged K/V planes for every attention layer; `num_pages` per layer group."""

    def __init__(
        self,
        layers: list[LayerKVSpec | None],
        num_pages: dict[str, int],
        page_size: int = 16,
        kv_quant: str = "f16",
        device: torch.device | str = "cpu",
    ) -> None:
        k_name, v_name = KV_QUANT_CHOICES[kv_quant]
        self.k_format: KVFormat = FORMATS[k_name]
        self.v_format: KVFormat = FORMATS[v_name]
        self.kv_quant = kv_quant
        self.page_size = page_size
        self.num_pages = dict(num_pages)
        self.layers = layers
        self.k: list[dict[str, torch.Tensor] | None] = []
        self.v: list[dict[str, torch.Tensor] | None] = []
        for spec in layers:
            if spec is None:
                self.k.append(None)
                self.v.append(None)
                continue
            slots = num_pages[spec.group] * page_size
            self.k.append(self.k_format.allocate(slots, spec.kv_heads, spec.head_dim_k, device))
            self.v.append(self.v_format.allocate(slots, spec.kv_heads, spec.head_dim_v, device))

    def group_of(self, layer: int) -> str:
        spec = self.layers[layer]
        assert spec is not None, f"layer {layer} has no paged KV"
        return spec.group

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k (n, kv_heads, head_dim_k) and v (n, kv_heads, head_dim_v) at `slots` (n,).

        On the Triton path one kernel encodes and stores both (kernels/kv_store.py)."""
        if use_triton(k.device):
            k_planes, v_planes = self.k[layer], self.v[layer]
            assert k_planes is not None and v_planes is not None
            kv_store(k, v, slots, k_planes, v_planes, self.k_format.name, self.v_format.name)
            return
        pairs = ((self.k[layer], self.k_format, k), (self.v[layer], self.v_format, v))
        for planes, fmt, x in pairs:
            assert planes is not None
            for name, enc in fmt.encode(x).items():
                planes[name][slots] = enc

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Load K and V at `slots` (n,) as float32 (n, kv_heads, head_dim)."""
        k_planes, v_planes = self.k[layer], self.v[layer]
        assert k_planes is not None and v_planes is not None
        k = self.k_format.decode({n: p[slots] for n, p in k_planes.items()})
        v = self.v_format.decode({n: p[slots] for n, p in v_planes.items()})
        return k, v

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Copy whole pages (SeqPages.fork's partial last page) in every layer of their group."""
        ps = self.page_size
        for copy in copies:
            for spec, k, v in zip(self.layers, self.k, self.v, strict=True):
                if spec is None or spec.group != copy.group:
                    continue
                for planes in (k, v):
                    for plane in planes.values():
                        plane[copy.dst * ps:(copy.dst + 1) * ps] = plane[
                            copy.src * ps:(copy.src + 1) * ps]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for planes in (*self.k, *self.v)
                   if planes is not None for p in planes.values())
