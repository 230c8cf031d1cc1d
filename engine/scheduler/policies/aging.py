"""Prefill aging: no prefill is passed over for good.

SRTF puts prompts with at most one chunk left first, and packing gives the step's budget
to the candidates in that order; a steady stream of short prompts could then take every
step's budget and a long prompt would never advance. A prefill that was passed over
(other prefills ran in the step, it got no tokens) in `patience` consecutive steps goes
first, oldest first, until it gets tokens again: a long prompt advances at least once
every `patience + 1` steps that run prefill, and short prompts keep the other steps.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from engine.scheduler.sequence import Sequence


class PrefillAging:
    name = "aging"

    def __init__(self, patience: int = 8) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self._skips: dict[int, int] = {}  # seq_no -> consecutive steps passed over

    def num_skips(self, seq: Sequence) -> int:
        return self._skips.get(seq.seq_no, 0)

    def is_starved(self, seq: Sequence) -> bool:
        return self.num_skips(seq) >= self.patience

    def order(self, ranked: list[Sequence]) -> list[Sequence]:
        """`ranked` (the other policies' order) with starved prefills moved to the front,
        oldest submit first; the rest keep their order."""
        starved = sorted((s for s in ranked if self.is_starved(s)), key=lambda s: s.seq_no)
        return starved + [s for s in ranked if not self.is_starved(s)]

    def record(self, candidates: Iterable[Sequence], served: Collection[str]) -> None:
        """After planning: `served` holds the request ids that got prefill tokens. A step
        without prefill passes nobody over (the near-done gate or the pages held it)."""
        if not served:
            return
        self._skips = {s.seq_no: 0 if s.request_id in served else self.num_skips(s) + 1
                       for s in candidates}
