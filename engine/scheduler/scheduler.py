"""Scheduler: each step, every due decoder plus prefill chunks within one bounded budget.

Guarantees (DESIGN.md, each with a test in tests/engine/scheduler/):
1. a due decoder never waits behind a prefill: decoders are planned first, the prefill
   chunks ride in the same batch (mixed) or in the gaps (`mixed_batch=False` alternates);
2. after every merged or prefill step all resident decoders are due again;
3. a step's prefill tokens, however many prompts share them (engine/scheduler/prefill.py
   packs them), are bounded by `prefill_chunk` (and the ITL target);
4. the decode queue rotates: with a cap on decode rows, equal sessions take turns;
5. per-client pending limit at submit, admission rotating over clients;
6. every layer degrades on its own (a verify row falls back to a plain decode row).
Policies live in engine/scheduler/policies/, one object each; this file only wires them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from engine.errors import OutOfKVPages
from engine.kv.pool import RECURRENT, SLIDING, KVPool, SeqPages
from engine.kv.radix import RadixCache
from engine.scheduler.plan import Row, RowKind, StepPlan
from engine.scheduler.policies.aging import PrefillAging
from engine.scheduler.policies.client_rr import ClientRoundRobin
from engine.scheduler.policies.fair_share import FairShare
from engine.scheduler.policies.itl_target import NO_PREFILL, ItlTarget
from engine.scheduler.policies.near_done import NearDoneGate
from engine.scheduler.policies.preempt import EvictAndRecompute
from engine.scheduler.policies.speculative import SpeculativeRows
from engine.scheduler.policies.srtf import ShortestRemainingFirst
from engine.scheduler.prefill import PrefillPacker, prefill_load
from engine.scheduler.sequence import Phase, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_sessions: int = 4  # resident sequences (--sessions)
    context: int = 4096  # tokens per session (-c): prompt + max_tokens
    prefill_chunk: int = 512  # prefill tokens a step, all prompts together (--prefill-chunk)
    mixed_batch: bool = True  # False: a step is all decodes or all prefill chunks
    itl_target_ms: float | str | None = "auto"  # None = off, "auto" = 3x decode-only step
    max_pending_per_client: int | None = None  # queued requests per client (None: no limit)
    max_decode_rows: int | None = None  # decode rows per step (None: every decoder)
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("max_sessions", "context", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        itl = self.itl_target_ms
        if not (itl is None or itl == "auto" or (isinstance(itl, int | float) and itl > 0)):
            raise ValueError(f"itl_target_ms must be None, 'auto' or > 0, got {itl!r}")
        for name in ("max_pending_per_client", "max_decode_rows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, radix: RadixCache | None = None,
                 speculative: SpeculativeRows | None = None) -> None:
        self.config = config
        self.pool = pool
        self.radix = radix
        self.queue = ClientRoundRobin(config.max_pending_per_client)
        self.fair_share = FairShare()
        self.srtf = ShortestRemainingFirst(config.prefill_chunk)
        self.near_done = NearDoneGate()
        fixed = config.itl_target_ms
        self.itl = ItlTarget(None if fixed in (None, "auto") else float(fixed) / 1e3)
        self.aging = PrefillAging()
        self.packer = PrefillPacker(config.prefill_chunk, self.srtf, self.aging, self.itl,
                                    self.near_done)
        self.kv = EvictAndRecompute(radix)
        self.speculative = speculative
        self.seqs: dict[str, Sequence] = {}  # every live sequence by request id
        self.requeued: list[Sequence] = []  # preempted, admitted before the client queues
        self.running: list[Sequence] = []  # resident (hold a session slot), admission order
        self.decode_queue: deque[Sequence] = deque()  # resident decoders, rotating
        self.last_plan: StepPlan | None = None
        self.num_preemptions = 0
        self._prefill_load = NO_PREFILL  # the last plan's, for the ITL cost model
        self._last_decode_only = False

    # -- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; raises ClientQuotaExceeded, or OutOfKVPages when it cannot fit
        the pool even alone."""
        self.check_fits(seq.request_id, seq.num_prompt + seq.max_tokens)
        self.queue.push(seq)
        self.seqs[seq.request_id] = seq

    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence can hold in the pool alone (None: no bound)."""
        full = [p.num_pages for g, p in self.pool.groups.items()
                if self.pool.kind(g) not in (RECURRENT, SLIDING)]
        return min(full) * self.pool.page_size if full else None

    def check_fits(self, request_id: str, num_tokens: int) -> None:
        pool, chunk = self.pool, self.config.prefill_chunk
        for group, pages in pool.groups.items():
            need = pool.pages_for(num_tokens)
            if pool.kind(group) == RECURRENT:
                need = 1
            elif pool.kind(group) == SLIDING:  # the window, one chunk and partial pages
                need = min(need, pool.pages_for(pool.windows[group] + chunk) + 2)
            if need > pages.num_pages:
                raise OutOfKVPages(
                    f"request {request_id!r} needs {need} KV pages of group {group!r} "
                    f"({num_tokens} tokens), the pool has {pages.num_pages}")

    @property
    def num_waiting(self) -> int:
        return len(self.queue) + len(self.requeued)

    def has_work(self) -> bool:
        return bool(self.seqs)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a sequence wherever it is and free its pages; None if unknown."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.phase is Phase.WAITING:
            self.queue.remove(seq)
        elif seq.phase is Phase.PREEMPTED:
            self.requeued.remove(seq)
        else:
            self._evict_resident(seq)
        seq.finish_abort()
        return seq

    # -- planning ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._admit(plan)
        alternate = not self.config.mixed_batch and bool(self.decode_queue)
        if alternate and self._last_decode_only:
            self._plan_prefill(plan)
            if plan.rows:
                plan.note("alternation", "prefill step (mixed batch off)")
        if not plan.rows:
            self._plan_decodes(plan)
            if not (alternate and plan.rows):
                self._plan_prefill(plan)
        self._last_decode_only = bool(plan.rows) and plan.prefill_row is None
        self._prefill_load = prefill_load(plan)
        self.last_plan = plan
        return plan

    def _admit(self, plan: StepPlan) -> None:
        while True:
            if len(self.running) < self.config.max_sessions:
                if self.requeued:  # preempted sequences come back first, best-ranked first
                    seq = max(self.requeued, key=lambda s: s.rank)
                    self.requeued.remove(seq)
                elif (seq := self.queue.pop()) is None:
                    return
            elif (seq := self._take_fair_share(plan)) is None:
                return
            if seq.pages is None:
                seq.pages = SeqPages(self.pool)
            # a prompt's logprobs need every position's logits: nothing comes from the cache
            if self.radix is not None and seq.prompt_logprobs is None:
                match = self.radix.match(seq.token_ids)
                if match.num_tokens:
                    seq.pages.attach(match.pages, match.num_tokens)
                    self.radix.lock(match.node)
                    seq.radix_node = match.node
                seq.num_computed = match.num_tokens
            if not seq.is_admitted:
                seq.num_cached, seq.is_admitted = seq.num_computed, True
            seq.phase = Phase.PREFILL
            self.running.append(seq)
            plan.admitted.append(seq.request_id)
            plan.note(self.queue.name, f"admit {seq.request_id} ({seq.request.client_id}), "
                      f"{seq.num_computed} tokens cached")

    def _take_fair_share(self, plan: StepPlan) -> Sequence | None:
        """All slots taken: a starved client's request, after a resident of the client
        most above its share gave up its slot (None when the shares are fair)."""
        if self.requeued:
            return None
        choice = self.fair_share.victim(self.running, self.queue, self.config.max_sessions)
        if choice is None:
            return None
        victim, client = choice
        self._release_slot(victim, plan)
        self.queue.push_front(victim)
        plan.note(self.fair_share.name, f"{victim.request_id} ({victim.request.client_id}) "
                  f"yields its slot to client {client}")
        return self.queue.pop_client(client)

    def _plan_decodes(self, plan: StepPlan) -> None:
        queue = self.decode_queue
        num = len(queue) if self.config.max_decode_rows is None else \
            min(self.config.max_decode_rows, len(queue))
        chosen = list(islice(queue, num))
        queue.rotate(-num)  # the next step starts after the last one taken
        rows: dict[int, Row] = {}
        size, recurrent = self.pool.page_size, RECURRENT in self.pool.groups
        if self.speculative is None and all(_has_page_for_next(s, size, recurrent)
                                            for s in chosen):
            # The common step: no decoder crosses a page boundary, so none allocates or
            # preempts and the order below does not matter.
            for seq in chosen:
                if seq.phase is Phase.DECODE and not seq.is_finished:
                    assert seq.pages is not None
                    seq.pages.ensure(seq.num_computed + 1)  # allocates nothing
                    plan.rows.append(Row(seq, 1, RowKind.DECODE))
            return
        # Pages go to the best-ranked first: a victim is never one already served here.
        for seq in sorted(chosen, key=lambda s: s.rank, reverse=True):
            if seq.phase is not Phase.DECODE:
                continue  # preempted for a better-ranked decoder in this loop
            drafts = self.speculative.drafts(seq) if self.speculative else ()
            if drafts and not self.kv.try_ensure(seq, seq.num_computed + 1 + len(drafts)):
                plan.note("speculative", f"no pages for {seq.request_id}'s drafts: plain row")
                drafts = ()
            if self.kv.allocate(seq, seq.num_computed + 1, self.running, self._preempter(plan),
                                plan):
                kind = RowKind.VERIFY if drafts else RowKind.DECODE
                rows[id(seq)] = Row(seq, 1 + len(drafts), kind, drafts)
            else:  # ranks lowest and no page is left: give the others its pages
                plan.note(self.kv.name, f"preempt {seq.request_id}: no page, ranks lowest")
                self._preempt(seq, plan)
        plan.rows.extend(rows[id(s)] for s in chosen if id(s) in rows and not s.is_finished
                         and s.phase is Phase.DECODE)

    def _plan_prefill(self, plan: StepPlan) -> None:
        prefills = [s for s in self.running if s.phase is Phase.PREFILL]
        if prefills:
            self.packer.pack(plan, prefills, self.decode_queue, self.num_waiting,
                             lambda seq, num: self.kv.allocate(
                                 seq, num, self.running, self._preempter(plan), plan))

    # -- after the forward ---------------------------------------------------------------
    def update(self, plan: StepPlan) -> None:
        """After the core appended the sampled tokens: finish, promote to decode, release
        sliding pages that fell out of the window."""
        for row in plan.rows:
            seq = row.seq
            if seq.finish_reason is not None:
                self.finish(seq)
                continue
            assert seq.pages is not None
            if row.kind is RowKind.PREFILL and seq.phase is Phase.DECODE:
                self.decode_queue.append(seq)
                # Cache the prompt now, not only at the finish: a request sharing it can hit
                # while this one decodes, and sliding groups still hold the window before
                # the boundary that the same prompt would match (its last token excluded).
                self._cache_prefix(seq, seq.num_computed - 1)
            if self.pool.windows:  # only sliding groups release pages
                seq.pages.release_out_of_window(seq.num_computed)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A step's measured time, for the ITL target's cost model."""
        self.itl.observe_load(plan.num_decode_tokens, self._prefill_load, seconds)
        self.packer.burst.observe(plan.num_decode_tokens, seconds, self.itl.target_s)

    def note_replayed(self, plan: StepPlan) -> None:
        """A step with prefill that replayed a graph: its chunk size, not its time."""
        self.itl.note_replayed(plan.num_decode_tokens, self._prefill_load.tokens)

    def finish(self, seq: Sequence) -> None:
        self._evict_resident(seq)
        self.seqs.pop(seq.request_id, None)
        seq.phase = Phase.FINISHED

    # -- pages ---------------------------------------------------------------------------
    def _preempter(self, plan: StepPlan) -> Callable[[Sequence], None]:
        return lambda victim: self._preempt(victim, plan)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free its pages, keep its tokens; it is recomputed after re-admission."""
        self._release_slot(seq, plan)
        self.requeued.append(seq)

    def _release_slot(self, seq: Sequence, plan: StepPlan) -> None:
        self._evict_resident(seq)
        plan.drop(seq)
        seq.phase = Phase.PREEMPTED
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(seq.request_id)

    def _evict_resident(self, seq: Sequence) -> None:
        """Give up the slot and the pages; computed whole pages go to the prefix cache."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.decode_queue:
            self.decode_queue.remove(seq)
        if seq.pages is None:
            return
        self._cache_prefix(seq, seq.num_computed)
        seq.pages.free()
        if seq.radix_node is not None:
            assert self.radix is not None
            self.radix.unlock(seq.radix_node)
            seq.radix_node = None

    def _cache_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """Insert the whole pages of the first num_tokens (computed) tokens."""
        if self.radix is not None and seq.pages is not None and \
                num_tokens >= self.pool.page_size:
            self.radix.insert(seq.token_ids[:num_tokens], seq.pages.prefix_pages(num_tokens))


def _has_page_for_next(seq: Sequence, page_size: int, recurrent: bool) -> bool:
    """Whether the decoder's pages already hold the position of its next token, so that
    `EvictAndRecompute.allocate` would allocate nothing: positions [0, num_tokens) are
    covered by whole pages (SeqPages), i.e. up to the end of the last one, and the
    recurrent group has its live slot."""
    pages = seq.pages
    if pages is None:
        return False
    capacity = -(-pages.num_tokens // page_size) * page_size
    return seq.num_computed < capacity and not (recurrent and not pages.table(RECURRENT))
