"""Verify rows: the hook where speculative decoding plugs in, and its fallbacks.

A DraftSource proposes tokens to follow a decoding sequence; the row then carries the last
token plus the drafts and the core keeps the longest prefix that its own sampling agrees
with (engine/core.py). Each layer degrades on its own: no source, a source that fails, no
room before max_tokens, or no free pages for the draft positions all give a plain decode
row: correct, only slower.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Protocol

from engine.scheduler.sequence import Sequence

logger = logging.getLogger(__name__)


class DraftSource(Protocol):
    def propose(self, token_ids: Seq[int], max_tokens: int) -> Seq[int]:
        """Up to `max_tokens` tokens that may follow `token_ids` (prompt + output)."""
        ...


class SpeculativeRows:
    name = "speculative"

    def __init__(self, source: DraftSource | None, vocab_size: int, max_draft: int = 4) -> None:
        self.source = source
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self.num_failures = 0

    def drafts(self, seq: Sequence) -> tuple[int, ...]:
        """Draft tokens for a decode row of `seq`; () means a plain decode row."""
        # A verify row yields up to len(drafts) + 1 tokens: leave room for the last one.
        room = min(self.max_draft, seq.num_remaining - 1)
        if self.source is None or room <= 0:
            return ()
        try:
            proposed = tuple(int(t) for t in self.source.propose(seq.token_ids, room))
        except Exception:  # a failing draft source costs speed, never the request
            self.num_failures += 1
            log = logger.warning if self.num_failures == 1 else logger.debug
            log("draft source failed for %s (%d failures); plain decode", seq.request_id,
                self.num_failures, exc_info=True)
            return ()
        if any(not 0 <= t < self.vocab_size for t in proposed):
            self.num_failures += 1
            return ()
        return proposed[:room]
