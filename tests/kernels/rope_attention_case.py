"""Worker-side calls of the RoPE-folded decode attention (tests/kernels/test_paged_attention.py):
the kernels write into the KV planes, which a worker's return value must carry back."""

from __future__ import annotations

import torch

from kernels.fused_rope import KVStore, rope_qk
from kernels.paged_attention import RopeStore, paged_attention, paged_attention_q8


def folded(q, k, v, cos, sin, neox, slots, k_planes, v_planes, weights, config, kw,
           quantize=False):
    """The folded launch: (out, xq or None, k_planes, v_planes) after it."""
    rope = RopeStore(k, v, cos, sin, neox, slots, *weights, eps=1e-6)
    args = (q, k_planes, v_planes, "f16", "f16")
    if quantize:
        out, xq = paged_attention_q8(*args, config=config, rope=rope, **kw)
    else:
        out, xq = paged_attention(*args, config=config, rope=rope, **kw), None
    return out, xq, k_planes, v_planes


def separate(q, k, v, cos, sin, neox, slots, k_planes, v_planes, weights, config, kw):
    """rope_qk with its K/V store, then the attention: (out, k_planes, v_planes)."""
    q, _ = rope_qk(q, k, cos, sin, neox, *weights, eps=1e-6,
                   store=KVStore(v, slots, k_planes, v_planes, "f16", "f16"))
    out = paged_attention(q, k_planes, v_planes, "f16", "f16", config=config, **kw)
    return out, k_planes, v_planes


def planes_copy(planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.clone() for name, p in planes.items()}


def forward_counting_rope(runner, batch, fold: bool):
    """runner.forward(batch) with MBUFO_ATTN_ROPE set to `fold`: (logits, how many times
    rope_qk ran: a layer the attention did not fold RoPE into)."""
    import os

    from engine.models import common

    calls = []
    original = common.rope_qk

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    os.environ["MBUFO_ATTN_ROPE"] = "1" if fold else "0"
    common.rope_qk = counting
    try:
        return runner.forward(batch), len(calls)
    finally:
        common.rope_qk = original
        os.environ.pop("MBUFO_ATTN_ROPE")
