"""SRTF among prefills: a prefill that finishes within one chunk goes before long ones.

Two classes, not a full sort by remaining tokens: a prompt with at most one chunk left
(short prompts, and the tail of long ones) runs first, so a short request's first token
never waits behind a long prompt's many chunks; among equals the earlier submit goes
first (FIFO), so a long prompt still advances whenever no short one is waiting.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.scheduler.sequence import Sequence


class ShortestRemainingFirst:
    name = "srtf"

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def is_short(self, seq: Sequence) -> bool:
        return seq.num_uncomputed <= self.chunk

    def order(self, prefills: Iterable[Sequence]) -> list[Sequence]:
        """Candidates for this step's prefill chunk, best first."""
        return sorted(prefills, key=lambda s: (not self.is_short(s), s.seq_no))
