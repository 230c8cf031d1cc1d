"""Test doubles for the scheduler and the engine core: a KV-checking fake runner, a fake
clock, a fake tokenizer, and a reference decoder that never touches the engine.

FakeRunner writes every new token id into its KV slot (per layer group, through the
batch's page tables) and derives each logits row from the tokens it reads back through the
page tables: every position up to the row's for the full group, the last `window` for a
sliding one. A wrong page table, a shared page overwritten, a skipped position or a wrong
recompute changes the logits (reading a never-written slot raises), so an output equals the
reference only if the pages were right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.batch import ForwardBatch
from engine.core import EngineCore
from engine.kv.pool import KVPool
from engine.sampler import Sampler, SamplerState, SamplingParams
from engine.scheduler.request import OutputChunk, Request
from engine.scheduler.scheduler import SchedulerConfig

VOCAB = 64
EOS = 0
_MULT = torch.tensor([(i * 2654435761) % 1000003 + 1 for i in range(1 << 14)])


def context_hash(tokens: torch.Tensor, first_pos: int) -> int:
    """tokens: (n,) the visible context, the first at position first_pos."""
    mult = _MULT[first_pos:first_pos + tokens.numel()]
    return int(((tokens + 1) * mult).sum()) % 1_000_000_007


def logits_of(h: int, vocab: int = VOCAB) -> torch.Tensor:
    """(vocab,) float32, a deterministic function of the context hash."""
    x = torch.arange(vocab, dtype=torch.float32)
    return torch.sin(x * ((h % 9973) + 1) * 0.013 + (h % 97)) * 4.0


def hash_of_context(tokens: Sequence[int], windows: dict[str, int]) -> int:
    """The hash FakeRunner computes for the last position of `tokens`."""
    ids = torch.tensor(list(tokens))
    h = context_hash(ids, 0)
    for window in windows.values():
        first = max(0, len(tokens) - window)
        h = h * 31 + context_hash(ids[first:], first)
    return h


def reference_tokens(prompt: Sequence[int], params: SamplingParams, num: int,
                     windows: dict[str, int] | None = None, eog: int | None = EOS) -> list[int]:
    """What a correct engine streams for `prompt`: one token at a time, no batching, no
    pages, straight from the fake model's logits and the sampler."""
    windows = windows or {}
    tokens, out = list(prompt), []
    state = SamplerState.create(params, prompt, VOCAB)
    sampler = Sampler()
    for _ in range(num):
        logits = logits_of(hash_of_context(tokens, windows))[None]
        token = sampler.sample(logits, [state]).token_ids[0]
        out.append(token)
        tokens.append(token)
        if token in params.stop_token_ids or (token == eog and not params.ignore_eos):
            break
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class BatchRecord:
    spans: list[tuple[tuple[int, ...], int]]  # per row: (new token ids, first position)
    logits_rows: list[int]


