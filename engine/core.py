"""EngineCore: step() = schedule -> run -> postprocess, single-threaded, no asyncio.

One step: the scheduler picks every due decoder and prefill chunks of one or more prompts
within one bounded token budget (engine/scheduler/prefill.py); the rows become one
ForwardBatch; the runner returns logits for the rows that need a token
(decode rows, verify rows, prefill chunks that complete a sequence); one Sampler call
draws a token for each; postprocess appends them (stop checks, detokenization, timings)
and the scheduler finishes, promotes and frees. The thread/asyncio `Engine` wraps this.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from engine.batch import ForwardBatch, pad_tables, to_device
from engine.errors import ContextOverflow, InvalidRequest, OutOfKVPages
from engine.kv.pool import RECURRENT, KVPool
from engine.kv.radix import RadixCache
from engine.sampler import Sampler, SamplerState, token_logprobs
from engine.scheduler.plan import (
    ClientQueueStats,
    EngineStats,
    KVGroupStats,
    RowKind,
    SessionStats,
    SlowStep,
    StepPlan,
)
from engine.scheduler.policies.itl_target import NO_PREFILL
from engine.scheduler.policies.speculative import DraftSource, SpeculativeRows
from engine.scheduler.request import OutputChunk, Request
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.sequence import DetokenizerFactory, Sequence
from engine.stop import StopChecker

AUTO_ITL_FACTOR = 3.0  # "auto" ITL target: this many decode-only steps
EAGER_CAP = 8.0  # with decode graphs: the eager estimate counts up to this many replays
SLOW_STEPS_KEPT = 64  # EngineStats.slow_steps: the latest steps over the ITL target


class Runner(Protocol):
    pool: KVPool

    @property
    def page_size(self) -> int: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (len(batch.logits_rows), vocab) logits."""
        ...


class TokenizerLike(Protocol):
    eog_ids: frozenset[int]


