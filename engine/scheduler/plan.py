"""StepPlan (what one step runs and why) and EngineStats (what the dashboard shows)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.scheduler.sequence import Sequence


class RowKind(enum.Enum):
    PREFILL = "prefill"  # a chunk of prompt (or recompute) tokens
    DECODE = "decode"  # the last sampled token
    VERIFY = "verify"  # the last sampled token + draft tokens to check


class Decision(NamedTuple):
    """One policy's choice in a step, for the dashboard: `policy` names the object."""

    policy: str
    detail: str


@dataclass(slots=True)
class Row:
    seq: Sequence
    num_new_tokens: int  # tokens of this row in the batch
    kind: RowKind
    draft_ids: tuple[int, ...] = ()  # VERIFY rows: tokens proposed after the last one

    @property
    def start(self) -> int:
        """Position of the row's first token."""
        return self.seq.num_computed

    @property
    def num_logits(self) -> int:
        """Logits rows it needs: every token of a verify row, the last token of a decode
        row or of a prefill chunk that completes the sequence's tokens, else none; every
        token of a chunk whose prompt logprobs are wanted (the chunk's last ones)."""
        if self.kind is RowKind.PREFILL:
            if self.seq.prompt_logprobs is not None and self.start < self.seq.num_prompt - 1:
                return self.num_new_tokens
            return int(self.start + self.num_new_tokens == self.seq.num_tokens)
        return self.num_new_tokens

    def token_ids(self) -> list[int]:
        if self.kind is RowKind.PREFILL:
            return self.seq.token_ids[self.start:self.start + self.num_new_tokens]
        return [self.seq.token_ids[-1], *self.draft_ids]


class RowSummary(NamedTuple):
    request_id: str
    kind: str
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class PlanSnapshot:
    """A StepPlan without live objects, safe to hand to another thread."""

    rows: tuple[RowSummary, ...]
    decisions: tuple[Decision, ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]


@dataclass(slots=True)
class StepPlan:
    rows: list[Row] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)  # request ids given a session slot
    preempted: list[str] = field(default_factory=list)  # request ids that gave up pages

    def note(self, policy: str, detail: str) -> None:
        self.decisions.append(Decision(policy, detail))

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def prefill_row(self) -> Row | None:
        return next((r for r in self.rows if r.kind is RowKind.PREFILL), None)

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows if r.kind is not RowKind.PREFILL)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows if r.kind is RowKind.PREFILL)

    def drop(self, seq: Sequence) -> None:
        self.rows = [r for r in self.rows if r.seq is not seq]

    def snapshot(self) -> PlanSnapshot:
        return PlanSnapshot(
            tuple(RowSummary(r.seq.request_id, r.kind.value, r.num_new_tokens)
                  for r in self.rows),
            tuple(self.decisions), tuple(self.admitted), tuple(self.preempted))


@dataclass(frozen=True, slots=True)
class SessionStats:
    request_id: str
    client_id: str
    phase: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    generated_tokens: int
    ttft_ms: float | None
    itl_ms: float | None  # mean of the recent inter-token gaps
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class KVGroupStats:
    group: str
    num_pages: int
    num_used: int
    num_free: int
    num_cached: int  # pages the prefix cache holds (some also used by sequences)


@dataclass(frozen=True, slots=True)
class ClientQueueStats:
    client_id: str
    num_waiting: int
    oldest_wait_s: float


@dataclass(frozen=True, slots=True)
class SlowStep:
    """A step with decode rows that took longer than the ITL target: what every stream in
    it waited for. `path`: eager, replay (a captured graph), capture (its graph was captured
    in this step) or ahead (launched from the step before's samples)."""
    at_s: float  # the engine's clock when the step ended
    ms: float
    target_ms: float
    decode_rows: int
    prefill_tokens: int
    path: str


@dataclass(frozen=True, slots=True)
class EngineStats:
    sessions: tuple[SessionStats, ...]  # resident first, then queued
    num_waiting: int
    kv: tuple[KVGroupStats, ...]
    clients: tuple[ClientQueueStats, ...]
    last_plan: PlanSnapshot | None
    num_steps: int
    num_preemptions: int
    itl_target_ms: float | None
    recent_itl_ms: tuple[float, ...]  # recent inter-token gaps over all sequences
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_ahead_steps: int = 0  # steps whose logits came from a look-ahead launch
    slow_steps: tuple[SlowStep, ...] = ()  # the latest steps over the ITL target, oldest first
    graphs: int = 0  # captured decode and mixed-step graphs the runner holds
    graphs_pending: int = 0  # mixed-step graphs due, waiting for a quiet moment
