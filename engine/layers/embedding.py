"""Token embedding lookup: a dense table, or rows decoded from the GGUF blocks on demand.

Decoding only the looked-up rows keeps the lookup exact (the file's values in float32)
when the table is not held dense, e.g. with int8 linears where the tied output head holds
re-quantized codes of the same tensor, or on a GPU's block layouts, where one launch of
kernels/gather_rows.py decodes the rows (no host synchronisation: graph capture).
"""

from __future__ import annotations

import torch

from engine.kernel_select import use_triton
from kernels.dequant import dequantize_rows
from kernels.gather_rows import can_gather, gather_rows


class Embedding:
    """__call__(ids (T,) int) -> (T, hidden) float32."""

    def __init__(self, table: torch.Tensor | None, raw: torch.Tensor | None = None,
                 ggml_type: int | None = None, shape: tuple[int, int] | None = None,
                 name: str = "token_embd.weight") -> None:
        if table is None and (raw is None or ggml_type is None or shape is None):
            raise ValueError("Embedding needs a dense table or the raw blocks with type and shape")
        self.table = table
        self.raw, self.ggml_type, self.name = raw, ggml_type, name
        self.shape = tuple(table.shape) if table is not None else tuple(shape)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[ids].float()
        rows, cols = self.shape
        if can_gather(self.ggml_type, cols) and ids.dim() == 1 and \
                use_triton(self.raw.device):  # ids checked at admission (engine/core.py)
            return gather_rows(self.raw.view(rows, -1), int(self.ggml_type), cols, ids)
        return dequantize_rows(self.raw, self.ggml_type, self.shape, ids, name=self.name)