class EngineCore:
    def __init__(self, runner: Runner, tokenizer: TokenizerLike, config: SchedulerConfig,
                 *, vocab_size: int, detokenizer: DetokenizerFactory | None = None,
                 draft_source: DraftSource | None = None,
                 clock: Callable[[], float] = time.perf_counter, look_ahead: bool = True) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.clock = clock
        if detokenizer is None:
            from engine.tokenizer.detok import IncrementalDetokenizer

            def detokenizer() -> IncrementalDetokenizer:
                # a completion continues its prompt: keep the first token's space; stream
                # text as llama-server does (no llama.cpp clean-up of spaces)
                return IncrementalDetokenizer(tokenizer, clean_spaces=False,  # type: ignore[arg-type]
                                              continuation=True)
        self._make_detok = detokenizer
        # Recurrent state is not snapshotted at page boundaries yet: no prefix cache there.
        use_cache = config.prefix_cache and RECURRENT not in self.pool.groups
        self.radix = RadixCache(self.pool) if use_cache else None
        spec = SpeculativeRows(draft_source, vocab_size) if draft_source is not None else None
        self.scheduler = Scheduler(config, self.pool, self.radix, spec)
        self.sampler = Sampler()
        self.num_steps = 0
        self._seq_no = itertools.count()
        self._aborts: list[str] = []
        self._decode_step_s: deque[float] = deque(maxlen=256)  # decode-only step times
        self._recent_itl_s: deque[float] = deque(maxlen=512)
        self._slow_steps: deque[SlowStep] = deque(maxlen=SLOW_STEPS_KEPT)
        # Decode steps launched from the device's samples before the host reads them
        # (runners with decode graphs): the host's work between steps then overlaps the
        # device's.
        self.look_ahead = look_ahead
        self._ahead: _Ahead | None = None
        self.num_ahead_steps = 0  # steps whose logits came from such a launch

    # -- requests ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Validate and queue; raises InvalidRequest, ContextOverflow, OutOfKVPages (the
        request cannot fit the pool even alone) or ClientQuotaExceeded."""
        prompt, params = request.prompt_ids, request.sampling
        if request.id in self.scheduler.seqs:
            raise InvalidRequest(f"request id {request.id!r} is already in use")
        if not prompt:
            raise InvalidRequest("the prompt has no tokens")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt token ids must lie in [0, {self.vocab_size})")
        if params.n != 1:
            raise InvalidRequest(f"n={params.n}: the engine core runs one sequence per request")
        limit = self.config.context
        capacity = self.scheduler.capacity_tokens()
        max_tokens = params.max_tokens
        if max_tokens is None:  # as many as the context (and the pool) allow
            max_tokens = max(1, min(limit, capacity or limit) - len(prompt))
        if len(prompt) + max(max_tokens, 1) > limit:
            raise ContextOverflow(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context ({limit} tokens)")
        sampler = SamplerState.create(params, prompt, self.vocab_size)  # validates params
        stop = StopChecker(params.stop, params.stop_token_ids, self.tokenizer.eog_ids,
                           params.ignore_eos, max_tokens)
        seq = Sequence(request, next(self._seq_no), max_tokens, sampler, stop,
                       self._make_detok(), self.clock())
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Finish the request with "abort" and free its pages in the next step."""
        self._aborts.append(request_id)

    def set_client_quota(self, client_id: str, max_pending: int | None) -> None:
        self.scheduler.queue.set_limit(client_id, max_pending)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts)

    def idle(self) -> bool:
        """Work the runner keeps for a moment with no request (a deferred graph capture);
        call only while `has_work()` is False. -> whether it did any (ask again while so)."""
        idle = getattr(self.runner, "idle", None)
        return bool(idle()) if idle is not None else False

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[OutputChunk]:
        start = self.clock()
        chunks = self._reap_aborts()
        self._update_itl_target()
        plan = self.scheduler.schedule()
        ahead, self._ahead = self._ahead, None
        if plan.is_empty:
            return chunks
        logits = None if ahead is None else ahead.logits_for(plan)
        if logits is not None:
            self.num_ahead_steps += 1
            replayed, path = True, "ahead"
        else:
            logits = self.runner.forward(build_batch(plan, list(self.pool.groups)))
            replayed = getattr(self.runner, "last_replayed", False)
            path = "capture" if getattr(self.runner, "last_captured", False) else \
                "replay" if replayed else "eager"
        chunks += self._postprocess(plan, logits)
        self.num_steps += 1
        end = self.clock()
        elapsed = end - start
        self._note_slow(plan, elapsed, end, path)
        # The ITL cost model predicts eager steps; a graph replay costs a fraction of its
        # eager twin and would skew it. A replayed step with prefill (a mixed-step graph)
        # still shows how large chunks beside decoders have become.
        if not replayed:
            self.scheduler.observe(plan, elapsed)
        elif plan.prefill_row is not None:
            self.scheduler.note_replayed(plan)
        if plan.prefill_row is None:
            self._decode_step_s.append(elapsed)
        return chunks

    def _note_slow(self, plan: StepPlan, elapsed: float, end: float, path: str) -> None:
        """Keep a step with decode rows that took longer than the ITL target (SlowStep)."""
        target = self.scheduler.itl.target_s
        decode_rows = len(plan.rows) - (plan.prefill_row is not None)
        if target is not None and elapsed > target and decode_rows:
            self._slow_steps.append(SlowStep(end, elapsed * 1e3, target * 1e3, decode_rows,
                                             plan.num_prefill_tokens, path))

    def _reap_aborts(self) -> list[OutputChunk]:
        seqs = [self.scheduler.abort(rid) for rid in self._aborts]
        self._aborts.clear()
        return [s.take_output() for s in seqs if s is not None]

    def _update_itl_target(self) -> None:
        """auto: AUTO_ITL_FACTOR decode-only steps. With decode graphs such a step is a
        replay, while every step with prefill runs eagerly and costs more before its first
        prefill token (on the H200 more than 3 replays at 64 rows); the decode-only step is
        then the cost model's eager estimate for the current rows when that is larger, so
        the target bounds what prefill adds to a step, not the eager overhead itself (the
        estimate is capped at EAGER_CAP replays; the H200 measured about 5.7 at 64 rows)."""
        if self.config.itl_target_ms != "auto":
            return
        times = self._decode_step_s
        base = statistics.median(times) if times else None
        model = self.scheduler.itl.model
        if base is not None and getattr(self.runner, "graphs", None) is not None \
                and model.is_ready:
            rows = max(1, len(self.scheduler.decode_queue))
            # bounded: a fit still carrying steps that compiled kernels can be far off
            base = max(base, min(model.predict_load(rows, NO_PREFILL), EAGER_CAP * base))
        self.scheduler.itl.target_s = None if base is None else AUTO_ITL_FACTOR * base

    def _postprocess(self, plan: StepPlan, logits: torch.Tensor) -> list[OutputChunk]:
        """Sample every row that needs a token: one Sampler call, then one more per accepted
        draft position of verify rows (each sample is drawn from the model's distribution
        given the tokens before it, so the kept tokens are exactly what plain decoding would
        give: a draft is kept only if sampling agrees with it)."""
        now = self.clock()
        pending: list[list] = []  # [row, first logits row, drafts accepted so far]
        launch = (lambda ids: self._launch_ahead(plan, ids)) if self._may_look_ahead(plan) \
            else None
        offset = 0
        for row in plan.rows:
            num = row.num_logits  # before committing: it depends on num_computed
            seq = row.seq
            if row.kind is RowKind.PREFILL:
                if num and seq.prompt_logprobs is not None:
                    _prompt_logprobs(seq, logits[offset:offset + num], seq.num_computed)
                seq.num_computed += row.num_new_tokens
                if seq.num_computed == seq.num_tokens:  # the chunk completes it: sample
                    pending.append([row, offset + num - 1, 0])
            elif num:
                pending.append([row, offset, 0])
            offset += num
        while pending:
            index = [first + i for _, first, i in pending]
            # Decode-only steps need every logits row in order: no gather.
            rows = logits if index == list(range(logits.shape[0])) else \
                logits[torch.tensor(index, dtype=torch.long)]
            out = self.sampler.sample(rows, [p[0].seq.sampler for p in pending],
                                      on_device=launch)
            launch = None  # verify rows' later passes: no plan qualifies anyway
            accepted = []
            for p, token, logprob in zip(pending, out.token_ids, out.logprobs, strict=True):
                row, _, i = p
                seq = row.seq
                if row.kind is not RowKind.PREFILL:
                    seq.num_computed += 1  # the token at this position is now in the KV
                if seq.last_token_time is not None:
                    self._recent_itl_s.append(now - seq.last_token_time)
                done = seq.append(token, logprob, now)
                if not done and i < len(row.draft_ids) and token == row.draft_ids[i]:
                    p[2] += 1
                    accepted.append(p)
            pending = accepted
        self.scheduler.update(plan)
        return [r.seq.take_output() for r in plan.rows if r.seq.has_output()]

    # -- the next step, launched before this one's tokens reach the host ----------------
    def _may_look_ahead(self, plan: StepPlan) -> bool:
        """Whether the next step is likely this one's decoders again, one position on (so
        it can start from the sampled ids on the device): nobody prefills, every decoder is
        in this plan, no request waits for a free session (one waiting for a full box's
        slot leaves the plan alone unless the fair share swaps it in), each draw depends
        only on its logits (no penalties, no grammar), and one of them may still continue.
        A next plan that differs after all only costs the launched step."""
        sched = self.scheduler
        if not self.look_ahead or not getattr(self.runner, "can_look_ahead", False) or \
                plan.prefill_row is not None or \
                sched.num_waiting and len(sched.running) < self.config.max_sessions or \
                len(plan.rows) != len(sched.running) or \
                len(plan.rows) != len(sched.decode_queue):
            return False
        return all(r.kind is RowKind.DECODE and not r.draft_ids and r.seq.sampler.is_stateless
                   for r in plan.rows) and any(r.seq.num_remaining > 1 for r in plan.rows)

    def _launch_ahead(self, plan: StepPlan, token_ids: torch.Tensor) -> None:
        """Launch the next decode step of this plan's rows, its token ids `token_ids` (the
        samples still on the device). A row that stops now, or a next plan that differs,
        discards its logits: its K/V land at the position after the sequence's last
        computed one, in a page it holds (or held: the device writes them before any later
        step's), where nothing reads them before they are written again."""
        seqs = [r.seq for r in plan.rows]
        try:
            for seq in seqs:
                assert seq.pages is not None
                seq.pages.ensure(seq.num_computed + 2)  # usually allocates nothing
        except OutOfKVPages:
            return
        batch = _decode_batch(seqs, list(self.pool.groups), ahead=True)
        logits = self.runner.forward_ahead(batch, token_ids)  # type: ignore[attr-defined]
        if logits is not None:
            self._ahead = _Ahead({s: (i, s.num_computed + 1) for i, s in enumerate(seqs)},
                                 logits)

    # -- dashboard -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        now, sched = self.clock(), self.scheduler
        queued = sched.requeued + [s for _, q in sched.queue.waiting() for s in q]
        by_client: dict[str, list[Sequence]] = defaultdict(list)
        for seq in queued:
            by_client[seq.request.client_id].append(seq)
        clients = tuple(
            ClientQueueStats(c, len(q), now - min(s.arrival_time for s in q))
            for c, q in by_client.items())
        kv = tuple(
            KVGroupStats(g, p.num_pages, p.num_pages - p.num_free, p.num_free,
                         self.radix.num_cached_pages(g) if self.radix else 0)
            for g, p in self.pool.groups.items())
        target = sched.itl.target_s
        return EngineStats(
            sessions=tuple(_session_stats(s) for s in sched.running + queued),
            num_waiting=sched.num_waiting, kv=kv, clients=clients,
            last_plan=sched.last_plan.snapshot() if sched.last_plan else None,
            num_steps=self.num_steps, num_preemptions=sched.num_preemptions,
            itl_target_ms=None if target is None else target * 1e3,
            recent_itl_ms=tuple(x * 1e3 for x in self._recent_itl_s),
            prefix_hit_tokens=self.radix.num_hit_tokens if self.radix else 0,
            prefix_query_tokens=self.radix.num_query_tokens if self.radix else 0,
            num_ahead_steps=self.num_ahead_steps, slow_steps=tuple(self._slow_steps),
            graphs=getattr(self.runner, "num_graphs", 0),
            graphs_pending=getattr(self.runner, "num_pending_graphs", 0))


