"""ModelRunner: ForwardBatch -> one forward over the weights -> logits of the requested rows.

On a GPU with the Triton kernels (engine/kernel_select.py) every step gets its attention
plans here, before the model runs: decode-only steps on the device, other steps on the
host from the batch's CPU tensors. With `cuda_graphs` both replay captured graphs where a
bucket holds them (decode steps: engine/graphs.py; steps with prefill:
engine/mixed_graphs.py). The CPU path runs the model on the batch as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.errors import OutOfKVPages
from engine.graphs import (
    Capturer,
    CudaGraphCapturer,
    DecodeGraphs,
    DecodePlans,
    bucket_for,
    buckets_up_to,
)
from engine.kernel_select import use_triton
from engine.kv.cache import KVCache
from engine.kv.pool import RECURRENT, KVPool, SeqPages
from engine.layers.attention import (
    AttnLayer,
    PlannedBatch,
    attn_config,
    group_layers,
    plan_batch,
    plan_decode,
)
from engine.layers.ggml_linear import blocks_only
from engine.mixed_graphs import MixedGraphs, capture_at_setting, capture_when_setting
from engine.models.common import DecoderModel
from kernels.paged_attention_plan import PROGRAMS_PER_SM, decode_split_keys
from kernels.triton_util import next_pow2, pdl_enabled, pdl_launches
from kernels.triton_util import num_sms as device_sms

__all__ = ["ForwardBatch", "ModelRunner"]

log = logging.getLogger(__name__)

# ModelRunner.warm_up's steps: (decode rows, prefill tokens fewer than the chunk, whether the
# chunk continues after one chunk of context). Rows 1, 2, 16, 17 and tokens a multiple of
# 16 or not, each beside the other's classes.
WARM_UP_SHAPES = ((0, 0, 0), (0, 15, 1), (1, 15, 0), (1, 1, 1), (15, 15, 0), (15, 14, 1),
                  (16, 15, 0))
# Then mixed steps of the mixed graphs' sizes (65-128 and 129-256 rows: the matrix
# kernels' other tile and split classes) and with decode rows whose keys split (attention's
# partials and their merge, as every row past a split's keys and every mixed graph's
# decode rows take): (decode rows, prefill tokens, the decode rows' context; 0: one token
# past two key splits, or the longest context if shorter). engine_bench's build log lists
# what a run still built while serving.
WARM_UP_MIXED = ((15, 64, 2), (16, 160, 2), (16, 16, 0), (1, 15, 0))


def prefill_cut_enabled() -> bool:
    """Whether long chunks' few query blocks are cut into key splits (plan_attention's
    `fill`): MBUFO_PREFILL_CUT=0 turns it off (for A/B runs), unset or 1 leaves it on."""
    raw = os.environ.get("MBUFO_PREFILL_CUT", "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"MBUFO_PREFILL_CUT must be 0 or 1, got {raw!r}")
    return raw != "0"


class ModelRunner:
    """`max_context`: the most tokens a sequence may hold (it sizes decode plans and the
    graphs' page tables); default, the largest group's pages. `capture` replaces CUDA
    graph capture (tests use a fake to run the graph path on the CPU). `num_sms`: the
    multiprocessors decode steps' key splits fill (decode_split_keys; default the GPU's,
    0 on the CPU path). `max_rows`: the most decode rows a step may have (the configured
    sessions): the decode graphs' buckets reach it (graphs.buckets_up_to; default
    graphs.BUCKETS)."""

    def __init__(self, model: DecoderModel, num_pages: int | dict[str, int],
                 page_size: int = 16, kv_quant: str = "f16", *, cuda_graphs: bool = False,
                 max_context: int | None = None, capture: Capturer | None = None,
                 num_sms: int | None = None, max_rows: int | None = None) -> None:
        self.model = model
        device = torch.device(model.device)
        groups = {spec.group for spec in model.kv_layers() if spec is not None}
        pages = {g: num_pages[g] if isinstance(num_pages, dict) else num_pages for g in groups}
        self.pool = KVPool(pages, page_size, model.windows())
        self.triton = use_triton(device)
        graphs = cuda_graphs and (capture is not None or device.type == "cuda" and self.triton)
        if cuda_graphs and not graphs:
            log.info("CUDA graphs off: they need a GPU and the Triton kernels (%s)", device)
        # With graphs, page `pages[g]` of each group is the padding rows' scratch page:
        # the pool never hands it out.
        kv_pages = {g: n + 1 for g, n in pages.items()} if graphs else pages
        self.kv = KVCache(model.kv_layers(), kv_pages, page_size, kv_quant, device)
        self.max_context = max_context or max(pages.values(), default=1) * page_size
        self._layers = group_layers((blk.attn for blk in model.blocks), self.kv)
        # Key positions per split of a one-token row, by its own length (decode_split_keys:
        # fewer than the decode config's where one row would not fill the device's
        # multiprocessors; never by the other rows, so a row's bits are the same alone or
        # among others), and the splits a step's rows take when its longest holds n
        # tokens (the most any row of up to n tokens takes: a running maximum), both by
        # length up to max_context, computed once.
        self._split_keys = {g: attn_config(layer, device, decode=True).split_keys
                            for g, layer in self._layers.items()}
        self.num_sms = num_sms if num_sms is not None else (
            device_sms(device) if self.triton else 0)
        self._keys_by_len, self._splits_by_len = {}, {}
        for g, layer in self._layers.items():
            self._keys_by_len[g], self._splits_by_len[g] = self._split_tables(g, layer)
        self._max_splits = {g: int(t[-1]) for g, t in self._splits_by_len.items()}
        # Work items a step's attention runs at once (its programs over the KV heads): a
        # long prefill chunk's few items are cut to reach them (plan_attention's `fill`)
        self._fill = {g: PROGRAMS_PER_SM * self.num_sms // layer.num_kv_heads
                      if prefill_cut_enabled() else 0 for g, layer in self._layers.items()}
        self._splits_cache: dict[tuple, dict[str, int]] = {}
        # The graphs' step functions hold the model, not the runner: a dropped runner (an
        # unloaded model) frees its graphs at once, never in a collection during a capture.
        self._step = ModelStep(model, self.kv, self._layers, page_size)
        capturer = (capture or CudaGraphCapturer(device)) if graphs else None
        plans = DecodePlans({g: layer.window for g, layer in self._layers.items()},
                            self._split_keys, self._max_splits,
                            {g: attn_config(layer, device, decode=True)
                             for g, layer in self._layers.items()})
        self.graphs = DecodeGraphs(self._step.decode, sorted(pages), pages, page_size,
                                   self.max_context, device, capturer,
                                   buckets=buckets_up_to(max_rows or 1),
                                   plans=plans) if graphs else None
        # Mixed steps (prefill chunks beside decode rows) replay graphs too on the Triton
        # path, unless a recurrent state would advance in their capture's warm-up runs.
        self.mixed = None
        capture_at = capture_at_setting()
        if graphs and self.triton and RECURRENT not in self.pool.groups and capture_at:
            self.mixed = MixedGraphs(
                self._step.planned, self._layers,
                {g: attn_config(layer, device) for g, layer in self._layers.items()},
                pages, page_size, self.max_context, self.graphs.buckets[-1], device, capturer,
                capture_at=capture_at, fill=self._fill, when=capture_when_setting())

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (len(batch.logits_rows), vocab) float32. `last_replayed` says whether this
        step replayed a captured graph (its cost has another shape than an eager step's),
        `last_captured` whether it captured that graph first (a stall: the step's launches
        recorded and instantiated on the way)."""
        held = self.num_graphs
        logits = self._replay(batch)
        self.last_replayed = logits is not None
        self.last_captured = self.num_graphs > held
        return logits if logits is not None else self.forward_eager(batch)

    @property
    def num_graphs(self) -> int:
        """Decode and mixed-step graphs held."""
        return (0 if self.graphs is None else self.graphs.num_graphs) + \
            (0 if self.mixed is None else self.mixed.num_graphs)

    @property
    def num_pending_graphs(self) -> int:
        """Mixed-step graphs due, waiting for `idle`."""
        return 0 if self.mixed is None else self.mixed.num_pending

    @property
    def can_look_ahead(self) -> bool:
        """Whether `forward_ahead` can run: decode graphs, and no recurrent state (a step
        run ahead and then discarded would have advanced it)."""
        return self.graphs is not None and RECURRENT not in self.pool.groups

    @torch.inference_mode()
    def forward_ahead(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Launch a decode-only step whose token ids are still on the device (`input_ids`,
        the step before's samples) by replaying its graph: -> its logits, not yet
        computed, or None when no graph takes it (the caller then runs the step later)."""
        return self._replay(batch, input_ids) if self.can_look_ahead else None

    def _replay(self, batch: ForwardBatch,
                input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The batch's logits from its decode or mixed-step graph (captured first if need
        be), or None when no graph takes it."""
        if input_ids is None and self.mixed is not None and self.mixed.fits(batch):
            return self._replay_mixed(batch)
        if self.graphs is None or not self.graphs.fits(batch):
            return None
        splits, keys = self._decode_splits(batch)
        if not self._captured(bucket_for(batch.num_rows, self.graphs.buckets), splits):
            return None
        return self.graphs.run(batch, splits, input_ids, keys)

    def _replay_mixed(self, batch: ForwardBatch) -> torch.Tensor | None:
        """A mixed step's logits from its graph; a failed capture turns mixed-step graphs
        off (those steps then run eagerly) instead of failing the step."""
        assert self.mixed is not None
        lens = batch.seq_lens.numpy()[np.diff(batch.query_start.numpy()) == 1]
        # one-token rows are cut as in a decode step (plan_attention's decode_keys)
        splits = self._splits_for(int(lens.max()) if lens.size else 1)
        keys = self._row_keys(batch)
        return self._mixed_or_off(lambda mixed: mixed.run(batch, splits, keys))

    def _mixed_or_off(self, call: Callable[[MixedGraphs], Any]) -> Any:
        """call(self.mixed); a failed capture in it turns mixed-step graphs off (those steps
        then run eagerly) and gives None instead of failing its caller."""
        assert self.mixed is not None
        try:
            return call(self.mixed)
        except RuntimeError:
            log.exception("mixed-step graph capture failed: mixed steps run eagerly from now on")
            self.mixed = None
            return None

    @torch.inference_mode()
    def idle(self) -> bool:
        """Work for a moment with no request to serve: one mixed-step graph capture that
        was deferred to it (a failed capture turns mixed-step graphs off). -> whether any
        was done (the caller asks again while so, and no request waits)."""
        if self.mixed is None:
            return False
        return bool(self._mixed_or_off(lambda mixed: mixed.capture_pending()))

    @torch.inference_mode()
    def prepare_graphs(self, context: int = 1) -> int:
        """Capture every bucket's decode graphs for rows of up to `context` tokens now
        (each key split count such rows can need) rather than at first use: a capture
        stalls its step. -> graphs held."""
        if self.graphs is None:
            return 0
        for bucket in self.graphs.buckets:
            for splits in self._splits_up_to(min(context, self.max_context)):
                if not self._captured(bucket, splits):
                    return 0
        return 0 if self.graphs is None else self.graphs.num_graphs

    @torch.inference_mode()
    def warm_up(self, chunk: int = 48, context: int = 1) -> float:
        """Run once, before serving, the eager step shapes whose kernels are built at first
        use, then capture the decode graphs for rows of up to `context` tokens. Triton
        builds a kernel variant per class of each row or token count (1, a multiple of
        16, any other), and a build stalls its step for up to a second: a first request
        would wait for it, and the ITL policy would fit its cost model to the stall.
        Shapes: a prefill chunk (`chunk` rounded up to a multiple of 16, at least 32:
        qmatmul's tiled path, or 15 tokens less) from position 0 and continuing after
        `chunk` tokens, alone and beside 1, 15 and 16 decode rows, so that row and token
        counts each take every class; then WARM_UP_MIXED; where launches can be
        programmatic dependent ones, those of them that a mixed graph holds again as such
        (its captures launch them so; eager steps do not). A hybrid model runs them all on
        its blocks first, then as it serves them. K/V go to pages taken from the pool and
        given back.
        -> the seconds it took (0.0 on the CPU path, which builds nothing)."""
        if not self.triton:
            return 0.0
        start = time.perf_counter()
        device = torch.device(self.model.device)
        whole = max(32, -(-chunk // 16) * 16)
        split = max((attn_config(layer, device).split_keys for layer in self._layers.values()),
                    default=0)
        long = min(self.max_context, 2 * split + 1)
        shapes = [(rows, whole - fewer, whole * after, 2)
                  for rows, fewer, after in WARM_UP_SHAPES]
        shapes += [(rows, tokens, 0, ctx or long) for rows, tokens, ctx in WARM_UP_MIXED]
        # a model with dense copies (the hybrid layout) runs the shapes on its blocks first,
        # as the q8 layout's would (the kernels of every row class below its threshold,
        # which its large shapes would not build), then as it serves them
        passes = [blocks_only, contextlib.nullcontext] if self._has_dense() else \
            [contextlib.nullcontext]
        for blocks in passes:
            with blocks():
                for rows, tokens, at, ctx in shapes:
                    self._warm_step(rows, tokens, at, ctx)
                if pdl_enabled(device) and self.mixed is not None:
                    # again as the mixed graphs' captures launch (their PDL variants): the
                    # shapes a mixed graph holds (eager steps launch without PDL)
                    with pdl_launches():
                        for rows, tokens, at, ctx in shapes:
                            if self.mixed.holds(rows + 1, rows + tokens):
                                self._warm_step(rows, tokens, at, ctx)
        self.prepare_graphs(context)
        if device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - start

    def _has_dense(self) -> bool:
        """Whether a linear of the model keeps a dense copy beside its blocks (hybrid)."""
        return self.model.dense_rows is not None

    def _warm_step(self, rows: int, tokens: int, at: int, context: int) -> None:
        """One eager step: `tokens` prefill tokens from position `at` beside `rows` decode
        rows of `context` tokens, on pages taken from the pool and given back."""
        seqs = [SeqPages(self.pool) for _ in range(rows + 1)]
        try:
            for s in seqs[1:]:
                s.ensure(context)
            seqs[0].ensure(at + tokens)
            spans = [([0] * tokens, at)] + [([0], context - 1)] * rows
            tables = {g: [s.table(g) for s in seqs] for g in self.pool.groups}
            self.forward_eager(ForwardBatch.build(spans, tables))
        except OutOfKVPages:  # a small pool: this shape builds at first use
            log.warning("warm-up skipped %d decode rows of %d tokens beside %d prefill "
                        "tokens: too few KV pages", rows, context, tokens)
        finally:
            for s in seqs:
                s.free()

    def _splits_up_to(self, context: int) -> list[dict[str, int]]:
        """Every distinct splits dict of decode steps whose longest row has at most
        `context` tokens (_splits_for changes only where a group's table does)."""
        n = min(max(1, context), self.max_context)
        lengths = {1}
        for t in self._splits_by_len.values():
            lengths.update((np.flatnonzero(np.diff(t[1:n + 1])) + 2).tolist())
        out: list[dict[str, int]] = []
        for length in sorted(lengths):
            splits = self._splits_for(length)
            if splits not in out:
                out.append(splits)
        return out

    def _captured(self, bucket: int | None, splits: dict[str, int]) -> bool:
        """Whether a graph of `bucket` for `splits` is ready; a failed capture turns
        graphs off (decode steps then run eagerly) instead of failing the step."""
        assert self.graphs is not None and bucket is not None
        try:
            self.graphs.capture(bucket, splits)
            return True
        except RuntimeError:
            log.exception("decode graph capture failed: decode steps run eagerly from now on")
            self.graphs = None
            return False

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """(len(batch.logits_rows), hidden) float32 after the output norm: what an embedding
        model pools (eager: no graph holds this output)."""
        on_device = batch.to(self.model.device)
        if self.triton:
            host = batch.to(torch.device("cpu"))
            on_device = plan_batch(host, on_device, self._layers, self.page_size, self._fill,
                                   self._row_keys(host))
        return self.model.forward(on_device, self.kv)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The same logits without graphs (graph replays are checked against this)."""
        on_device = batch.to(self.model.device)
        if not self.triton:
            return self.model.step_logits(on_device, self.kv)
        if batch.is_decode_only() and batch.max_seq_len() <= self.max_context:
            return self._step.decode(on_device, *self._decode_splits(batch))
        host = batch.to(torch.device("cpu"))
        planned = plan_batch(host, on_device, self._layers, self.page_size, self._fill,
                             self._row_keys(host))
        return self.model.step_logits(planned, self.kv)

    def _decode_splits(self, batch: ForwardBatch) -> tuple[dict[str, int],
                                                          dict[str, np.ndarray]]:
        """A decode step's (key splits a row, key positions a split of each row) per group."""
        return self._splits_for(batch.max_seq_len()), self._row_keys(batch)

    def _row_keys(self, batch: ForwardBatch) -> dict[str, np.ndarray]:
        """Key positions a split of each row of a host batch as a one-token row of its
        length (decode_split_keys, by group)."""
        lens = np.clip(batch.seq_lens.numpy(), 1, self.max_context)
        return {g: t[lens] for g, t in self._keys_by_len.items()}

    def _split_tables(self, group: str, layer: AttnLayer) -> tuple[np.ndarray, np.ndarray]:
        """(key positions a split, splits a step's rows take) by length 0..max_context for
        `group`: decode_split_keys of a row's visible keys, and the running maximum of
        the splits of a row of each length (a step's count by its longest row)."""
        lens = np.arange(self.max_context + 1, dtype=np.int64)
        lens[0] = 1
        window = layer.window
        keys = decode_split_keys(np.minimum(lens, window) if window else lens,
                                 layer.num_kv_heads, self.num_sms, self._split_keys[group])
        lo = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
        splits = np.maximum.accumulate((lens - 1) // keys - lo // keys + 1)
        return keys.astype(np.int64), splits

    def _splits_for(self, longest: int) -> dict[str, int]:
        """Key splits per decode row when the longest row holds `longest` tokens: the most
        a row of up to `longest` tokens takes, rounded up to a power of two (few distinct
        graphs), at most what `max_context` needs. (Do not modify the dict: it is
        cached.)"""
        n = min(max(1, longest), self.max_context)
        want = tuple(min(next_pow2(int(t[n])), self._max_splits[g])
                     for g, t in self._splits_by_len.items())
        splits = self._splits_cache.get(want)
        if splits is None:
            splits = self._splits_cache[want] = dict(zip(self._splits_by_len, want,
                                                        strict=True))
        return splits


class ModelStep:
    """The model's forward over its KV cache -> logits: what the runner's graphs capture.
    It holds the model, not the runner (no reference cycle), and pickles with it."""

    def __init__(self, model: DecoderModel, kv: KVCache, layers: dict[str, AttnLayer],
                 page_size: int) -> None:
        self.model, self.kv, self.layers, self.page_size = model, kv, layers, page_size

    def planned(self, planned: PlannedBatch) -> torch.Tensor:
        """A planned batch on the device -> the logits of its logits rows."""
        return self.model.step_logits(planned, self.kv)

    def decode(self, batch: ForwardBatch, splits: dict[str, int],
               keys: dict[str, int] | None = None) -> torch.Tensor:
        """A decode-only batch on the device, its key splits and their key positions ->
        logits (plans made on the device: no host synchronisation; a PlannedBatch, the
        decode graphs' staged plans, runs as it is)."""
        if isinstance(batch, PlannedBatch) and batch.attn:
            return self.planned(batch)
        return self.planned(plan_decode(batch, self.layers, self.page_size, splits, keys))
