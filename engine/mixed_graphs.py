"""Graph capture of mixed steps: prefill chunks beside decode rows (CUDA graphs; HIP graphs).

An eager step launches a few hundred Triton kernels from Python, and their launch costs
the host about 25 ms on the H200 whatever the step's size (bench/RESULTS.md), several
times a small step's device time: every step that carries a new prompt's first tokens
would stall every stream. A mixed step whose tokens fit a bucket (TOKEN_BUCKETS) instead
replays a graph captured for its shape.

The attention plans and write slots are made on the host from the batch's CPU tensors
(as the eager path does; no synchronisation) and, with the tokens, positions, page tables
and logits rows, staged in pinned memory and uploaded in one copy into the static buffers
that the graph reads. A graph's key is what fixes its launch shapes: the token bucket, the
logits rows and, per layer group, the number of work items (the chunks' and the one-token
rows' apart, each at least MIN_ITEMS) and of partial-result slots (each rounded up to a
power of two). Padding tokens take token 0 at position 0, belong to
no row and no work item, and write their K/V to the scratch page (engine/graphs.py), so
no real row reads them; padding items cover no keys. One-token rows are cut as a decode
step cuts them (the runner's split lengths, by each row's own length) into a fixed number
of key splits (the decode graphs' rule), the unused ones empty, and run in a launch of
their own with the decode config, so the merge sums the same terms as the eager plan and
a decode-only step (the extra terms are exact zeros): a row's logits are the eager step's
bits, and a decoding row's those of a decode-only step, on the kernels whose bits do not
depend on the token count (qint, qmatmul).

A key is due for capture the second time a step has it (CAPTURE_AT): under load many
keys come once (a burst of arrivals, a step cut by the ITL target); the first time, the
step runs eagerly, which also builds any kernel variant it is the first to need. A capture
costs 85-170 ms on the H200, several eager steps, and a step that captured stalled every
stream beside it (the H200's fairness run: five captures, 86-132 ms gaps against a 60 ms
ITL target; bench/RESULTS.md). So by default (`when="idle"`) a due key's step still runs
eagerly and the key waits, with a copy of that step's staged inputs whose K/V writes go
to the scratch pages, until the engine has had no request to serve for a moment
(`capture_pending`, called by the engine loop after engine.IDLE_GRACE_S of quiet); a
request that arrives during a capture waits for that one. `when="step"` captures in the
due step itself, with the step's own batch (its warm-up runs store the same K/V at the
same slots). A capture runs the forward twice outside the graph, so the models with
recurrent state stay eager (the runner's rule). `when="busy"` waits for a quiet moment
too, but captures in its step a key seen BUSY_AFTER more times meanwhile (a box that is
never idle would otherwise run it eagerly for good). Captures are limited to MAX_GRAPHS:
a key due past that replaces the least recently replayed graph at the next quiet moment
(`when="step"`: it runs eagerly, as do batches that fit no bucket).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.graphs import Capturer, Replay
from engine.layers.attention import AttnLayer, GroupInputs, PlannedBatch
from kernels.paged_attention_plan import AttnConfig, AttnPlan, plan_attention
from kernels.triton_util import next_pow2

log = logging.getLogger(__name__)

# Up to 256 tokens: past that an eager step's device time hides its host time (a q8 8B
# model computes about 200 tokens in the 25 ms the host takes to launch a step on the
# H200), while padding to a bucket would add device time.
TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPHS = 48
CAPTURE_AT = 2  # the sighting of a key that captures it (earlier ones run eagerly)
MAX_SEEN = 4096  # keys counted before the counts start over
MAX_PENDING = 8  # due keys waiting for a quiet moment (more: they are counted again later)
WHEN = ("idle", "step", "busy")  # when a due key is captured
# when="busy": the sightings past capture_at after which a key still waiting for a quiet
# moment is captured in its step (a box that is never idle; not measured yet)
BUSY_AFTER = 8
MAX_WORK = 4096  # work items of a group, at most (more: the step runs eagerly)
WORK = 6  # fields of a work item (kernels/paged_attention_plan.py)
MIN_ITEMS = 16  # work items of a kind a graph holds at least (_items)


def capture_at_setting() -> int | None:
    """MBUFO_MIXED_CAPTURE_AT: the sighting of a key that captures its graph (default
    CAPTURE_AT; a capture stalls its step, the steps it replays save their launches), or
    `off`: mixed steps run eagerly. For A/B runs of the stalls against the launches."""
    raw = os.environ.get("MBUFO_MIXED_CAPTURE_AT", "").strip()
    if raw == "off":
        return None
    if not raw:
        return CAPTURE_AT
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"MBUFO_MIXED_CAPTURE_AT must be off or a count >= 1, got {raw!r}")
    return int(raw)


def capture_when_setting() -> str:
    """MBUFO_MIXED_CAPTURE_WHEN: `idle` (default: a due key's graph is captured when the
    engine has no request to serve), `step` (in the step that finds it due, which
    stalls that step's streams) or `busy` (idle, but a key seen BUSY_AFTER more times
    while it waits is captured in its step: one stall for a key that keeps coming on a
    box that is never idle). For A/B runs."""
    raw = os.environ.get("MBUFO_MIXED_CAPTURE_WHEN", "").strip() or WHEN[0]
    if raw not in WHEN:
        raise ValueError(f"MBUFO_MIXED_CAPTURE_WHEN must be one of {WHEN}, got {raw!r}")
    return raw


# One graph's shape: (token bucket, logits rows, ((group, work items, one-token rows'
# work items, slots), ...)).
Key = tuple[int, int, tuple[tuple[str, int, int, int], ...]]


class MixedGraphs:
    """Captured mixed-step forwards by Key. `step(planned)` maps a PlannedBatch on the
    device to the logits of its logits rows; `configs` are the layer groups' attention
    configs of mixed steps; rows past `max_rows` or tokens past the largest bucket run
    eagerly, and so does a key's step until its `capture_at`-th sighting; `when`: whether
    a due key is captured in its step or later, by `capture_pending`. `fill`: the
    groups' work items at once (plan_attention; the eager path's, so a replay's plan is
    the eager step's)."""

    def __init__(self, step: Callable[[PlannedBatch], torch.Tensor],
                 layers: dict[str, AttnLayer], configs: dict[str, AttnConfig],
                 scratch_pages: dict[str, int], page_size: int, max_context: int,
                 max_rows: int, device: torch.device, capture: Capturer,
                 buckets: tuple[int, ...] = TOKEN_BUCKETS, max_graphs: int = MAX_GRAPHS,
                 capture_at: int = CAPTURE_AT, fill: dict[str, int] | None = None,
                 when: str = WHEN[0]) -> None:
        if when not in WHEN:
            raise ValueError(f"when must be one of {WHEN}, got {when!r}")
        self.step, self.layers, self.configs = step, dict(layers), dict(configs)
        self.fill = dict(fill or {})
        self.groups = sorted(self.layers)
        self.scratch_pages, self.page_size = dict(scratch_pages), page_size
        self.max_context, self.max_rows = max_context, max_rows
        self.buckets, self.max_graphs = tuple(sorted(buckets)), max_graphs
        self.capture_at, self.when = capture_at, when
        # due keys (when="idle") -> their step's staged inputs, K/V writes to scratch
        self._pending: dict[Key, np.ndarray] = {}
        self.width = -(-max_context // page_size)
        self._capture = capture
        self._graphs: dict[Key, tuple[Replay, torch.Tensor]] = {}
        self._seen: dict[Key, int] = {}
        self._layouts: dict[Key, dict[str, tuple[int, int]]] = {}
        self._pin = device.type == "cuda"
        self._device = device
        # Staging buffers for every key within MAX_WORK items a group and kind (graphs
        # bind to the device buffer they were captured on, so it never changes)
        size = self._size((self.buckets[-1], max_rows, tuple(
            (g, MAX_WORK, MAX_WORK, 0) for g in self.groups)))
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self._pin)
        self._dev = torch.zeros(size, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if self._pin else None
        self.num_replays = 0
        self.num_dropped = 0  # graphs dropped for newer keys (when="idle")

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def num_pending(self) -> int:
        """Due keys waiting for `capture_pending`."""
        return len(self._pending)

    def holds(self, num_rows: int, num_tokens: int) -> bool:
        """Whether a step of these rows and tokens is within a graph's sizes."""
        return 0 < num_tokens <= self.buckets[-1] and num_rows <= self.max_rows

    def fits(self, batch: ForwardBatch) -> bool:
        """A host batch with more than decode rows that a bucket holds."""
        return (not batch.is_decode_only() and self.holds(batch.num_rows, batch.num_tokens)
                and 0 < batch.logits_rows.numel() <= self.max_rows
                and batch.max_seq_len() <= self.max_context
                and all(batch.page_tables[g].shape[1] <= self.width for g in self.groups))

    def run(self, batch: ForwardBatch, splits: dict[str, int],
            keys: dict[str, np.ndarray] | None = None) -> torch.Tensor | None:
        """Logits (len(logits_rows), vocab) of a host batch that `fits`, from its graph
        (captured first at the key's `capture_at`-th sighting), one-token rows with
        `splits[group]` key splits, cut at `keys[group]` (one a row: plan_attention's
        decode_keys; None: at the config's split_keys); None when no graph takes it (the
        caller runs the step eagerly)."""
        plans = {g: plan_attention(batch.query_start, batch.seq_lens,
                                   group=layer.num_heads // layer.num_kv_heads,
                                   window=layer.window, config=self.configs[g], device="cpu",
                                   decode_splits=splits[g], fill=self.fill.get(g, 0),
                                   decode_keys=None if keys is None else keys[g])
                 for g, layer in self.layers.items()}
        tokens = next(b for b in self.buckets if b >= batch.num_tokens)
        logits = next_pow2(batch.logits_rows.numel())
        key: Key = (tokens, logits, tuple(
            (g, _items(plans[g].work), _items(plans[g].decode_work),
             _slots(plans[g].num_slots, tokens))
            for g in self.groups))
        if key not in self._graphs:
            full = len(self._graphs) >= self.max_graphs
            if full and self.when == "step" or self._size(key) > self._dev.numel():
                return None
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = seen = self._seen.get(key, 0) + 1
            if seen < self.capture_at:
                return None
            in_step = self.when == "step" or (
                self.when == "busy" and not full and seen >= self.capture_at + BUSY_AFTER)
            if not in_step:
                if key not in self._pending and len(self._pending) < MAX_PENDING:
                    self._pending[key] = self._snapshot(batch, plans, key)
                return None
            self._pending.pop(key, None)  # "busy": it kept coming without a quiet moment
            self._stage(batch, plans, key)
            log.info("capturing the mixed-step graph %s", key)
            self._graphs[key] = self._capture(self._static_step(key))
        else:
            self._stage(batch, plans, key)
            self._graphs[key] = self._graphs.pop(key)  # the most recently replayed last
        replay, out = self._graphs[key]
        replay()
        self.num_replays += 1
        return out[:batch.logits_rows.numel()].clone()  # the next replay overwrites `out`

    def capture_pending(self) -> bool:
        """Capture the oldest due key's graph from its staged inputs (their K/V writes go to
        the scratch pages; the attention reads pages whose contents no longer matter: the
        output is thrown away). With MAX_GRAPHS held, the least recently replayed graph is
        dropped first (a server up for weeks keeps capturing the keys its load has now).
        -> whether a graph was captured (call again while so)."""
        while self._pending:
            key = next(iter(self._pending))
            inputs = self._pending.pop(key)
            if key in self._graphs:
                continue
            if len(self._graphs) >= self.max_graphs:
                dropped = next(iter(self._graphs))
                log.info("dropping the mixed-step graph %s (least recently replayed)", dropped)
                del self._graphs[dropped]  # its memory goes back to the graphs' pool
                self.num_dropped += 1
            self._wait_for_upload()
            self._host[:len(inputs)] = torch.from_numpy(inputs)
            self._upload(len(inputs))
            log.info("capturing the mixed-step graph %s (engine idle)", key)
            self._graphs[key] = self._capture(self._static_step(key))
            return True
        return False

    def _snapshot(self, batch: ForwardBatch, plans: dict[str, AttnPlan],
                  key: Key) -> np.ndarray:
        """The staged inputs of `batch` for `key` with every token's K/V write sent to the
        scratch page (a later capture's runs then overwrite no sequence's K/V)."""
        end = self._write_host(batch, plans, key)
        inputs = self._host.numpy()[:end].copy()
        layout = self._layout(key)
        for g in self.groups:
            at, n = layout[f"slots:{g}"]
            inputs[at:at + n] = self.scratch_pages[g] * self.page_size
        return inputs

    def _size(self, key: Key) -> int:
        return sum(n for _, n in self._layout(key).values())

    def _layout(self, key: Key) -> dict[str, tuple[int, int]]:
        """Name -> (offset, length) of each static input in the staging buffers (made
        once a key)."""
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._make_layout(key)
        return layout

    def _make_layout(self, key: Key) -> dict[str, tuple[int, int]]:
        tokens, logits, groups = key
        sizes = [("ids", tokens), ("pos", tokens), ("qs", self.max_rows + 1),
                 ("lens", self.max_rows), ("logits", logits)]
        for g, work, dwork, _ in groups:
            sizes += [(f"slots:{g}", tokens), (f"base:{g}", tokens), (f"splits:{g}", tokens),
                      (f"work:{g}", work * WORK), (f"dwork:{g}", dwork * WORK),
                      (f"table:{g}", self.max_rows * self.width)]
        out, at = {}, 0
        for name, n in sizes:
            out[name] = (at, n)
            at += n
        return out

    def _stage(self, batch: ForwardBatch, plans: dict[str, AttnPlan], key: Key) -> None:
        """The batch's inputs, padded to `key`, staged and uploaded in one copy."""
        self._upload(self._write_host(batch, plans, key))

    def _upload(self, end: int) -> None:
        """The staging buffer's first `end` values to the device buffer the graphs read."""
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _wait_for_upload(self) -> None:
        """Until the previous upload has left the staging buffer (it may be rewritten)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _write_host(self, batch: ForwardBatch, plans: dict[str, AttnPlan], key: Key) -> int:
        """The batch's inputs, padded to `key`, written to the host staging buffer once the
        previous upload has left it. -> the staged length."""
        layout = self._layout(key)
        end = max(at + n for at, n in layout.values())
        self._wait_for_upload()
        host = self._host.numpy()

        def put(name: str, values: np.ndarray, pad: int = 0) -> None:
            at, n = layout[name]
            host[at:at + len(values)] = values
            host[at + len(values):at + n] = pad

        t, rows = batch.num_tokens, batch.num_rows
        put("ids", batch.input_ids.numpy())
        put("pos", batch.positions.numpy())
        put("qs", batch.query_start.numpy(), t)
        put("lens", batch.seq_lens.numpy(), 1)
        put("logits", batch.logits_rows.numpy())
        for g in self.groups:
            plan = plans[g]
            scratch = self.scratch_pages[g] * self.page_size
            put(f"slots:{g}", batch.write_slots(g, self.page_size).numpy(), scratch)
            put(f"base:{g}", plan.tok_base.numpy())
            put(f"splits:{g}", plan.tok_splits.numpy())
            put(f"work:{g}", plan.work.numpy().reshape(-1))  # empty items: zeros
            if plan.decode_work is not None:
                put(f"dwork:{g}", plan.decode_work.numpy().reshape(-1))
            at, n = layout[f"table:{g}"]
            table = host[at:at + n].reshape(self.max_rows, self.width)  # in place
            src = batch.page_tables[g].numpy()
            table[:rows, :src.shape[1]] = src
            table[:rows, src.shape[1]:] = -1
            table[rows:] = -1
        return end

    def _static_step(self, key: Key) -> Callable[[], torch.Tensor]:
        """The forward over `key`'s views of the device buffer (what the graph captures)."""
        layout, dev = self._layout(key), self._dev
        tokens, _, groups = key

        def view(name: str) -> torch.Tensor:
            at, n = layout[name]
            return dev[at:at + n]

        def step() -> torch.Tensor:
            positions = view("pos")
            tables = {g: view(f"table:{g}").view(self.max_rows, self.width)
                      for g in self.groups}
            pos32 = positions.to(torch.int32)
            attn = {}
            for g, work, dwork, slots in groups:
                plan = AttnPlan(view(f"work:{g}").view(work, WORK).to(torch.int32),
                                view(f"base:{g}").to(torch.int32),
                                view(f"splits:{g}").to(torch.int32), slots, tokens,
                                view(f"dwork:{g}").view(dwork, WORK).to(torch.int32)
                                if dwork else None)
                attn[g] = GroupInputs(plan, tables[g].to(torch.int32), pos32, self.configs[g])
            planned = PlannedBatch(view("ids"), positions, view("qs"), view("lens"), tables,
                                   view("logits"),
                                   _write_slots={g: view(f"slots:{g}") for g in self.groups},
                                   attn=attn, _every_token=False)  # rows differ by replay
            return self.step(planned)

        return step


def _items(work: torch.Tensor | None) -> int:
    """A graph's work items of one kind: a power of two, at least MIN_ITEMS (a chunk's
    items and the one-token rows' are counted apart, so a few more or fewer of either
    should not make another key; padding items cover no keys), 0 without any."""
    n = 0 if work is None else work.shape[0]
    return max(MIN_ITEMS, next_pow2(n)) if n else 0


def _slots(num_slots: int, tokens: int) -> int:
    """Partial-result slots of a graph: a power of two, never the token count itself (the
    attention would then take one split a token for granted and write the output
    directly; the merge kernel gives the same bits)."""
    slots = next_pow2(num_slots)
    return 2 * slots if slots == tokens else slots
