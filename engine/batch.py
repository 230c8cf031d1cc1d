"""ForwardBatch: one forward over the weights serves every row (DESIGN.md).

Rows are prefill chunks (many tokens of one sequence), decode rows (one token) and verify
rows (k speculative tokens). All rows' new tokens are concatenated in `input_ids`.
Page tables index logical pages by position: page `p` of a row holds positions
[p * page_size, (p + 1) * page_size); a page that fell out of a sliding window is -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
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
    # Host facts the runner asks for on every step, computed once (None: not yet).
    _decode_only: bool | None = field(default=None, repr=False)
    _max_seq_len: int | None = field(default=None, repr=False)
    _every_token: bool | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.query_start.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def is_decode_only(self) -> bool:
        """Every row has one new token and needs its logits (host tensors only: a batch
        on a device answers False rather than synchronising)."""
        if self._decode_only is None:
            n = self.num_rows
            if self.input_ids.device.type != "cpu" or n < 1 or self.num_tokens != n:
                self._decode_only = False
            else:
                rows = np.arange(n + 1)
                self._decode_only = bool(
                    np.array_equal(self.query_start.numpy(), rows)
                    and np.array_equal(self.logits_rows.numpy(), rows[:n]))
        return self._decode_only

    def every_token(self) -> bool:
        """Whether `logits_rows` is every token in order (decode rows only, a prefill of
        all its logits), so that the hidden states need no gather. Computed on host
        tensors and carried by `to`; a batch made on a device says False unless told."""
        if self._every_token is None:
            rows = self.logits_rows
            self._every_token = rows.device.type == "cpu" and rows.numel() == self.num_tokens \
                and bool(np.array_equal(rows.numpy(), np.arange(self.num_tokens)))
        return self._every_token

    def max_seq_len(self) -> int:
        """The longest row's context after this step (0 without rows)."""
        if self._max_seq_len is None:
            self._max_seq_len = int(self.seq_lens.max()) if self.seq_lens.numel() else 0
        return self._max_seq_len

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
                            self.logits_rows.to(device), _every_token=self.every_token())

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
        n = len(spans)
        return cls.from_rows(
            list(chain.from_iterable(t for t, _ in spans)),
            np.fromiter((s for _, s in spans), np.int64, n),
            np.fromiter((len(t) for t, _ in spans), np.int64, n),
            {g: pad_tables(rows) for g, rows in page_tables.items()},
            None if logits_rows is None else np.asarray(logits_rows, dtype=np.int64),
        )

    @classmethod
    def decode(cls, input_ids: list[int], starts: np.ndarray,
               page_tables: dict[str, np.ndarray]) -> ForwardBatch:
        """Decode rows only: row r's one new token input_ids[r] at position starts[r]."""
        rows = np.arange(len(input_ids) + 1, dtype=np.int64)
        return cls(_ids(input_ids), torch.from_numpy(starts),
                   torch.from_numpy(rows), torch.from_numpy(starts + 1),
                   {g: torch.from_numpy(t) for g, t in page_tables.items()},
                   torch.from_numpy(rows[:-1]), _decode_only=len(input_ids) > 0,
                   _every_token=True)

    @classmethod
    def from_rows(
        cls,
        input_ids: list[int],
        starts: np.ndarray,
        num_new: np.ndarray,
        page_tables: dict[str, np.ndarray],
        logits_rows: np.ndarray | None = None,
    ) -> ForwardBatch:
        """input_ids: every row's new tokens, concatenated; starts (rows,) the position of
        each row's first new token; num_new (rows,) its count; page_tables per group
        (rows, max_pages) int64. The tensors share the arrays' memory (no copy)."""
        query_start = np.zeros(len(num_new) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        # token t of row r sits at starts[r] + (t - query_start[r])
        positions = np.arange(query_start[-1], dtype=np.int64) + \
            np.repeat(starts - query_start[:-1], num_new)
        if logits_rows is None:
            logits_rows = query_start[1:] - 1
        return cls(
            input_ids=_ids(input_ids),
            positions=torch.from_numpy(positions),
            query_start=torch.from_numpy(query_start),
            seq_lens=torch.from_numpy(starts + num_new),
            page_tables={g: torch.from_numpy(t) for g, t in page_tables.items()},
            logits_rows=torch.from_numpy(np.ascontiguousarray(logits_rows, dtype=np.int64)),
        )


def pad_tables(rows: Sequence[list[int] | np.ndarray]) -> np.ndarray:
    """Per-row page ids (lists, or int64 arrays: SeqPages.table_array, copied at C speed)
    -> (rows, max(1, longest)) int64, padded with -1."""
    width = max(1, max(map(len, rows), default=0))
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _ids(ids: list[int]) -> torch.Tensor:
    """(n,) int64 from Python ints (through numpy: a third of torch.tensor's cost)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device's queued work: on a
    GPU through pinned memory, in stream order (a pageable copy waits for the stream)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
