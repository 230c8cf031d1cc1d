"""A MoE block's routing and its glue around the grouped products (kernels/moe.py), each
one launch of fixed shapes for the step's T tokens (a CUDA graph captures them):

- `route`: the router's logits (a program per token and 4 experts: a fixed-order dot; one
  token's 128 x 2048 float32 router is 1 MB, read by 32 programs),
  then per token the softmax, its k largest probabilities (descending, the lower expert
  first on a tie), divided by their sum (added in that order) where `normalize`, times
  `scale` where set: llama.cpp's build_moe_ffn for qwen3moe;
- `group_tiles`: the T k (token, expert) pairs sorted by expert, stable: each pair's sorted
  row, each sorted row's token, and the tiles of at most block_m rows of one expert
  (expert, first row, end row), at most min(E, T k) + ceil(T k / block_m) of them, the
  unused ones (-1, 0, 0); one program counts, ranks and cuts in pair order;
- `combine`: each token's k expert outputs times their weights, added in the router's
  order.

Each has its torch reference (`*_reference`), which the CPU path runs and the tests compare
against. Everything a token gets depends on its own row only (batch invariance).

What the engine launches (engine/layers/moe.py) is fewer: `route_group` runs route and
group_tiles as one launch of the router's grid (up to FUSED_MAX_TOKENS tokens), whose last
program of a token runs its top-k, whose last token of a block of tokens ranks the block's
pairs, and whose last block places every pair (arrival counters, `RouteCounters`); its
router programs also round h to bf16 for the products. Above FUSED_MAX_TOKENS the block
ranking is a launch of its own after route's two (a program a block). The combine runs
inside the next norm's launch (kernels/fused_norm.py takes the block's `Combined`). Every
kernel here waits for its inputs as a programmatic dependent launch
(kernels/triton_util.py) in decode graphs. The fused launches compute with the same
helpers, so their bits are those of the separate ones (MBUFO_MOE_FUSED_ROUTE=0 launches
those, the grouping one program, for timing both).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.errors import InvalidRequest
from kernels.triton_util import (
    HAS_TRITON,
    await_inputs,
    cast_out,
    helper,
    jit,
    kernels_run,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["Combined", "RouteCounters", "Routed", "check_combined", "combine",
           "combine_reference", "fused_routing", "group_tiles", "group_tiles_reference",
           "max_tiles", "route", "route_group", "route_reference"]

WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the picked weights' sum (f16's least)
_LOGIT_EXPERTS, _LOGIT_K = 4, 512  # a router program's experts and columns a step
# The grouping program's (pairs, experts) and (tile slots, experts) steps: 64 pairs and 32
# slots a step at 128 experts, fewer with more experts (the same registers a step)
_GROUP_CELLS, _SLOT_CELLS = 8192, 4096
_PLACE_PAIRS = 1024  # route_group's last program places this many pairs a step
# route_group's grouping steps: smaller than the grouping launch's, since its registers are
# those of every program of the router's grid (the integer results are the same)
_FUSED_CELLS, _FUSED_SLOT_CELLS = 2048, 2048
# route_group's one launch up to this many tokens (decode steps); above it (prefill chunks)
# route's two launches, whose router programs hold fewer registers, and the block grouping
FUSED_MAX_TOKENS = 128
_COMBINE_BLOCK = 1024


# ---------------------------------------------------------------- routing


def route_reference(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                    scale: float | None, bias: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """h (T, d), router (E, d), bias (E,) or None -> (weights (T, k) float32 (float64 for
    float64 h), experts (T, k) int64)."""
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = h.to(dtype) @ router.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1, sorted=True)
    if normalize:
        total = weights[:, 0].clone()
        for j in range(1, k):
            total += weights[:, j]
        weights = weights / total.clamp(min=WEIGHT_SUM_FLOOR)[:, None]
    if scale is not None:
        weights = weights * scale
    return weights, experts


if HAS_TRITON:

    @helper
    def _logits_part(x_ptr, w_ptr, b_ptr, out_ptr, xb_ptr, t, part, d, E, stride_x,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_XB: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
        """out[t, e] = router[e] . x[t] (+ bias[e] with HAS_BIAS) for the BLOCK_E experts of
        `part`, BLOCK_K columns a step in column order, float32; with WRITE_XB part 0 also
        writes x[t] rounded to bf16 (the grouped products' x) as it reads it."""
        e = part * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < E
        acc = tl.zeros((BLOCK_E,), tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < d
            x = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0)
            if WRITE_XB:
                tl.store(xb_ptr + t * d + k, cast_out(x, xb_ptr), mask=k_ok & (part == 0))
            w = tl.load(w_ptr + e[:, None].to(tl.int64) * d + k[None, :],
                        mask=e_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e, mask=e_ok, other=0.0)
        tl.store(out_ptr + t * E + e, acc, mask=e_ok)

    @jit(do_not_specialize=["d"])
    def _router_logits_kernel(x_ptr, w_ptr, b_ptr, out_ptr, xb_ptr, d, E, stride_x,
                              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                              WRITE_XB: tl.constexpr = False, PDL: tl.constexpr = False,
                              HAS_BIAS: tl.constexpr = False):
        """_logits_part for token program_id(0), experts part program_id(1)."""
        t = tl.program_id(0).to(tl.int64)
        await_inputs(PDL)
        _logits_part(x_ptr, w_ptr, b_ptr, out_ptr, xb_ptr, t, tl.program_id(1), d, E,
                     stride_x, BLOCK_E, BLOCK_K, WRITE_XB, HAS_BIAS)

    @helper
    def _topk_row(logits_ptr, weights_ptr, experts_ptr, t, E, scale, K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_KP: tl.constexpr, NORMALIZE: tl.constexpr,
                  SCALE: tl.constexpr, FRESH: tl.constexpr):
        """Token t's softmax over its E logits, its K largest (descending, the lower expert
        on a tie), normalized and scaled. FRESH: the logits were written by other programs
        of this launch (volatile loads: nothing stale from a cache)."""
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf"),
                         volatile=FRESH)
        z = tl.exp(logits - tl.max(logits, axis=0))
        probs = tl.where(e < E, z / tl.sum(z, axis=0), -1.0)
        # a graph's padding token may hold any bits (NaN, inf): its picks stay in range
        probs = tl.where(probs == probs, probs, 0.0)
        j = tl.arange(0, BLOCK_KP)
        picked = tl.zeros((BLOCK_KP,), tl.float32)
        ids = tl.zeros((BLOCK_KP,), tl.int32)
        total = 0.0
        for i in tl.static_range(K):
            best = tl.max(probs, axis=0)
            first = tl.minimum(tl.min(tl.where(probs == best, e, BLOCK_E), axis=0), E - 1)
            picked = tl.where(j == i, best, picked)
            ids = tl.where(j == i, first, ids)
            total += best
            probs = tl.where(e == first, -1.0, probs)
        if NORMALIZE:
            picked = picked / tl.maximum(total, 6.103515625e-5)
        if SCALE:
            picked = picked * scale
        tl.store(weights_ptr + t * K + j, picked, mask=j < K)
        tl.store(experts_ptr + t * K + j, ids, mask=j < K)

    @jit
    def _topk_kernel(logits_ptr, weights_ptr, experts_ptr, E, scale, K: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_KP: tl.constexpr, NORMALIZE: tl.constexpr,
                     SCALE: tl.constexpr, PDL: tl.constexpr = False):
        """_topk_row for token program_id(0)."""
        t = tl.program_id(0).to(tl.int64)
        await_inputs(PDL)
        _topk_row(logits_ptr, weights_ptr, experts_ptr, t, E, scale, K, BLOCK_E, BLOCK_KP,
                  NORMALIZE, SCALE, False)


