"""ModelRunner: ForwardBatch -> one forward over the weights -> logits of the requested rows."""

from __future__ import annotations

import torch

from engine.batch import ForwardBatch
from engine.kv.cache import KVCache
from engine.kv.pool import KVPool
from engine.models.common import DecoderModel

__all__ = ["ForwardBatch", "ModelRunner"]


class ModelRunner:
    def __init__(self, model: DecoderModel, num_pages: int | dict[str, int],
                 page_size: int = 16, kv_quant: str = "f16") -> None:
        self.model = model
        groups = {spec.group for spec in model.kv_layers() if spec is not None}
        pages = {g: num_pages[g] if isinstance(num_pages, dict) else num_pages for g in groups}
        self.pool = KVPool(pages, page_size, model.windows())
        self.kv = KVCache(model.kv_layers(), pages, page_size, kv_quant, model.device)

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (len(batch.logits_rows), vocab) float32."""
        batch = batch.to(self.model.device)
        return self.model.logits(self.model.forward(batch, self.kv))