def _session_stats(seq: Sequence) -> SessionStats:
    ttft = None if seq.first_token_time is None else \
        (seq.first_token_time - seq.arrival_time) * 1e3
    itl = statistics.fmean(seq.itl) * 1e3 if seq.itl else None
    return SessionStats(seq.request_id, seq.request.client_id, seq.phase.value, seq.num_prompt,
                        seq.num_cached, seq.num_computed, seq.num_output, ttft, itl,
                        seq.num_preemptions)


def _prompt_logprobs(seq: Sequence, logits: torch.Tensor, start: int) -> None:
    """Record the logprobs of the prompt tokens that `logits` (the chunk's rows, positions
    start ...) predict: row j, at position start + j, predicts prompt token start + j + 1."""
    assert seq.prompt_logprobs is not None and seq.sampler.params.prompt_logprobs is not None
    num = min(logits.shape[0], seq.num_prompt - 1 - start)
    if num <= 0:
        return
    targets = seq.token_ids[start + 1:start + 1 + num]
    k = seq.sampler.params.prompt_logprobs
    for j, entry in enumerate(token_logprobs(logits[:num], targets, k)):
        seq.prompt_logprobs[start + 1 + j] = entry


def build_batch(plan: StepPlan, groups: list[str]) -> ForwardBatch:
    """One ForwardBatch for the plan's rows: each row's new tokens from its first
    uncomputed position, its page table per group, and the logits rows it needs."""
    rows = plan.rows
    if all(r.kind is RowKind.DECODE and not r.draft_ids for r in rows):
        return _decode_batch([r.seq for r in rows], groups)
    n = len(rows)
    ids: list[int] = []
    starts = np.empty(n, dtype=np.int64)
    num_new = np.empty(n, dtype=np.int64)
    num_logits = np.empty(n, dtype=np.int64)
    tables: dict[str, list[np.ndarray]] = {g: [] for g in groups}
    lists = [(tables[g].append, g) for g in groups]
    for i, row in enumerate(rows):
        seq = row.seq
        start = seq.num_computed
        if row.kind is RowKind.PREFILL:
            count = row.num_new_tokens
            ids += seq.token_ids[start:start + count]
            num_logits[i] = row.num_logits  # its last token if it completes the sequence
        else:  # the last sampled token, then the drafts; every one needs its logits
            ids.append(seq.token_ids[-1])
            ids += row.draft_ids
            count = num_logits[i] = 1 + len(row.draft_ids)
        starts[i], num_new[i] = start, count
        pages = seq.pages
        assert pages is not None
        for append, g in lists:
            append(pages.table_array(g))
    ends = np.cumsum(num_new)
    # row i's logits rows: its last num_logits[i] tokens, ends[i] - num_logits[i] .. ends[i] - 1
    taken = np.cumsum(num_logits)
    logits_rows = np.arange(taken[-1] if n else 0, dtype=np.int64) + \
        np.repeat(ends - taken, num_logits)
    return ForwardBatch.from_rows(ids, starts, num_new,
                                  {g: pad_tables(t) for g, t in tables.items()}, logits_rows)


