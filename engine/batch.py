"""ForwardBatch: one forward over the weights serves every row (DESIGN.md).

Rows are prefill chunks (many tokens of one sequence), decode rows (one token) and verify
rows (k speculative tokens). All rows' new tokens are concatenated in `input_ids`.
Page tables index logical pages by position: page `p` of a row holds positions
[p * page_size, (p + 1) * page_size); a page that fell out of a sliding window is -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    query_start: torch.Tensor  # (num_rows + 1,) int64 offsets of each row's span
    seq_lens: torch.Tensor  # (num_rows,) tokens in context after this step
    page_tables: dict[str, torch.Tensor]  # per layer group: (num_rows, max_pages) int64
    logits_rows: torch.Tensor  # indices into input_ids whose hidden states are needed

    @property
    def num_rows(self) -> int:
        return int(self.query_start.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def slots(self, group: str, page_size: int) -> torch.Tensor:
        """(num_tokens,) KV slot of each new token in `group`'s pages."""
        table = self.page_tables[group]
        row_of_token = torch.repeat_interleave(
            torch.arange(self.num_rows), self.query_start.diff()
        )
        pages = table[row_of_token, self.positions // page_size]
        return pages * page_size + self.positions % page_size