@dataclass
class FakeRunner:
    num_pages: int
    page_size: int = 4
    windows: dict[str, int] = field(default_factory=dict)
    clock: FakeClock | None = None
    costs: tuple[float, float, float] = (2e-3, 1e-3, 5e-5)  # a + b*decode rows + c*tokens
    batches: list[BatchRecord] = field(default_factory=list)
    noise: Callable[[int], float] | None = None  # step number -> factor on its cost
    # decode graphs: a decode-only step "replays" at this factor of its eager cost
    replay_factor: float | None = None
    # mixed-step graphs: a step with prefill "replays" at this factor of its eager cost
    mixed_replay_factor: float | None = None
    last_replayed: bool = False
    # steps (1-based batch numbers) that "capture" a graph: they replay and cost this more
    capture_steps: set[int] = field(default_factory=set)
    capture_cost: float = 0.1
    last_captured: bool = False

    @property
    def graphs(self) -> object | None:
        """What the core checks for decode graphs: set while replay_factor is."""
        return None if self.replay_factor is None else self

    def __post_init__(self) -> None:
        groups = {"full": self.num_pages, **{g: self.num_pages for g in self.windows}}
        self.pool = KVPool(groups, self.page_size, self.windows)
        self.store = {g: torch.full((n * self.page_size,), -1, dtype=torch.long)
                      for g, n in groups.items()}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        starts = batch.query_start.tolist()
        ids = batch.input_ids.tolist()
        spans = [(tuple(ids[a:b]), int(batch.positions[a]))
                 for a, b in zip(starts[:-1], starts[1:], strict=True)]
        self.batches.append(BatchRecord(spans, batch.logits_rows.tolist()))
        for g, store in self.store.items():
            for row, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
                slots = batch.row_slots(g, row, batch.positions[a:b], self.page_size)
                store[slots] = batch.input_ids[a:b]
        out = []
        for idx in batch.logits_rows.tolist():
            row = int(torch.searchsorted(batch.query_start, idx, right=True)) - 1
            pos = int(batch.positions[idx])
            h = self._read(batch, row, "full", 0, pos)
            for g, window in self.windows.items():
                first = max(0, pos + 1 - window)
                h = h * 31 + self._read(batch, row, g, first, pos)
            out.append(logits_of(h))
        if self.clock is not None:
            a, b, c = self.costs
            decode = sum(len(t) == 1 for t, _ in spans)
            tokens = sum(len(t) for t, _ in spans if len(t) > 1)
            factor = 1.0 if self.noise is None else self.noise(len(self.batches))
            replay = self.replay_factor if tokens == 0 else self.mixed_replay_factor
            self.last_captured = len(self.batches) in self.capture_steps
            self.last_replayed = replay is not None or self.last_captured
            if replay is not None:
                factor *= replay
            self.clock.now += (a + b * decode + c * tokens) * factor + \
                self.last_captured * self.capture_cost
        return torch.stack(out) if out else torch.zeros(0, VOCAB)

    def _read(self, batch: ForwardBatch, row: int, group: str, first: int, pos: int) -> int:
        positions = torch.arange(first, pos + 1)
        slots = batch.row_slots(group, row, positions, self.page_size)
        if bool((slots < 0).any()):
            raise AssertionError(f"row {row} reads a released page of {group}")
        tokens = self.store[group][slots]
        if bool((tokens < 0).any()):
            raise AssertionError(f"row {row} reads a never-written KV slot of {group}")
        return context_hash(tokens, first)


class FakeDetok:
    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    eog_ids = frozenset({EOS})


def make_core(num_pages: int = 256, page_size: int = 4, windows: dict[str, int] | None = None,
              clock: FakeClock | None = None, draft_source=None,
              **config) -> tuple[EngineCore, FakeRunner]:
    config.setdefault("itl_target_ms", None)
    runner = FakeRunner(num_pages, page_size, dict(windows or {}), clock)
    core = EngineCore(runner, FakeTokenizer(), SchedulerConfig(**config), vocab_size=VOCAB,
                      detokenizer=FakeDetok, draft_source=draft_source,
                      clock=clock or FakeClock())
    return core, runner


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def req(rid: str, prompt: Sequence[int], params: SamplingParams | None = None,
        client: str = "local", priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, tuple(prompt), params or greedy(), client, priority, arrival)


def prompt_of(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=g).tolist()


def run_all(core: EngineCore, max_steps: int = 20_000) -> dict[str, list[OutputChunk]]:
    """Step until idle; every request's chunks in order."""
    out: dict[str, list[OutputChunk]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return out
        for chunk in core.step():
            out.setdefault(chunk.request_id, []).append(chunk)
    raise AssertionError(f"not idle after {max_steps} steps")


def tokens_of(chunks: list[OutputChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def plan_rows(core: EngineCore) -> list[tuple[str, str, int]]:
    """(request id, kind, tokens) of the last step's rows."""
    plan = core.scheduler.last_plan
    assert plan is not None
    return [(r.seq.request_id, r.kind.value, r.num_new_tokens) for r in plan.rows]