def _decode_batch(seqs: list[Sequence], groups: list[str], ahead: bool = False) -> ForwardBatch:
    """The steady step: one row per decoder, its last sampled token at num_computed
    (`ahead`: the step after it, whose tokens are not yet on the host: ids 0 stand in)."""
    tables: dict[str, list[np.ndarray]] = {g: [] for g in groups}
    for seq in seqs:
        pages = seq.pages
        assert pages is not None
        for g in groups:
            tables[g].append(pages.table_array(g))
    starts = np.fromiter((s.num_computed + ahead for s in seqs), np.int64, len(seqs))
    ids = [0] * len(seqs) if ahead else [s.token_ids[-1] for s in seqs]
    return ForwardBatch.decode(ids, starts, {g: pad_tables(t) for g, t in tables.items()})


class _Ahead:
    """A decode step launched before the host read the tokens it continues: each
    sequence's logits row and position, and the logits (computed in order on the device)."""

    __slots__ = ("logits", "rows")

    def __init__(self, rows: dict[Sequence, tuple[int, int]], logits: torch.Tensor) -> None:
        self.rows, self.logits = rows, logits

    def logits_for(self, plan: StepPlan) -> torch.Tensor | None:
        """The plan's logits if it is this step (decode rows of these sequences at these
        positions; rows that stopped since are left out), else None."""
        index = []
        for row in plan.rows:
            hit = self.rows.get(row.seq)
            if row.kind is not RowKind.DECODE or row.draft_ids or hit is None or \
                    hit[1] != row.seq.num_computed:
                return None
            index.append(hit[0])
        if index == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits[to_device(torch.tensor(index, dtype=torch.long), self.logits.device)]
