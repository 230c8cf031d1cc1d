"""ForwardBatch: one forward over the weights serves every row (DESIGN.md).

Rows are prefill chunks (many tokens of one sequence), decode rows (one token) and verify
rows (k speculative tokens). All rows' new tokens are concatenated in `input_ids`.
Page tables index logical pages by position: page `p` of a row holds positions
[p * page_size, (p + 1) * page_size); a page that fell out of a sliding window is -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    query_start: torch.Tensor  # (num_rows + 1,) int64 offsets of each row's span
    seq_lens: torch.Tensor  # (num_rows,) tokens in context after this step
    page_tables: dict[str, torch.Tensor]  # per layer group: (num_rows, max_pages) int64
    logits_rows: torch.Tensor  # indices into input_ids whose hidden states are needed
    _write_slots: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.query_start.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def write_slots(self, group: str, page_size: int) -> torch.Tensor:
        """(num_tokens,) KV slot of each new token in `group`'s pages; computed once per batch."""
        slots = self._write_slots.get(group)
        if slots is None:
            table = self.page_tables[group]
            row_of_token = torch.repeat_interleave(
                torch.arange(self.num_rows, device=table.device), self.query_start.diff()
            )
            pages = table[row_of_token, self.positions // page_size]
            slots = pages * page_size + self.positions % page_size
            self._write_slots[group] = slots
        return slots

    def row_slots(
        self, group: str, row: int, positions: torch.Tensor, page_size: int
    ) -> torch.Tensor:
        """Slots of `positions` (n,) in row `row`'s pages of `group`."""
        pages = self.page_tables[group][row, positions // page_size]
        return pages * page_size + positions % page_size

    def to(self, device: torch.device) -> ForwardBatch:
        if self.input_ids.device == device:
            return self
        return ForwardBatch(self.input_ids.to(device), self.positions.to(device),
                            self.query_start.to(device), self.seq_lens.to(device),
                            {g: t.to(device) for g, t in self.page_tables.items()},
                            self.logits_rows.to(device))

    @classmethod
    def build(
        cls,
        spans: list[tuple[list[int], int]],
        page_tables: dict[str, list[list[int]]],
        logits_rows: list[int] | None = None,
    ) -> ForwardBatch:
        """spans: per row (new token ids, position of the first one). page_tables: per group,
        per row, the page ids (rows padded with -1). logits_rows: default, each row's last token.
        """
        ids, pos, starts, lens = [], [], [0], []
        for tokens, start in spans:
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            starts.append(starts[-1] + len(tokens))
            lens.append(start + len(tokens))
        if logits_rows is None:
            logits_rows = [s - 1 for s in starts[1:]]
        tables = {}
        for group, rows in page_tables.items():
            width = max(1, max(len(r) for r in rows))
            tables[group] = torch.tensor([r + [-1] * (width - len(r)) for r in rows],
                                         dtype=torch.int64)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            query_start=torch.tensor(starts, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int64),
            page_tables=tables,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        )
