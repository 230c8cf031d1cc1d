"""Graph capture of decode-only steps (CUDA graphs; HIP graphs on ROCm, same torch API).

A decode step launches a few hundred small kernels, and at batch 1 launching them from
Python costs more than running them. A captured graph launches them all in one call.

Graphs are captured lazily, one per bucket of row counts (BUCKETS) and number of key
splits per row (a power of two that covers any row up to the step's longest, each row
cut by its own length, so short contexts do not pay for the longest one). A step whose
rows are all one-token decodes and whose row count fits a bucket copies its inputs into
static buffers (one host-to-device copy), padded to the bucket, and replays that
bucket's graph; larger decode steps run eagerly, and steps with prefill replay
engine/mixed_graphs.py's graphs. A padding row decodes token 0 at position 0 of the
scratch page, a page of each group that no sequence owns (the runner allocates it beyond
the pool), so its K/V land where no real row reads.

Nothing in the captured forward synchronises with the host. The write slots and attention
plans are made on the host from the staged rows (`DecodePlans`: the integers of
engine/layers/attention.py's plan_decode) and uploaded with them in the same copy, so a
replay launches no planning kernels: made on the device they took about 23 small torch
kernels a step, none of them a programmatic dependent launch. Without `DecodePlans` the
step function plans on the device itself. Graphs in one memory pool never run at once
(one engine thread), so they may share it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.layers.attention import GroupInputs, PlannedBatch, decode_items_host
from kernels.paged_attention_plan import WORK_FIELDS, AttnConfig, AttnPlan

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Eager runs before a capture (Triton compiles, lazy device caches fill): one does both,
# and each costs a mixed step's ~25 ms of launches on the H200
WARMUP_RUNS = 1
_FIXED = 3  # columns of a staged row before its page tables: token id, position, seq_len
_ALIGN = 16  # int64 words: each staged plan array starts 128 bytes aligned

Replay = Callable[[], None]


class Capturer(Protocol):
    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Capture `fn`; -> (replay, the output tensor that every replay overwrites)."""
        ...


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Hold the cyclic collector off until the block ends: around a graph capture, a
    collection could free objects that hold CUDA resources (a dropped runner's graphs,
    pinned buffers), and freeing them while a stream captures is not permitted (the
    capture fails). Garbage already there waits for the next collection, after the
    capture: collecting first would cost every capture a full pass over the heap (about
    90 ms with a model and its vocabulary loaded, on the dev CPU)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph capture; all graphs share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (HTTP, callers) may touch CUDA while this one captures
        with no_collection(), torch.cuda.graph(graph, pool=self.pool,
                                               capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


def is_decode_only(batch: ForwardBatch) -> bool:
    """Every row has one new token and needs its logits (host tensors only)."""
    return batch.is_decode_only()


def buckets_up_to(rows: int) -> tuple[int, ...]:
    """BUCKETS, then doubled until one holds `rows`: a box set up for more sessions than
    BUCKETS' last replays its full decode steps too (an eager step of 65+ rows costs the
    host ~25 ms of launches on the H200, more than the device's step)."""
    out = list(BUCKETS)
    while out[-1] < rows:
        out.append(2 * out[-1])
    return tuple(out)


def bucket_for(num_rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds `num_rows`, None past the largest."""
    return next((b for b in buckets if b >= num_rows), None)


Splits = dict[str, int]  # key splits per decode row, by layer group


class DecodePlans(NamedTuple):
    """Per layer group, what a decode step's attention plan is made from on the host:
    the window (None: full), key positions per split, the most splits a row takes, and
    the kernel config of decode steps (engine/layers/attention.py's attn_config)."""

    windows: dict[str, int | None]
    split_keys: dict[str, int]  # the default; a step's rows' own differ (decode_split_keys)
    max_splits: dict[str, int]
    configs: dict[str, AttnConfig]


def _words(count: int, itemsize: int) -> int:
    """int64 words that hold `count` items of `itemsize` bytes, rounded up to _ALIGN."""
    return -(-count * itemsize // (8 * _ALIGN)) * _ALIGN


class DecodeGraphs:
    """Captured decode forwards by (bucket, splits), their static inputs, and the padding
    rule. `step(batch, splits)` maps a decode-only ForwardBatch on the device to its logits
    (rows, vocab); it is called on views of the static buffers (capture and warm-up only),
    with `plans` a PlannedBatch whose attention plans and write slots were staged.
    """

    def __init__(self, step: Callable[[ForwardBatch, Splits], torch.Tensor], groups: list[str],
                 scratch_pages: dict[str, int], page_size: int, max_context: int,
                 device: torch.device, capture: Capturer | None = None,
                 buckets: tuple[int, ...] = BUCKETS, plans: DecodePlans | None = None) -> None:
        self.step = step
        self.groups = list(groups)
        self.scratch_pages = dict(scratch_pages)
        self.page_size = page_size
        self.max_context = max_context
        self.buckets = tuple(sorted(buckets))
        self.plans = plans
        self.width = -(-max_context // page_size)  # page-table columns
        rows, cols = self.buckets[-1], _FIXED + len(self.groups) * self.width
        self._cols = cols
        # A step's rows, then (with plans) its plan arrays from word bucket * cols on,
        # staged in (pinned) host memory and copied in one transfer.
        extra = 0 if plans is None else _ALIGN + sum(
            words for _, words in self._plan_sizes(rows, plans.max_splits))
        pin = device.type == "cuda"
        self._flat = torch.zeros(rows * cols + extra, dtype=torch.int64, pin_memory=pin)
        self._host = self._flat[:rows * cols].view(rows, cols)
        self._staged = self._host.numpy()
        self._dev_flat = torch.zeros(rows * cols + extra, dtype=torch.int64, device=device)
        self._dev = self._dev_flat[:rows * cols].view(rows, cols)
        self._layouts: dict[tuple[int, tuple], dict[str, tuple[int, int]]] = {}
        self._copied = torch.cuda.Event() if pin else None
        self._query_start = torch.arange(rows + 1, device=device)
        self._capture = capture or CudaGraphCapturer(device)
        self._graphs: dict[tuple[int, tuple], tuple[Replay, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets with at least one graph."""
        return tuple(sorted({bucket for bucket, _ in self._graphs}))

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def fits(self, batch: ForwardBatch) -> bool:
        """A decode-only host batch within the largest bucket and the static page tables."""
        return (batch.is_decode_only() and batch.num_rows <= self.buckets[-1]
                and all(batch.page_tables[g].shape[1] <= self.width for g in self.groups)
                and batch.max_seq_len() <= self.max_context)

    def capture(self, bucket: int, splits: Splits) -> None:
        """Capture the graph of `bucket` rows for `splits` unless it exists (a capture's
        warm-up runs write K/V to the scratch pages only)."""
        key = (bucket, tuple(sorted(splits.items())))
        if key not in self._graphs:
            log.info("capturing the decode graph for %d rows, key splits %s", bucket, splits)
            self._stage_padding(0, bucket)
            self._upload(bucket, splits)
            # a new batch object a run: the CPU path memoizes its plans by the batch's id
            self._graphs[key] = self._capture(
                lambda: self.step(self.static_batch(bucket, splits), splits))

    def run(self, batch: ForwardBatch, splits: Splits,
            input_ids: torch.Tensor | None = None,
            keys: dict[str, np.ndarray] | None = None) -> torch.Tensor:
        """Logits (rows, vocab) of a batch that `fits`, from its bucket's graph for `splits`
        (enough for its longest row, each row cut at its `keys` key positions a split;
        default the plans' split_keys), captured first if need be. `input_ids` (rows,) on the device
        replace the batch's token ids (a step launched from the sampled tokens of the one
        before it, before the host has read them)."""
        n = batch.num_rows
        bucket = bucket_for(n, self.buckets)
        assert bucket is not None  # the caller checked fits(batch)
        self.capture(bucket, splits)
        replay, out = self._graphs[(bucket, tuple(sorted(splits.items())))]
        self._stage(batch, bucket)
        self._upload(bucket, splits, keys)
        if input_ids is not None:
            self._dev[:n, 0].copy_(input_ids)
        replay()
        self.num_replays += 1
        return out[:n].clone()  # the next replay overwrites `out`

    def static_batch(self, bucket: int, splits: Splits | None = None) -> ForwardBatch:
        """The first `bucket` rows of the static buffers as a ForwardBatch; with plans and
        `splits`, a PlannedBatch over the staged plans of that key."""
        dev = self._dev[:bucket]
        tables = {g: dev[:, _FIXED + i * self.width:_FIXED + (i + 1) * self.width]
                  for i, g in enumerate(self.groups)}
        batch = ForwardBatch(dev[:, 0], dev[:, 1], self._query_start[:bucket + 1], dev[:, 2],
                             tables, self._query_start[:bucket], _every_token=True)
        if self.plans is None or splits is None:
            return batch

        def view(name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
            at, words = self._layout(bucket, splits)[name]
            return self._dev_flat[at:at + words].view(dtype)[:count]

        pos32 = view("pos32", torch.int32, bucket)
        attn, slots = {}, {}
        for g in self.groups:
            n = splits[g]
            plan = AttnPlan(view(f"work:{g}", torch.int32, bucket * n * WORK_FIELDS).view(
                bucket * n, WORK_FIELDS), view(f"base:{g}", torch.int32, bucket),
                view(f"splits:{g}", torch.int32, bucket), bucket * n, bucket)
            table = view(f"table:{g}", torch.int32, bucket * self.width).view(bucket, self.width)
            attn[g] = GroupInputs(plan, table, pos32, self.plans.configs[g])
            slots[g] = view(f"slots:{g}", torch.int64, bucket)
        return PlannedBatch(batch.input_ids, batch.positions, batch.query_start,
                            batch.seq_lens, batch.page_tables, batch.logits_rows,
                            _write_slots=slots, attn=attn, _every_token=True)

    def _plan_sizes(self, bucket: int, splits: Splits) -> list[tuple[str, int]]:
        """(name, int64 words) of the plan arrays of `bucket` rows with `splits`."""
        sizes = [("pos32", _words(bucket, 4))]
        for g in self.groups:
            sizes += [(f"work:{g}", _words(bucket * splits[g] * WORK_FIELDS, 4)),
                      (f"base:{g}", _words(bucket, 4)), (f"splits:{g}", _words(bucket, 4)),
                      (f"table:{g}", _words(bucket * self.width, 4)),
                      (f"slots:{g}", _words(bucket, 8))]
        return sizes

    def _layout(self, bucket: int, splits: Splits) -> dict[str, tuple[int, int]]:
        """name -> (first word, words) in the flat buffers, from word bucket * cols on."""
        key = (bucket, tuple(sorted(splits.items())))
        layout = self._layouts.get(key)
        if layout is None:
            assert self.plans is not None and all(
                splits[g] <= self.plans.max_splits[g] for g in self.groups), splits
            layout, at = {}, -(-bucket * self._cols // _ALIGN) * _ALIGN
            for name, words in self._plan_sizes(bucket, splits):
                layout[name] = (at, words)
                at += words
            self._layouts[key] = layout
        return layout

    def _stage_plans(self, bucket: int, splits: Splits, keys: dict[str, np.ndarray] | None) -> int:
        """Plans and write slots of the staged rows 0..bucket-1 into the staging buffer
        (decode_items_host, splits of `keys` or the plans' split_keys; the slots as
        ForwardBatch.write_slots computes them). -> the end of the staged words."""
        assert self.plans is not None
        layout, flat, rows = self._layout(bucket, splits), self._flat.numpy(), self._staged
        pos, lens, ps = rows[:bucket, 1], rows[:bucket, 2], self.page_size

        def put(name: str, values: np.ndarray) -> None:
            at, words = layout[name]
            flat[at:at + words].view(values.dtype)[:values.size] = values.reshape(-1)

        put("pos32", pos.astype(np.int32))
        for i, g in enumerate(self.groups):
            n = splits[g]
            table = rows[:bucket, _FIXED + i * self.width:_FIXED + (i + 1) * self.width]
            put(f"work:{g}", decode_items_host(lens, self.plans.windows[g],
                                               self._keys_of(g, keys, bucket), n))
            put(f"base:{g}", np.arange(bucket, dtype=np.int32) * n)
            put(f"splits:{g}", np.full(bucket, n, dtype=np.int32))
            put(f"table:{g}", table.astype(np.int32))
            pages = table[np.arange(bucket), pos // ps]
            put(f"slots:{g}", pages * ps + pos % ps)
        return max(at + words for at, words in layout.values())

    def _keys_of(self, group: str, keys: dict[str, np.ndarray] | None,
                 bucket: int) -> int | np.ndarray:
        """Key positions a split of the staged rows 0..bucket-1: `keys[group]`, one for each
        real row (the padding rows, one key each, take the plans' split_keys), or the
        plans' split_keys for all."""
        default = self.plans.split_keys[group]
        if keys is None:
            return default
        row_keys = np.asarray(keys[group], dtype=np.int64)
        return np.concatenate([row_keys, np.full(bucket - len(row_keys), default)])

    def _stage(self, batch: ForwardBatch, bucket: int) -> None:
        n, staged = batch.num_rows, self._staged
        if self._copied is not None:
            self._copied.synchronize()  # the previous upload has left the staging rows
        staged[:n, 0] = batch.input_ids.numpy()
        staged[:n, 1] = batch.positions.numpy()
        staged[:n, 2] = batch.seq_lens.numpy()
        for i, g in enumerate(self.groups):
            table = batch.page_tables[g].numpy()
            lo = _FIXED + i * self.width
            staged[:n, lo:lo + table.shape[1]] = table
            staged[:n, lo + table.shape[1]:lo + self.width] = -1
        self._stage_padding(n, bucket)

    def _stage_padding(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1: token 0 at position 0 (seq_len 1) in the scratch page."""
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._staged[lo:hi]
        rows[:, :_FIXED] = (0, 0, 1)
        rows[:, _FIXED:] = -1
        for i, g in enumerate(self.groups):
            rows[:, _FIXED + i * self.width] = self.scratch_pages[g]

    def _upload(self, bucket: int, splits: Splits,
                keys: dict[str, np.ndarray] | None = None) -> None:
        """The staged rows (and with plans, theirs) to the device in one copy."""
        end = bucket * self._cols
        if self.plans is not None:
            end = self._stage_plans(bucket, splits, keys)
        self._dev_flat[:end].copy_(self._flat[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
