"""Test helper run in the interpreter worker: one MoE block both ways."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from test_qmatmul import random_weight

from engine.kernel_select import set_mode
from engine.layers.moe import GroupedExperts, MoE


def block_both_ways(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the block's output on the kernels, on the per-expert reference) for 13 tokens."""
    rng = np.random.default_rng(seed)
    e, hidden, ffn = 8, 256, 256

    def experts(qtype: T, n: int, k: int) -> GroupedExperts:
        return GroupedExperts(torch.stack([random_weight(qtype, n, k, rng) for _ in range(e)]),
                              int(qtype), (n, k))

    router = torch.from_numpy(rng.standard_normal((e, hidden), dtype=np.float32)) * 0.3
    moe = MoE(router, [experts(T.Q4_K, ffn, hidden), experts(T.Q8_0, ffn, hidden)],
              experts(T.Q6_K, hidden, ffn), 3, True, 1.5, "silu")
    h = torch.from_numpy(rng.standard_normal((13, hidden), dtype=np.float32))
    set_mode("triton")
    try:
        grouped = moe(h)
    finally:
        set_mode(None)
    return grouped, moe._per_expert(h)


def model_logits(path: str, weights: str, mode: str) -> tuple[torch.Tensor, set[str]]:
    """A prompt's last logits from a tiny model loaded on the CPU with `weights`, the
    kernels in `mode` (triton: interpreted, as a GPU would run them), and the kinds of
    its experts."""
    engine_tests = str(Path(__file__).parents[1] / "engine")  # span_batch's folder
    if engine_tests not in sys.path:
        sys.path.insert(0, engine_tests)
    from span_batch import span_batch

    from engine.build import EngineOptions, load_for
    from engine.kv.pool import SeqPages
    from engine.runner import ModelRunner

    set_mode(mode)
    try:
        model = load_for(path, EngineOptions(device="cpu", dtype="f32", weights=weights)).model
        kinds = {type(p).__name__ for b in model.blocks for p in (*b.moe.gate_up, b.moe.down)}
        runner = ModelRunner(model, 64, 16, "f16", cuda_graphs=False, max_context=256)
        seq = SeqPages(runner.pool)
        return runner.forward(span_batch(runner, [seq], [(0, list(range(100, 112)))])), kinds
    finally:
        set_mode(None)


def route_group_ways(h: torch.Tensor, router: torch.Tensor, k: int, normalize: bool,
                     scale: float | None, heights: list[int], x_bf16: bool,
                     fused_max: int | None = None, bias: torch.Tensor | None = None) -> tuple:
    """route_group's fused launches twice on one RouteCounters, what they left in them,
    and the separate launches (no counters): (fused, again, left, separate). `fused_max`:
    FUSED_MAX_TOKENS for the call (0: route's launches and the block grouping)."""
    from kernels import moe_route
    from kernels.moe_route import RouteCounters, route_group

    before = moe_route.FUSED_MAX_TOKENS
    if fused_max is not None:
        moe_route.FUSED_MAX_TOKENS = fused_max
    try:
        counters = RouteCounters()
        fused = route_group(h, router, k, normalize, scale, heights, counters, x_bf16, bias)
        again = route_group(h, router, k, normalize, scale, heights, counters, x_bf16, bias)
        left = counters.get(h.shape[0], h.device).clone()
        separate = route_group(h, router, k, normalize, scale, heights, None, x_bf16, bias)
    finally:
        moe_route.FUSED_MAX_TOKENS = before
    return fused, again, left, separate


def hip_grouped(x: torch.Tensor, blocks: torch.Tensor, qtype: int, shape: tuple[int, int],
                experts: torch.Tensor, gated: str | None = None,
                out_dtype: torch.dtype = torch.float32):
    """moe_matmul at the configs gfx1151 launches (kernels.moe.moe_configs' hip branch),
    interpreted: -> (output, sorted rows' order, tokens, (block_m, block_n, block_k))."""
    import kernels.moe as moe
    from kernels.moe_route import group_tiles_reference

    device_info, moe._device_info = moe._device_info, lambda device: ("hip", 40)
    moe.plan_for.cache_clear()
    try:
        pairs = experts.numel()
        cfg = moe.plan_for(qtype, shape, x.device).config(pairs, blocks.shape[0])
        rows, tokens, tiles = group_tiles_reference(experts, blocks.shape[0], cfg.block_m)
        y = moe.moe_matmul(x, blocks, qtype, shape, tokens, tiles, pairs, gated, out_dtype)
        return y, rows, tokens, (cfg.block_m, cfg.block_n, cfg.block_k)
    finally:
        moe._device_info = device_info
        moe.plan_for.cache_clear()
