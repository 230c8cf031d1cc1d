"""Evict-and-recompute: how a sequence gets pages when the pool runs out.

First unreferenced prefix-cache pages are evicted (LRU); then the lowest-ranked resident
sequence below the requester (lowest Request.priority, then latest arrival) is preempted:
its pages are freed, its tokens kept, and it is queued at the head to be recomputed. A
sequence never preempts one ranked above it, so the highest-ranked sequence always gets its
pages (every request fits the pool alone, checked at submit) and no request fails for lack
of pages; the requester that ranks lowest gets False and waits (or preempts itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.errors import OutOfKVPages
from engine.kv.radix import RadixCache
from engine.scheduler.plan import StepPlan
from engine.scheduler.sequence import Sequence


class EvictAndRecompute:
    name = "evict_recompute"

    def __init__(self, radix: RadixCache | None) -> None:
        self.radix = radix

    @staticmethod
    def victim(requester: Sequence, residents: Iterable[Sequence]) -> Sequence | None:
        """The lowest-ranked resident below the requester, or None."""
        lower = [s for s in residents if s is not requester and s.rank < requester.rank]
        return min(lower, key=lambda s: s.rank, default=None)

    def try_ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for positions [0, num_tokens) from free pages only."""
        assert seq.pages is not None
        try:
            seq.pages.ensure(num_tokens)
        except OutOfKVPages:
            return False
        return True

    def allocate(self, seq: Sequence, num_tokens: int, residents: list[Sequence],
                 preempt: Callable[[Sequence], None], plan: StepPlan) -> bool:
        """Pages for positions [0, num_tokens) of `seq`, evicting cache pages and preempting
        lower-ranked residents (`preempt` removes them from `residents`) as needed."""
        while not self.try_ensure(seq, num_tokens):
            if self._evict(seq, num_tokens, plan):
                continue
            victim = self.victim(seq, residents)
            if victim is None:
                return False
            plan.note(self.name, f"preempt {victim.request_id} for {seq.request_id}")
            preempt(victim)
        return True

    def _evict(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        if self.radix is None:
            return False
        assert seq.pages is not None
        freed = 0
        for group, need in seq.pages.pages_needed(num_tokens).items():
            short = need - self.radix.pool.groups[group].num_free
            if short > 0:
                freed += self.radix.evict(short, group)
        if freed:
            plan.note(self.name, f"evicted {freed} cached pages for {seq.request_id}")
        return freed > 0
