"""Prefill packing: several prefills share one step's token budget.

The budget is `prefill_chunk` tokens a step; while streams decode, the ITL target cuts it
further, row by row (each row gets what still fits beside the rows before it). Short
prompts of different clients are then prefilled together in one forward instead of one
after another, and the step stays as bounded as one chunk was (guarantee 3 bounds the
step's prefill tokens, not only each row's).

Candidates come in the policies' order:
1. aging: a prefill passed over `patience` steps in a row goes first (no starvation);
2. SRTF: prompts with at most one chunk left before long continuations;
3. client round robin within each SRTF class: clients take turns, FIFO within a client.
Each takes min(what is left of the budget, its uncomputed tokens); the near-done gate
holds a row back when the step's prefill would grow past its short-chunk size; a row
without pages waits and the next candidate tries. A short request's whole prompt may go
past the ITL target's cut within the tail budget of the first-token burst
(policies/first_token_burst.py): its first token comes one step later, not several.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from engine.scheduler.plan import Row, RowKind, StepPlan
from engine.scheduler.policies.aging import PrefillAging
from engine.scheduler.policies.client_rr import interleave
from engine.scheduler.policies.first_token_burst import FirstTokenBurst
from engine.scheduler.policies.itl_target import NO_PREFILL, ItlTarget, PrefillLoad
from engine.scheduler.policies.near_done import NearDoneGate
from engine.scheduler.policies.preempt import EvictAndRecompute
from engine.scheduler.policies.srtf import ShortestRemainingFirst
from engine.scheduler.sequence import Phase, Sequence

# (sequence, positions [0, n) it needs) -> True when it has the pages; may preempt others.
Allocate = Callable[[Sequence, int], bool]


def prefill_load(plan: StepPlan) -> PrefillLoad:
    """The plan's prefill rows as the cost model counts them (before the forward: a row's
    start is its sequence's num_computed until postprocess commits the chunk)."""
    load = NO_PREFILL
    for row in plan.rows:
        if row.kind is RowKind.PREFILL:
            load = load.plus(row.num_new_tokens, row.start)
    return load


class PrefillPacker:
    name = "packing"

    def __init__(self, budget: int, srtf: ShortestRemainingFirst, aging: PrefillAging,
                 itl: ItlTarget, near_done: NearDoneGate,
                 burst: FirstTokenBurst | None = None) -> None:
        self.budget = budget
        self.srtf = srtf
        self.aging = aging
        self.itl = itl
        self.near_done = near_done
        self.burst = burst or FirstTokenBurst(max_tokens=budget)

    def order(self, prefills: list[Sequence]) -> list[Sequence]:
        """Candidates for this step's budget, best first."""
        ranked = self.srtf.order(prefills)
        shorts = [s for s in ranked if self.srtf.is_short(s)]
        longs = [s for s in ranked if not self.srtf.is_short(s)]
        return self.aging.order(interleave(shorts) + interleave(longs))

    def pack(self, plan: StepPlan, prefills: list[Sequence], decoders: Seq[Sequence],
             num_waiting: int, allocate: Allocate) -> None:
        """Append prefill rows to `plan`: at most `budget` tokens in all."""
        load, yielded = NO_PREFILL, False
        self._explain_aging(plan, prefills)
        for seq in self.order(prefills):
            if load.tokens >= self.budget:
                break
            if seq.phase is not Phase.PREFILL:
                continue  # preempted for an earlier candidate
            num, burst = self._fit(plan, seq, load, bool(decoders))
            if num == 0:
                continue  # the step is full for this one; a shallower prompt may fit
            # a first-token burst is a one-off step: the near-done gate lets it through
            reason = None if burst else self.near_done.should_yield(load.tokens + num,
                                                                    decoders, num_waiting)
            if reason:
                plan.note(self.near_done.name, f"{seq.request_id}: {reason}")
                yielded = True
                continue
            if not allocate(seq, seq.num_computed + num):
                plan.note(EvictAndRecompute.name,
                          f"no pages for {seq.request_id}'s chunk: it waits")
                continue
            if burst:
                self.burst.record()
                plan.note(self.burst.name, burst)
            plan.rows.append(Row(seq, num, RowKind.PREFILL))
            load = load.plus(num, seq.num_computed)
        served = [r for r in plan.rows if r.kind is RowKind.PREFILL]
        self.near_done.record(yielded, bool(served))
        self.aging.record(prefills, {r.seq.request_id for r in served})
        if len(prefills) > 1 and served:
            plan.note(self.name, f"{len(served)} of {len(prefills)} prefills in "
                      f"{sum(r.num_new_tokens for r in served)} tokens (budget {self.budget}): "
                      + ", ".join(r.seq.request_id for r in served))

    def _fit(self, plan: StepPlan, seq: Sequence, load: PrefillLoad,
             is_streaming: bool) -> tuple[int, str | None]:
        """Tokens of `seq` this step can take beside `load`: the budget left, cut by the
        ITL target while streams decode (with none to keep smooth, the full budget), and
        the reason when a first-token burst takes the whole prompt past that cut."""
        room = min(self.budget - load.tokens, seq.max_chunk)
        if is_streaming:
            whole = min(room, seq.num_uncomputed)
            room, why = self.itl.chunk_limit(plan.num_decode_tokens, room, seq.num_computed,
                                             load)
            burst = self._burst(plan, seq, load, whole) if room < whole else None
            if burst:
                return whole, burst
            if why and (room or not load.tokens):  # a full step is no news
                plan.note(self.itl.name, f"{seq.request_id}: {why}")
        return min(room, seq.num_uncomputed), None

    def _burst(self, plan: StepPlan, seq: Sequence, load: PrefillLoad,
               whole: int) -> str | None:
        """Why a short prompt may take all of its `whole` remaining tokens past the ITL
        cut (None: it may not)."""
        burst, itl = self.burst, self.itl
        if whole < seq.num_uncomputed or not burst.eligible(seq.num_prompt, whole) \
                or load.tokens + whole > itl.burst_ceiling():
            return None
        modelled = itl.modelled(plan.num_decode_tokens, load.plus(whole, seq.num_computed))
        if modelled is None or itl.target_s is None or not burst.allows(modelled, itl.target_s):
            return None
        return (f"{seq.request_id}: all {whole} prompt tokens in one step "
                f"(modelled {modelled * 1e3:.1f} ms, target {itl.target_s * 1e3:.1f} ms)")

    def _explain_aging(self, plan: StepPlan, prefills: list[Sequence]) -> None:
        for seq in prefills:
            if self.aging.is_starved(seq):
                plan.note(self.aging.name, f"{seq.request_id} goes first: passed over "
                          f"{self.aging.num_skips(seq)} steps in a row")
