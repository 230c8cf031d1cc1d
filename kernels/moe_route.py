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
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequest
from kernels.triton_util import (
    HAS_TRITON,
    helper,
    interpreter_active,
    jit,
    launcher,
    next_pow2,
    tl,
)

__all__ = ["combine", "combine_reference", "group_tiles", "group_tiles_reference",
           "max_tiles", "route", "route_reference"]

WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the picked weights' sum (f16's least)
_LOGIT_EXPERTS, _LOGIT_K = 4, 512  # a router program's experts and columns a step
# The grouping program's (pairs, experts) and (tile slots, experts) steps: 64 pairs and 32
# slots a step at 128 experts, fewer with more experts (the same registers a step)
_GROUP_CELLS, _SLOT_CELLS = 8192, 4096
_COMBINE_BLOCK = 1024


def kernels_run(device: torch.device) -> bool:
    return HAS_TRITON and (device.type != "cpu" or interpreter_active())


# ---------------------------------------------------------------- routing


def route_reference(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """h (T, d), router (E, d) -> (weights (T, k) float32 (float64 for float64 h),
    experts (T, k) int64)."""
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    probs = torch.softmax(h.to(dtype) @ router.to(dtype).t(), dim=-1)
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

    @jit(do_not_specialize=["d"])
    def _router_logits_kernel(x_ptr, w_ptr, out_ptr, d, E, stride_x, BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """out[t, e] = router[e] . x[t] for BLOCK_E experts, BLOCK_K columns a step in
        column order, float32."""
        t = tl.program_id(0)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < E
        acc = tl.zeros((BLOCK_E,), tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < d
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=k_ok, other=0.0)
            w = tl.load(w_ptr + e[:, None].to(tl.int64) * d + k[None, :],
                        mask=e_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + t.to(tl.int64) * E + e, acc, mask=e_ok)

    @jit
    def _topk_kernel(logits_ptr, weights_ptr, experts_ptr, E, scale, K: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_KP: tl.constexpr, NORMALIZE: tl.constexpr,
                     SCALE: tl.constexpr):
        """A token's softmax over its E logits, its K largest (descending, the lower expert
        on a tie), normalized and scaled."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf"))
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


def route(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
          scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """route_reference's routing -> (weights (T, k) float32, experts (T, k) int32 on the
    kernels, int64 on the reference); two launches where the kernels run."""
    if not kernels_run(h.device):
        return route_reference(h, router, k, normalize, scale)
    if h.dim() != 2 or router.dim() != 2 or h.shape[1] != router.shape[1] or \
            h.dtype != torch.float32 or router.dtype != torch.float32 or h.stride(1) != 1 \
            or not router.is_contiguous() or not 0 < k <= router.shape[0]:
        raise InvalidRequest(f"route: h (T, d) and router (E, d) float32 and 0 < k <= E, "
                             f"got {h.dtype} {tuple(h.shape)}, {router.dtype} "
                             f"{tuple(router.shape)}, k={k}")
    (t, d), e = h.shape, router.shape[0]
    logits = torch.empty(t, e, dtype=torch.float32, device=h.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=h.device)
    experts = torch.empty(t, k, dtype=torch.int32, device=h.device)
    if t:
        launcher(_router_logits_kernel, h.device)[(t, -(-e // _LOGIT_EXPERTS))](
            h, router, logits, d, e, h.stride(0), BLOCK_E=_LOGIT_EXPERTS, BLOCK_K=_LOGIT_K,
            num_warps=4)
        launcher(_topk_kernel, h.device)[(t,)](
            logits, weights, experts, e, 1.0 if scale is None else float(scale), K=k,
            BLOCK_E=next_pow2(e), BLOCK_KP=next_pow2(k), NORMALIZE=normalize,
            SCALE=scale is not None, num_warps=4)
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
    def _expert_of(experts_ptr, p, P, E, BLOCK_E: tl.constexpr):
        """Pair p's expert, clamped into [0, E) (every pair gets a row whatever its id);
        BLOCK_E (no expert) past the P pairs."""
        ex = tl.load(experts_ptr + p, mask=p < P, other=0)
        return tl.where(p < P, tl.minimum(tl.maximum(ex, 0), E - 1), BLOCK_E)

    @jit(do_not_specialize=["P", "slots"])
    def _group_kernel(experts_ptr, rows_ptr, tokens_ptr, tiles_ptr, P, k, E, block_m, slots,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
        """One program: the experts' pair counts, each pair's stable sorted row (its
        expert's first row + the pairs of that expert before it), each row's token, and
        the tile table."""
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ex = _expert_of(experts_ptr, p, P, E, BLOCK_E)
            counts += tl.sum((ex[:, None] == e[None, :]).to(tl.int32), axis=0)
        starts = tl.cumsum(counts, axis=0) - counts
        seen = tl.zeros((BLOCK_E,), tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ex = _expert_of(experts_ptr, p, P, E, BLOCK_E)
            hot = (ex[:, None] == e[None, :]).to(tl.int32)  # (pairs, experts)
            before = tl.cumsum(hot, axis=0) - hot + (starts + seen)[None, :]
            row = tl.sum(hot * before, axis=1)
            tl.store(rows_ptr + p, row, mask=p < P)
            tl.store(tokens_ptr + row, p // k, mask=p < P)
            seen += tl.sum(hot, axis=0)
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
        width = next_pow2(num_experts)
        launcher(_group_kernel, flat.device)[(1,)](
            flat, rows, tokens, tiles, pairs, k, num_experts, block_m, slots,
            BLOCK_P=max(8, _GROUP_CELLS // width), BLOCK_E=width,
            BLOCK_T=max(8, _SLOT_CELLS // width), num_warps=4)
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


if HAS_TRITON:

    @jit(do_not_specialize=["D"])
    def _combine_kernel(y_ptr, rows_ptr, weights_ptr, out_ptr, D, K: tl.constexpr,
                        BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < D
        row = tl.load(rows_ptr + t * K).to(tl.int64)
        acc = tl.load(y_ptr + row * D + c, mask=ok, other=0.0) * tl.load(weights_ptr + t * K)
        for j in tl.static_range(1, K):
            row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            acc += tl.load(y_ptr + row * D + c, mask=ok, other=0.0) * tl.load(
                weights_ptr + t * K + j)
        tl.store(out_ptr + t * D + c, acc, mask=ok)


def combine(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """combine_reference's sum; one launch where the kernels run."""
    if not kernels_run(y.device):
        return combine_reference(y, rows, weights)
    t, k = weights.shape
    d = y.shape[1]
    out = torch.empty(t, d, dtype=torch.float32, device=y.device)
    if t and d:
        launcher(_combine_kernel, y.device)[(t, -(-d // _COMBINE_BLOCK))](
            y, rows, weights.contiguous(), out, d, K=k, BLOCK=_COMBINE_BLOCK, num_warps=4)
    return out


def aot_specs(spec: type) -> list:
    """kernels/aot.py: the routing and glue kernels at Qwen3-30B-A3B's 128 experts, 8 a
    token."""
    if not HAS_TRITON:
        return []
    return [
        spec("moe_router_logits", _router_logits_kernel,
             {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "d": "i32", "E": "i32",
              "stride_x": "i32", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"},
             {"BLOCK_E": _LOGIT_EXPERTS, "BLOCK_K": _LOGIT_K}, 4, False),
        spec("moe_topk", _topk_kernel,
             {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i32", "E": "i32",
              "scale": "fp32", "K": "constexpr", "BLOCK_E": "constexpr",
              "BLOCK_KP": "constexpr", "NORMALIZE": "constexpr", "SCALE": "constexpr"},
             {"K": 8, "BLOCK_E": 128, "BLOCK_KP": 8, "NORMALIZE": True, "SCALE": False}, 4,
             False),
        spec("moe_group", _group_kernel,
             {"experts_ptr": "*i32", "rows_ptr": "*i32", "tokens_ptr": "*i32",
              "tiles_ptr": "*i32", "P": "i32", "k": "i32", "E": "i32", "block_m": "i32",
              "slots": "i32", "BLOCK_P": "constexpr", "BLOCK_E": "constexpr",
              "BLOCK_T": "constexpr"},
             {"BLOCK_P": _GROUP_CELLS // 128, "BLOCK_E": 128, "BLOCK_T": _SLOT_CELLS // 128},
             4, False),
        spec("moe_combine", _combine_kernel,
             {"y_ptr": "*fp32", "rows_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*fp32",
              "D": "i32", "K": "constexpr", "BLOCK": "constexpr"},
             {"K": 8, "BLOCK": _COMBINE_BLOCK}, 4, False),
    ]
