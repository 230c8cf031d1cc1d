"""The GPU weight layout of `--weights auto`, chosen at load from measured cost.

On a GPU a linear weight either stays in its GGML blocks (`ggml`: kernels/qmatmul.py reads
the file's bytes) or is dequantized at load to bf16 (`bf16`: torch matmuls, 2 bytes per
weight). Which decodes faster depends on the device: where bandwidth is plentiful and the
quantized kernels fall short of it (the H200: bench/RESULTS.md) the bf16 copies win; on a
bandwidth-poor APU (the appliance's ~212 GB/s) a quarter of the bytes wins. So `auto`
times both on the model's own linear shapes, at 1 and at 16 rows and at the configured
sessions' full batch (one stream; a full box), each weight read from memory as decode
reads it (copies beyond the L2, replayed in a CUDA graph), weighs each shape by how many
linears have it, and takes the layout fastest at one row plus the full batch whose weights
and KV cache fit the device's free memory. Within 5% the blocks win: fewer bytes leave
more room for sessions. A MoE model (qwen3moe) is never given bf16: its experts, most of
its bytes, are not among the timed linears and keep their blocks in every layout but
an explicit `bf16`.

The blocks come two ways: `ggml` (bf16 operands, the exact codes) and `q8` (the same
blocks, Q4_K and Q6_K multiplied with 8-bit activations: kernels/qint.py). q8 is timed on the
shapes where it differs (its other types run ggml's kernels) and taken only when more than
5% faster than ggml: on a near tie the activations stay unquantized.

`hybrid` keeps q8's blocks and a bf16 copy of every linear, each call taking the copy from
a row count on (engine/layers/ggml_linear.py): `choose_dense_rows` times both on the model's
shapes at HYBRID_ROWS and takes the smallest row count from which the copies are more than
5% faster at every larger count timed, when blocks and copies fit the free memory (else
q8 alone). It is asked for explicitly (`weights="hybrid"`): across its threshold a row's
bits depend on its batch, which the block layouts never let happen.

Cost: one build of each qmatmul kernel (which the first forward would do anyway) and about
two dozen graph replays, a second or two at load; the result is logged and printed by
`mbufo inspect MODEL --device cuda`.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.gguf import ModelFile
from engine.graphs import no_collection
from engine.layers.ggml_linear import ACT8_TYPES
from engine.models.config import ModelConfig
from engine.planner import linear_tensors, plan

log = logging.getLogger(__name__)

ROWS = (1, 16)  # always timed (and reported); a session count between adds its own
# the hybrid layout's candidate thresholds: decode buckets, then prefill chunks' sizes
HYBRID_ROWS = (4, 8, 16, 32, 64, 128, 512)
TIE_MARGIN = 0.05  # ggml wins unless bf16 is more than 5% faster
MEMORY_FRACTION = 0.9  # of the device's free memory at load
L2_MISS_BYTES = 256 << 20  # weight bytes per timing: beyond any GPU's L2

# (layout, ggml_type, out, in, rows) -> seconds per product
Measure = Callable[[str, int, int, int, int], float]


@dataclass(frozen=True)
class LinearShape:
    ggml_type: int
    out_features: int
    in_features: int
    count: int


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # "ggml", "q8", "bf16" or "hybrid"
    reason: str
    # layout -> rows -> ms of every linear of one forward (the measured shapes, weighted)
    forward_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    total_bytes: dict[str, int] = field(default_factory=dict)  # weights + KV, per layout
    budget_bytes: int | None = None
    dense_rows: int | None = None  # hybrid: calls of this many rows or more take the copies

    def as_dict(self) -> dict:
        return {"layout": self.layout, "reason": self.reason, "dense_rows": self.dense_rows,
                "forward_ms": {k: {str(m): round(v, 4) for m, v in d.items()}
                               for k, d in self.forward_ms.items()},
                "total_bytes": dict(self.total_bytes), "budget_bytes": self.budget_bytes}


def linear_shapes(mf: ModelFile) -> list[LinearShape]:
    """planner.linear_tensors counted by (type, out, in)."""
    counts = Counter((int(info.ggml_type), int(info.shape[0]), int(info.shape[1]))
                     for info in linear_tensors(mf))
    return [LinearShape(t, n, k, c) for (t, n, k), c in sorted(counts.items())]


def tune_rows(sessions: int) -> tuple[int, ...]:
    """The row counts timed: ROWS and the batch of `sessions` decoders (at most the last
    of ROWS)."""
    return tuple(sorted({*ROWS, full_rows(sessions)}))


def full_rows(sessions: int) -> int:
    return max(1, min(sessions, ROWS[-1]))


def timings_text(cost: dict[str, dict[int, float]], rows: tuple[int, ...]) -> str:
    """The choice's reason: each layout's ms at each row count."""
    return (f"linears of one forward at {'/'.join(map(str, rows))} rows: "
            + ", ".join(f"{name} {'/'.join(f'{by_rows[m]:.2f}' for m in rows)} ms"
                        for name, by_rows in cost.items()))


def choose_layout(mf: ModelFile, cfg: ModelConfig, *, sessions: int, context: int,
                  kv_quant: str, budget_bytes: int | None, measure: Measure) -> LayoutChoice:
    """The layout for `mf` on the device `measure` times (see the module docstring);
    `budget_bytes` None: memory is not checked. A layout's score is its time at one row
    plus its time at the configured sessions' full batch (up to 16 rows): one stream's
    speed and a full box's weigh the same, so a box set up for few sessions is not
    judged by a 16-row batch it never runs."""
    plans = {layout: plan(mf, cfg, sessions=sessions, context=context, kv_quant=kv_quant,
                          backend=backend).total_bytes
             for layout, backend in (("ggml", "gpu"), ("bf16", "cpu"))}
    plans["q8"] = plans["ggml"]
    bf16_fits = budget_bytes is None or plans["bf16"] <= budget_bytes
    # A MoE model's experts (most of its bytes) are not among the timed linears: their
    # bf16 copies would read 3.5x a Q4_K file's bytes a token, so its weights keep blocks.
    moe = bool(cfg.num_experts)
    bf16_fits = bf16_fits and not moe
    shapes = linear_shapes(mf)
    timed: dict[tuple[str, LinearShape, int], float] = {}  # ms of all of a shape's linears
    # every layout and row count of one shape in a row: its weights are made once (ggml's
    # serve q8 where the bytes are the same)
    rows = tune_rows(sessions)
    for s in shapes:
        for layout in ("ggml", "q8") + (("bf16",) if bf16_fits else ()):
            for m in rows:
                if layout == "q8" and s.ggml_type not in ACT8_TYPES:  # ggml's kernels
                    timed[layout, s, m] = timed["ggml", s, m]
                else:
                    timed[layout, s, m] = 1e3 * s.count * measure(
                        layout, s.ggml_type, s.out_features, s.in_features, m)
    cost = {layout: {m: sum(timed[layout, s, m] for s in shapes) for m in rows}
            for layout in dict.fromkeys(lay for lay, _, _ in timed)}
    full = full_rows(sessions)
    score = {layout: by_rows[1] + by_rows[full] for layout, by_rows in cost.items()}
    blocks = "q8" if score["q8"] < (1 - TIE_MARGIN) * score["ggml"] else "ggml"
    layout = "bf16" if bf16_fits and score["bf16"] < (1 - TIE_MARGIN) * score[blocks] else blocks
    reason = (timings_text(cost, rows)
              + f"; scored at 1 + {full} rows ({sessions} sessions)")
    if moe:
        reason += "; a MoE model's experts keep their blocks (bf16 not timed)"
    elif not bf16_fits:
        reason += (f"; bf16 weights and KV ({plans['bf16'] >> 20} MiB) exceed the "
                   f"{budget_bytes >> 20} MiB free")
    log.info("weight layout %s (%s)", layout, reason)
    return LayoutChoice(layout, reason, cost, plans, budget_bytes)


def choose_dense_rows(mf: ModelFile, cfg: ModelConfig, *, sessions: int, context: int,
                      kv_quant: str, budget_bytes: int | None, measure: Measure,
                      rows: tuple[int, ...] = HYBRID_ROWS) -> LayoutChoice:
    """The hybrid layout's threshold on the device `measure` times (module docstring): the
    smallest of `rows` from which every linear of one forward, weighted by count, is more
    than TIE_MARGIN faster on the bf16 copies than on q8's blocks at each larger count too.
    layout "q8" (no copies) when none is or blocks and copies do not fit `budget_bytes`."""
    totals = {layout: plan(mf, cfg, sessions=sessions, context=context, kv_quant=kv_quant,
                           backend=backend).total_bytes
              for layout, backend in (("q8", "gpu"), ("hybrid", "hybrid"))}
    total = totals["hybrid"]
    if budget_bytes is not None and total > budget_bytes:
        return LayoutChoice("q8", f"blocks and bf16 copies ({total >> 20} MiB) exceed the "
                            f"{budget_bytes >> 20} MiB free", {}, totals, budget_bytes)
    shapes = linear_shapes(mf)
    cost: dict[str, dict[int, float]] = {"q8": {}, "bf16": {}}
    for s in shapes:  # a shape's weights are made once for all its row counts
        for layout in ("q8", "bf16"):
            timed_as = layout if layout == "bf16" or s.ggml_type in ACT8_TYPES else "ggml"
            for m in rows:
                cost[layout][m] = cost[layout].get(m, 0.0) + 1e3 * s.count * measure(
                    timed_as, s.ggml_type, s.out_features, s.in_features, m)
    wins = [cost["bf16"][m] < (1 - TIE_MARGIN) * cost["q8"][m] for m in rows]
    dense_rows = next((m for i, m in enumerate(rows) if all(wins[i:])), None)
    reason = timings_text(cost, rows)
    if dense_rows is None:
        reason += "; the bf16 copies never win from a row count on: q8 alone"
        layout = "q8"
    else:
        reason += f"; bf16 copies from {dense_rows} rows"
        layout = "hybrid"
    log.info("weight layout %s (%s)", layout, reason)
    return LayoutChoice(layout, reason, cost, totals, budget_bytes, dense_rows)


def gpu_measure(device: torch.device, *, replays: int = 5) -> Measure:
    """A Measure on `device`: random data of each shape (the time does not depend on the
    values), enough copies to miss the L2 (kept while the next calls time the same shape at
    other row counts), one CUDA graph of a product per copy."""
    from kernels.dequant import block_geometry
    from kernels.qint import ACT8_STORED, qint_triton, row_bytes
    from kernels.qmatmul import SUPPORTED_TYPES, qmatmul
    from kernels.qtiles import BF16, FLOAT_TYPES

    held: dict[tuple, list[torch.Tensor]] = {}  # the last shape's weight copies

    def measure(layout: str, ggml_type: int, n: int, k: int, m: int) -> float:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        if ggml_type in FLOAT_TYPES:  # the block layouts hold float matrices as BF16
            ggml_type = BF16
        blocks = layout in ("ggml", "q8") and ggml_type in SUPPORTED_TYPES
        if blocks:
            block, size = block_geometry(ggml_type)
            width = k // block * size
            if layout == "q8" and ggml_type in ACT8_TYPES:
                held_type = ACT8_STORED[ggml_type]
                width = row_bytes(held_type, k)
                call = lambda w: qint_triton(x, w, held_type, (n, k))  # noqa: E731
            else:
                call = lambda w: qmatmul(x, w, ggml_type, (n, k))  # noqa: E731
        else:  # dense (either layout for types without a kernel)
            call = lambda w: x @ w.t()  # noqa: E731
        key = (blocks, ggml_type if blocks else None, n, k, width if blocks else None)
        if key not in held:
            held.clear()
            if blocks:
                make = lambda: torch.randint(0, 256, (n, width),  # noqa: E731
                                             dtype=torch.uint8, device=device)
                nbytes = n * width
            else:
                make = lambda: torch.randn(n, k, device=device,  # noqa: E731
                                           dtype=torch.bfloat16)
                nbytes = 2 * n * k
            held[key] = [make() for _ in range(max(1, min(64, math.ceil(L2_MISS_BYTES
                                                                       / nbytes))))]
        weights = held[key]
        for w in weights:  # builds the kernels, off the capture
            call(w)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph):
            for w in weights:
                call(w)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / (replays * len(weights))

    return measure


def free_memory_budget(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * MEMORY_FRACTION)


def measure_layout(mf: ModelFile, cfg: ModelConfig, device: torch.device, *, sessions: int,
                   context: int, kv_quant: str, hybrid: bool = False) -> LayoutChoice:
    """choose_layout (with `hybrid`: choose_dense_rows) on `device` itself, within its free
    memory (the engine's load and `mbufo inspect --device`)."""
    choose = choose_dense_rows if hybrid else choose_layout
    return choose(mf, cfg, sessions=sessions, context=min(context, cfg.context_length),
                  kv_quant=kv_quant, budget_bytes=free_memory_budget(device),
                  measure=gpu_measure(device))