def _check_route(h: torch.Tensor, router: torch.Tensor, k: int,
                 bias: torch.Tensor | None = None) -> None:
    if h.dim() != 2 or router.dim() != 2 or h.shape[1] != router.shape[1] or \
            h.dtype != torch.float32 or router.dtype != torch.float32 or h.stride(1) != 1 \
            or not router.is_contiguous() or not 0 < k <= router.shape[0] or (
                bias is not None and (bias.dtype != torch.float32 or
                                      tuple(bias.shape) != (router.shape[0],))):
        raise InvalidRequest(f"route: h (T, d) and router (E, d) float32, a bias (E,) "
                             f"float32 or none, and 0 < k <= E; got {h.dtype} "
                             f"{tuple(h.shape)}, {router.dtype} {tuple(router.shape)}, bias "
                             f"{None if bias is None else tuple(bias.shape)}, k={k}")


def _topk_args(e: int, k: int, normalize: bool, scale: float | None) -> dict:
    """The top-k's constexprs (one set for _topk_kernel and _route_group_kernel: the same
    bits either way)."""
    return {"K": k, "BLOCK_E": next_pow2(e), "BLOCK_KP": next_pow2(k),
            "NORMALIZE": normalize, "SCALE": scale is not None}


def route(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
          scale: float | None, bias: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_reference's routing -> (weights (T, k) float32, experts (T, k) int32 on the
    kernels, int64 on the reference); two launches where the kernels run."""
    if not kernels_run(h.device):
        return route_reference(h, router, k, normalize, scale, bias)
    _check_route(h, router, k, bias)
    return _route_launches(h, router, k, normalize, scale, None, bias)


def _route_launches(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                    scale: float | None, xb: torch.Tensor | None,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """route's two launches; the router's also writes h rounded to bf16 into `xb`."""
    (t, d), e = h.shape, router.shape[0]
    logits = torch.empty(t, e, dtype=torch.float32, device=h.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=h.device)
    experts = torch.empty(t, k, dtype=torch.int32, device=h.device)
    if t:
        launcher(_router_logits_kernel, h.device)[(t, -(-e // _LOGIT_EXPERTS))](
            h, router, router if bias is None else bias, logits, h if xb is None else xb, d, e,
            h.stride(0), BLOCK_E=_LOGIT_EXPERTS, BLOCK_K=_LOGIT_K, WRITE_XB=xb is not None,
            HAS_BIAS=bias is not None, num_warps=4)
        launcher(_topk_kernel, h.device)[(t,)](
            logits, weights, experts, e, 1.0 if scale is None else float(scale),
            **_topk_args(e, k, normalize, scale), num_warps=4)
    return weights, experts


# ---------------------------------------------------------------- grouping


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles `pairs` pairs can take: each expert with rows takes
    ceil(rows / block_m), at most min(E, pairs) + ceil(pairs / block_m) in all."""
    return min(num_experts, pairs) + -(-pairs // block_m)


def group_tiles_reference(experts: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts (T, k) -> (rows (T k,) int32: each flat pair's sorted row; tokens (T k,)
    int32: each sorted row's token; tiles (max_tiles, 3) int32)."""
    t, k = experts.shape
    flat = experts.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=flat.device)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts].tolist()
    tiles = []
    first = 0
    for e, n in enumerate(counts):
        tiles += [(e, r, min(r + block_m, first + n)) for r in range(first, first + n, block_m)]
        first += n
    tiles += [(-1, 0, 0)] * (max_tiles(t * k, num_experts, block_m) - len(tiles))
    return (rows.to(torch.int32), (order // k).to(torch.int32),
            torch.tensor(tiles, dtype=torch.int32, device=flat.device).reshape(-1, 3))


if HAS_TRITON:

    @helper
    def _expert_of(experts_ptr, p, P, E, BLOCK_E: tl.constexpr, FRESH: tl.constexpr):
        """Pair p's expert, clamped into [0, E) (every pair gets a row whatever its id);
        BLOCK_E (no expert) past the P pairs. FRESH: written by other programs of this
        launch (volatile loads)."""
        ex = tl.load(experts_ptr + p, mask=p < P, other=0, volatile=FRESH)
        return tl.where(p < P, tl.minimum(tl.maximum(ex, 0), E - 1), BLOCK_E)

    @helper
    def _group_rows(experts_ptr, rows_ptr, tokens_ptr, P, k, E, BLOCK_P: tl.constexpr,
                    BLOCK_E: tl.constexpr, FRESH: tl.constexpr):
        """The experts' pair counts, each pair's stable sorted row (its expert's first row
        + the pairs of that expert before it) and each row's token -> (counts, each
        expert's first row)."""
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ex = _expert_of(experts_ptr, p, P, E, BLOCK_E, FRESH)
            counts += tl.sum((ex[:, None] == e[None, :]).to(tl.int32), axis=0)
        starts = tl.cumsum(counts, axis=0) - counts
        seen = tl.zeros((BLOCK_E,), tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ex = _expert_of(experts_ptr, p, P, E, BLOCK_E, FRESH)
            hot = (ex[:, None] == e[None, :]).to(tl.int32)  # (pairs, experts)
            before = tl.cumsum(hot, axis=0) - hot + (starts + seen)[None, :]
            row = tl.sum(hot * before, axis=1)
            tl.store(rows_ptr + p, row, mask=p < P)
            tl.store(tokens_ptr + row, p // k, mask=p < P)
            seen += tl.sum(hot, axis=0)
        return counts, starts

    @helper
    def _cut_tiles(counts, starts, tiles_ptr, E, block_m, slots, BLOCK_E: tl.constexpr,
                   BLOCK_T: tl.constexpr):
        """The tile table of `slots` rows: (expert, first row, end row) of at most block_m
        rows of one expert, in expert order, then (-1, 0, 0)."""
        e = tl.arange(0, BLOCK_E)
        per_expert = (counts + block_m - 1) // block_m
        tile_end = tl.cumsum(per_expert, axis=0)
        tile_start = tile_end - per_expert
        for s0 in range(0, slots, BLOCK_T):
            s = s0 + tl.arange(0, BLOCK_T)
            past = ((tile_end[None, :] <= s[:, None]) & (e[None, :] < E)).to(tl.int32)
            owner = tl.sum(past, axis=1)  # E: past every real tile
            mine = owner[:, None] == e[None, :]
            first = tl.sum(tl.where(mine, starts[None, :] + (s[:, None] - tile_start[None, :])
                                    * block_m, 0), axis=1)
            end = tl.minimum(first + block_m, tl.sum(tl.where(mine, (starts + counts)[None, :],
                                                              0), axis=1))
            real = owner < E
            base = tiles_ptr + s * 3
            ok = s < slots
            tl.store(base, tl.where(real, owner, -1), mask=ok)
            tl.store(base + 1, tl.where(real, first, 0), mask=ok)
            tl.store(base + 2, tl.where(real, end, 0), mask=ok)

    @jit(do_not_specialize=["P", "slots"])
    def _group_kernel(experts_ptr, rows_ptr, tokens_ptr, tiles_ptr, P, k, E, block_m, slots,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                      PDL: tl.constexpr = False):
        """One program: _group_rows, then _cut_tiles."""
        await_inputs(PDL)
        counts, starts = _group_rows(experts_ptr, rows_ptr, tokens_ptr, P, k, E, BLOCK_P,
                                     BLOCK_E, False)
        _cut_tiles(counts, starts, tiles_ptr, E, block_m, slots, BLOCK_E, BLOCK_T)


def _group_args(num_experts: int, cells: int = _GROUP_CELLS,
                slot_cells: int = _SLOT_CELLS) -> dict:
    """The grouping's constexprs (one set for _group_kernel and _route_group_kernel)."""
    width = next_pow2(num_experts)
    return {"BLOCK_P": max(8, cells // width), "BLOCK_E": width,
            "BLOCK_T": max(8, slot_cells // width)}


def group_tiles(experts: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """group_tiles_reference's (rows, tokens, tiles); one launch where the kernels run."""
    if not kernels_run(experts.device):
        return group_tiles_reference(experts, num_experts, block_m)
    t, k = experts.shape
    pairs = t * k
    flat = experts.reshape(-1).to(torch.int32)
    rows = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    tokens = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    slots = max_tiles(pairs, num_experts, block_m)
    tiles = torch.empty(slots, 3, dtype=torch.int32, device=flat.device)
    if pairs:
        launcher(_group_kernel, flat.device)[(1,)](
            flat, rows, tokens, tiles, pairs, k, num_experts, block_m, slots,
            **_group_args(num_experts), num_warps=4)
    return rows, tokens, tiles


# ---------------------------------------------------------------- combining


def combine_reference(y: torch.Tensor, rows: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """y (T k, d) in sorted rows -> (T, d): sum_j y[rows[t k + j]] * weights[t, j], in j
    order."""
    t, k = weights.shape
    per_pair = y[rows.long()].view(t, k, -1)
    out = per_pair[:, 0] * weights[:, 0, None]
    for j in range(1, k):
        out = out + per_pair[:, j] * weights[:, j, None]
    return out


class Combined(NamedTuple):
    """A MoE block's output before its combine: y (T k, d) float32 in sorted rows, each
    pair's row (T k,) int32 and the weights (T, k) float32. kernels/fused_norm.py's
    add_rms_norm takes it as its residual and combines in the same launch."""

    y: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor


if HAS_TRITON:

    @helper
    def combine_rows(y_ptr, rows_ptr, weights_ptr, t, stride_y, c, ok, K: tl.constexpr):
        """sum_j y[rows[t K + j], c] * weights[t, j] in j order, float32 (the one sum of
        combine and of add_rms_norm's Combined residual)."""
        row = tl.load(rows_ptr + t * K).to(tl.int64)
        acc = tl.load(y_ptr + row * stride_y + c, mask=ok, other=0.0) * tl.load(
            weights_ptr + t * K)
        for j in tl.static_range(1, K):
            row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            acc += tl.load(y_ptr + row * stride_y + c, mask=ok, other=0.0) * tl.load(
                weights_ptr + t * K + j)
        return acc

    @jit(do_not_specialize=["D"])
    def _combine_kernel(y_ptr, rows_ptr, weights_ptr, out_ptr, D, K: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < D
        await_inputs(PDL)
        acc = combine_rows(y_ptr, rows_ptr, weights_ptr, t, D, c, ok, K)
        tl.store(out_ptr + t * D + c, acc, mask=ok)


def check_combined(c: Combined, rows: int, dim: int) -> None:
    """A Combined of `rows` tokens and `dim` columns, as the kernels read it."""
    t, k = c.weights.shape if c.weights.dim() == 2 else (-1, 0)
    if t != rows or c.y.dtype != torch.float32 or c.y.dim() != 2 or \
            tuple(c.y.shape) != (t * k, dim) or not c.y.is_contiguous() or \
            c.rows.dtype != torch.int32 or tuple(c.rows.shape) != (t * k,) or \
            c.weights.dtype != torch.float32 or not c.weights.is_contiguous():
        raise InvalidRequest(f"combine: y (T k, {dim}) float32, rows (T k,) int32 and "
                             f"weights ({rows}, k) float32, contiguous; got "
                             f"{c.y.dtype} {tuple(c.y.shape)}, {c.rows.dtype} "
                             f"{tuple(c.rows.shape)}, {c.weights.dtype} "
                             f"{tuple(c.weights.shape)}")


def combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """combine_reference's sum; one launch where the kernels run."""
    if not kernels_run(y.device):
        return combine_reference(y, rows, weights)
    t, k = weights.shape
    d = y.shape[1]
    weights = weights.contiguous()
    check_combined(Combined(y, rows, weights), t, d)
    out = torch.empty(t, d, dtype=torch.float32, device=y.device)
    if t and d:
        launcher(_combine_kernel, y.device)[(t, -(-d // _COMBINE_BLOCK))](
            y, rows, weights, out, d, K=k, BLOCK=_COMBINE_BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------- routing and grouping fused


class Routed(NamedTuple):
    """route_group's result: route's (weights, experts), group_tiles' (rows, tokens) and a
    tile table for each asked block_m, and h rounded to bf16 where asked."""

    weights: torch.Tensor
    experts: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    tiles: dict[int, torch.Tensor]
    x_bf16: torch.Tensor | None


class RouteCounters:
    """The arrival counters of route_group's one launch (1 + T + its token blocks): int32,
    zero between launches (each launch sets back what it counted). Grown with T and never
    freed: a captured graph keeps its buffer's address. One a MoE block (blocks of one model
    run in order, on one stream)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def get(self, count: int, device: torch.device) -> torch.Tensor:
        """A zeroed buffer of at least `count` counters on `device`."""
        for buf in reversed(self._buffers):
            if buf.device == device and buf.numel() >= count:
                return buf
        buf = torch.zeros(max(512, 2 * count), dtype=torch.int32, device=device)
        self._buffers.append(buf)
        return buf


def fused_routing() -> bool:
    """Whether route_group runs its one launch (the default) or route's two and a grouping
    launch a table: MBUFO_MOE_FUSED_ROUTE=0 (for timing both)."""
    return os.environ.get("MBUFO_MOE_FUSED_ROUTE", "1") != "0"


if HAS_TRITON:

    @helper
    def _block_ranks(experts_ptr, rows_ptr, hist_ptr, b, P, K, E, TB: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
        """Token block b's pairs (those of tokens b TB .. b TB + TB - 1): each pair's rank
        among the block's pairs of its expert, in pair order, into rows[p]; the block's
        counts a expert into hist[b]. The experts come from other programs (volatile)."""
        e = tl.arange(0, BLOCK_E)
        seen = tl.zeros((BLOCK_E,), tl.int32)
        first = b * TB * K
        end = tl.minimum(P, first + TB * K)
        for p0 in range(first, end, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ex = _expert_of(experts_ptr, p, end, E, BLOCK_E, True)
            hot = (ex[:, None] == e[None, :]).to(tl.int32)  # (pairs, experts)
            before = tl.cumsum(hot, axis=0) - hot + seen[None, :]
            tl.store(rows_ptr + p, tl.sum(hot * before, axis=1), mask=p < end)
            seen += tl.sum(hot, axis=0)
        tl.store(hist_ptr + b * E + e, seen, mask=e < E)

    @helper
    def _place_blocks(experts_ptr, rows_ptr, tokens_ptr, hist_ptr, blocks, P, K, E,
                      TB: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_PP: tl.constexpr):
        """After every block's _block_ranks: each block's first row an expert (hist[b, e]
        becomes the expert's first row + its pairs in the blocks before b), each pair's
        sorted row (that + its rank: group_tiles' stable order), each row's token ->
        (counts, each expert's first row)."""
        e = tl.arange(0, BLOCK_E)
        e_ok = (e < E)[None, :]
        counts = tl.zeros((BLOCK_E,), tl.int32)
        for b0 in range(0, blocks, BLOCK_R):
            r = b0 + tl.arange(0, BLOCK_R)
            h = tl.load(hist_ptr + r[:, None] * E + e[None, :], mask=(r < blocks)[:, None]
                        & e_ok, other=0, volatile=True)
            counts += tl.sum(h, axis=0)
        starts = tl.cumsum(counts, axis=0) - counts
        below = starts
        for b0 in range(0, blocks, BLOCK_R):
            r = b0 + tl.arange(0, BLOCK_R)
            at = hist_ptr + r[:, None] * E + e[None, :]
            ok = (r < blocks)[:, None] & e_ok
            h = tl.load(at, mask=ok, other=0, volatile=True)
            tl.store(at, tl.cumsum(h, axis=0) - h + below[None, :], mask=ok)
            below += tl.sum(h, axis=0)
        tl.debug_barrier()  # the bases above, before any thread reads them back
        for p0 in range(0, P, BLOCK_PP):
            p = p0 + tl.arange(0, BLOCK_PP)
            ok = p < P
            ex = tl.minimum(_expert_of(experts_ptr, p, P, E, BLOCK_E, True), E - 1)
            base = tl.load(hist_ptr + (p // K) // TB * E + ex, mask=ok, other=0, volatile=True)
            row = base + tl.load(rows_ptr + p, mask=ok, other=0, volatile=True)
            tl.store(rows_ptr + p, row, mask=ok)
            tl.store(tokens_ptr + row, p // K, mask=ok)
        return counts, starts

    @helper
    def _place_and_cut(experts_ptr, rows_ptr, tokens_ptr, hist_ptr, tiles_a_ptr, tiles_b_ptr,
                       blocks, P, K, E, block_m_a, block_m_b, slots_a, slots_b,
                       TB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_PP: tl.constexpr, BLOCK_T: tl.constexpr,
                       TWO_TABLES: tl.constexpr):
        """_place_blocks, then the tile table of block_m_a (and of block_m_b)."""
        counts, starts = _place_blocks(experts_ptr, rows_ptr, tokens_ptr, hist_ptr, blocks, P,
                                       K, E, TB, BLOCK_P, BLOCK_E, BLOCK_PP)
        _cut_tiles(counts, starts, tiles_a_ptr, E, block_m_a, slots_a, BLOCK_E, BLOCK_T)
        if TWO_TABLES:
            _cut_tiles(counts, starts, tiles_b_ptr, E, block_m_b, slots_b, BLOCK_E, BLOCK_T)

    @jit(do_not_specialize=["d", "T", "blocks", "slots_a", "slots_b"])
    def _route_group_kernel(
        x_ptr, w_ptr, b_ptr, logits_ptr, weights_ptr, experts_ptr, xb_ptr, counters_ptr,
        rows_ptr, tokens_ptr, hist_ptr, tiles_a_ptr, tiles_b_ptr, d, E, stride_x, T, blocks,
        scale, block_m_a, block_m_b, slots_a, slots_b, LOGIT_E: tl.constexpr,
        LOGIT_K: tl.constexpr,
        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KP: tl.constexpr,
        NORMALIZE: tl.constexpr, SCALE: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_T: tl.constexpr, TB: tl.constexpr, BLOCK_PP: tl.constexpr,
        WRITE_XB: tl.constexpr, TWO_TABLES: tl.constexpr, PDL: tl.constexpr = False,
        HAS_BIAS: tl.constexpr = False,
    ):
        """route, then group_tiles, in one launch of route's router grid. Each program
        computes its logits part (_logits_part); the last of a token's programs to finish
        (counted in counters[1 + t]) runs the token's top-k (_topk_row); the last token of
        a block of TB tokens (counters[1 + T + b]) ranks the block's pairs
        (_block_ranks); the last block (counters[0]) places every pair and cuts the tile
        tables (_place_blocks, _cut_tiles). Each counter is set back to 0 by the program
        it elects. A program's stores are ordered before its count by a barrier of the
        program and the count's acq_rel atomic (release); the elected program reads after
        its own (acquire), with volatile loads."""
        t = tl.program_id(0).to(tl.int64)
        await_inputs(PDL)
        _logits_part(x_ptr, w_ptr, b_ptr, logits_ptr, xb_ptr, t, tl.program_id(1), d, E,
                     stride_x, LOGIT_E, LOGIT_K, WRITE_XB, HAS_BIAS)
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + 1 + t, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.store(counters_ptr + 1 + t, 0)
            _topk_row(logits_ptr, weights_ptr, experts_ptr, t, E, scale, K, BLOCK_E,
                      BLOCK_KP, NORMALIZE, SCALE, True)
            tl.debug_barrier()
            b = t // TB
            in_block = tl.minimum(T - b * TB, TB)
            ranked = tl.atomic_add(counters_ptr + 1 + T + b, 1, sem="acq_rel", scope="gpu")
            if ranked == in_block - 1:
                tl.store(counters_ptr + 1 + T + b, 0)
                _block_ranks(experts_ptr, rows_ptr, hist_ptr, b, T * K, K, E, TB, BLOCK_P,
                             BLOCK_E)
                tl.debug_barrier()
                placed = tl.atomic_add(counters_ptr, 1, sem="acq_rel", scope="gpu")
                if placed == blocks - 1:
                    tl.store(counters_ptr, 0)
                    _place_and_cut(experts_ptr, rows_ptr, tokens_ptr, hist_ptr, tiles_a_ptr,
                                   tiles_b_ptr, blocks, T * K, K, E, block_m_a, block_m_b,
                                   slots_a, slots_b, TB, BLOCK_P, BLOCK_E, BLOCK_PP, BLOCK_T,
                                   TWO_TABLES)

    @jit(do_not_specialize=["T", "blocks", "slots_a", "slots_b"])
    def _group_blocks_kernel(
        experts_ptr, counters_ptr, rows_ptr, tokens_ptr, hist_ptr, tiles_a_ptr, tiles_b_ptr, T,
        blocks, E, block_m_a, block_m_b, slots_a, slots_b, K: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
        TB: tl.constexpr, BLOCK_PP: tl.constexpr, TWO_TABLES: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """group_tiles over a program a block of TB tokens (_block_ranks); the last block
        to finish (counters[0], set back to 0 by it) places every pair and cuts the tables
        (route_group's grouping for steps of many tokens, after route's launches)."""
        b = tl.program_id(0).to(tl.int64)
        await_inputs(PDL)
        _block_ranks(experts_ptr, rows_ptr, hist_ptr, b, T * K, K, E, TB, BLOCK_P, BLOCK_E)
        tl.debug_barrier()
        placed = tl.atomic_add(counters_ptr, 1, sem="acq_rel", scope="gpu")
        if placed == blocks - 1:
            tl.store(counters_ptr, 0)
            _place_and_cut(experts_ptr, rows_ptr, tokens_ptr, hist_ptr, tiles_a_ptr,
                           tiles_b_ptr, blocks, T * K, K, E, block_m_a, block_m_b, slots_a,
                           slots_b, TB, BLOCK_P, BLOCK_E, BLOCK_PP, BLOCK_T, TWO_TABLES)


def _block_group_args(num_experts: int, k: int, cells: int, slot_cells: int) -> dict:
    """A block grouping's constexprs: steps of `cells` (pairs x experts) and `slot_cells`,
    and TB, its tokens a block: as many as fill one step of pairs."""
    args = _group_args(num_experts, cells, slot_cells)
    return {**args, "TB": max(1, args["BLOCK_P"] // k)}


def route_group(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                scale: float | None, block_ms: Sequence[int],
                counters: RouteCounters | None = None, x_bf16: bool = False,
                bias: torch.Tensor | None = None) -> Routed:
    """route and group_tiles (a table for each of `block_ms`), and with `x_bf16` h rounded
    to bf16 (as torch rounds). Where the kernels run, with `counters` (at most two distinct
    block_m, fused_routing on): one launch up to FUSED_MAX_TOKENS tokens, else route's two
    and a block grouping launch (a program a block of tokens); without: route's two
    launches and a one-program grouping launch a table. Elsewhere the references. The
    same bits every way."""
    sizes = sorted(set(block_ms))
    if not sizes:
        raise InvalidRequest("route_group: at least one tile height (block_m) is needed")
    e = router.shape[0]
    if not kernels_run(h.device):
        weights, experts = route_reference(h, router, k, normalize, scale, bias)
        return _grouped_after(weights, experts, e, sizes,
                              h.to(torch.bfloat16) if x_bf16 else None)
    _check_route(h, router, k, bias)
    (t, d), pairs = h.shape, h.shape[0] * k
    xb = torch.empty(t, d, dtype=torch.bfloat16, device=h.device) if x_bf16 else None
    if counters is None or len(sizes) > 2 or not fused_routing() or t == 0:
        weights, experts = _route_launches(h, router, k, normalize, scale, xb, bias)
        return _grouped_after(weights, experts, e, sizes, xb)
    one = t <= FUSED_MAX_TOKENS
    group = _block_group_args(e, k, *((_FUSED_CELLS, _FUSED_SLOT_CELLS) if one else
                                      (_GROUP_CELLS, _SLOT_CELLS)))
    blocks = -(-t // group["TB"])
    rows = torch.empty(pairs, dtype=torch.int32, device=h.device)
    tokens = torch.empty(pairs, dtype=torch.int32, device=h.device)
    hist = torch.empty(blocks, e, dtype=torch.int32, device=h.device)
    tiles = {m: torch.empty(max_tiles(pairs, e, m), 3, dtype=torch.int32, device=h.device)
             for m in sizes}
    a, b = tiles[sizes[0]], tiles[sizes[-1]]
    table_args = (sizes[0], sizes[-1], a.shape[0], b.shape[0])
    consts = {"BLOCK_PP": _PLACE_PAIRS, "TWO_TABLES": len(sizes) == 2}
    if not one:
        weights, experts = _route_launches(h, router, k, normalize, scale, xb, bias)
        launcher(_group_blocks_kernel, h.device)[(blocks,)](
            experts, counters.get(1, h.device), rows, tokens, hist, a, b, t, blocks, e,
            *table_args, K=k, **group, **consts, num_warps=4)
        return Routed(weights, experts, rows, tokens, tiles, xb)
    logits = torch.empty(t, e, dtype=torch.float32, device=h.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=h.device)
    experts = torch.empty(t, k, dtype=torch.int32, device=h.device)
    launcher(_route_group_kernel, h.device)[(t, -(-e // _LOGIT_EXPERTS))](
        h, router, router if bias is None else bias, logits, weights, experts,
        h if xb is None else xb,
        counters.get(1 + t + blocks, h.device), rows, tokens, hist, a, b, d, e, h.stride(0),
        t, blocks, 1.0 if scale is None else float(scale), *table_args,
        LOGIT_E=_LOGIT_EXPERTS, LOGIT_K=_LOGIT_K,
        **{**_topk_args(e, k, normalize, scale), **group}, WRITE_XB=xb is not None,
        HAS_BIAS=bias is not None, **consts, num_warps=4)
    return Routed(weights, experts, rows, tokens, tiles, xb)


def _grouped_after(weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   sizes: list[int], xb: torch.Tensor | None) -> Routed:
    """route_group from a routing: a grouping a tile height (the rows and tokens of each
    are the same)."""
    tables = {m: group_tiles(experts, num_experts, m) for m in sizes}
    rows, tokens, _ = tables[sizes[0]]
    return Routed(weights, experts, rows, tokens, {m: v[2] for m, v in tables.items()}, xb)


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the routing and glue kernels at Qwen3-30B-A3B's 128 experts, 8 a
    token; the fused routing also as the decode graphs launch it on sm_90 (PDL)."""
    if not HAS_TRITON:
        return []
    topk = {"K": 8, "BLOCK_E": 128, "BLOCK_KP": 8, "NORMALIZE": True, "SCALE": False}
    group = {"BLOCK_P": _GROUP_CELLS // 128, "BLOCK_E": 128, "BLOCK_T": _SLOT_CELLS // 128}
    fused_sig = {**{n: "*fp32" for n in ("x_ptr", "w_ptr", "b_ptr", "logits_ptr",
                                         "weights_ptr")},
                 "experts_ptr": "*i32", "xb_ptr": "*bf16",
                 **{n: "*i32" for n in ("counters_ptr", "rows_ptr", "tokens_ptr", "hist_ptr",
                                        "tiles_a_ptr", "tiles_b_ptr")},
                 **{n: "i32" for n in ("d", "E", "stride_x", "T", "blocks")}, "scale": "fp32",
                 **{n: "i32" for n in ("block_m_a", "block_m_b", "slots_a", "slots_b")}}
    fused_group = _block_group_args(128, 8, _FUSED_CELLS, _FUSED_SLOT_CELLS)
    fused_consts = {"LOGIT_E": _LOGIT_EXPERTS, "LOGIT_K": _LOGIT_K, **topk,
                    "BLOCK_P": fused_group["BLOCK_P"], "BLOCK_T": fused_group["BLOCK_T"],
                    "TB": fused_group["TB"], "BLOCK_PP": _PLACE_PAIRS, "WRITE_XB": True,
                    "TWO_TABLES": True, "HAS_BIAS": False}
    fused = [spec(f"moe_route_group{suffix}", _route_group_kernel,
                  {**fused_sig, **{n: "constexpr" for n in consts}}, consts, 4, False, backend)
             for suffix, backend, consts in (
                 ("", None, fused_consts), ("_pdl", "cuda", {**fused_consts, "PDL": True}))]
    block_group = _block_group_args(128, 8, _GROUP_CELLS, _SLOT_CELLS)
    blocks_sig = {**{n: "*i32" for n in ("experts_ptr", "counters_ptr", "rows_ptr",
                                         "tokens_ptr", "hist_ptr", "tiles_a_ptr",
                                         "tiles_b_ptr")},
                  **{n: "i32" for n in ("T", "blocks", "E", "block_m_a", "block_m_b",
                                        "slots_a", "slots_b")}}
    blocks_consts = {"K": 8, **block_group, "BLOCK_PP": _PLACE_PAIRS, "TWO_TABLES": True}
    fused += [spec(f"moe_group_blocks{suffix}", _group_blocks_kernel,
                   {**blocks_sig, **{n: "constexpr" for n in consts}}, consts, 4, False, backend)
              for suffix, backend, consts in (("", None, blocks_consts),
                                              ("_pdl", "cuda", {**blocks_consts, "PDL": True}))]
    return [
        spec("moe_router_logits", _router_logits_kernel,
             {"x_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32",
              "xb_ptr": "*bf16", "d": "i32", "E": "i32", "stride_x": "i32",
              "BLOCK_E": "constexpr", "BLOCK_K": "constexpr", "WRITE_XB": "constexpr",
              "HAS_BIAS": "constexpr"},
             {"BLOCK_E": _LOGIT_EXPERTS, "BLOCK_K": _LOGIT_K, "WRITE_XB": True,
              "HAS_BIAS": True}, 4, False),
        spec("moe_topk", _topk_kernel,
             {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i32", "E": "i32",
              "scale": "fp32", **{n: "constexpr" for n in topk}}, topk, 4, False),
        spec("moe_group", _group_kernel,
             {"experts_ptr": "*i32", "rows_ptr": "*i32", "tokens_ptr": "*i32",
              "tiles_ptr": "*i32", "P": "i32", "k": "i32", "E": "i32", "block_m": "i32",
              "slots": "i32", **{n: "constexpr" for n in group}}, group, 4, False),
        spec("moe_combine", _combine_kernel,
             {"y_ptr": "*fp32", "rows_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*fp32",
              "D": "i32", "K": "constexpr", "BLOCK": "constexpr"},
             {"K": 8, "BLOCK": _COMBINE_BLOCK}, 4, False),
        *fused,
    ]
